"""The scheduler process: the one place that holds the run's global view.

Started by the launcher as ``python -m sdpipe_cli.sync.scheduler``, it is a client of the run's
TCPStore like every worker. This module is the transport: it pops worker events from the store's
queue, feeds ready signals to the pure group policy (:mod:`sdpipe_cli.core.grouping`) and writes each
decision back under :func:`~sdpipe_cli.runtime.store.decision_key`, where the waiting workers read it. It
also folds progress events into a :class:`~sdpipe_cli.runtime.metrics.RunTracker`, writes
``metrics.jsonl`` and ``summary.json``, and publishes a snapshot for the launcher's display.

The loop blocks on the event queue (no polling); a small ticker thread pushes a ``tick`` event
when the policy's next deadline passes, and at least every :data:`TICK_S` seconds for heartbeats.
A worker silent past ``run.heartbeat_timeout`` fails the run with its name; where a run survives
a lost pipeline (``fault.on_pipeline_loss=continue|restart``) it is named under
:data:`~sdpipe_cli.runtime.store.HUNG` instead, and the launcher kills it and handles the loss.

Restarted pipelines (``restart``): the launcher says so with the ``lost`` event (``restart``) and a
``restart`` event when it starts the new processes; each of their workers asks to ``rejoin``, and
the policy's decision that heals it names its source, which the scheduler writes under
:func:`~sdpipe_cli.runtime.store.heal_key` (or ``stop``, when the run ended first). Every
decision carries its members' incarnations, which name their communicators.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.core.cadence import Cadence, GlobalSyncCheckpoints
from sdpipe_cli.core.grouping import Decision, make_policy
from sdpipe_cli.core.meetings import meetings_of
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.runtime.bootstrap import child, connect_store
from sdpipe_cli.runtime.metrics import MetricsLog, RunTracker, strict_json
from sdpipe_cli.runtime.trace import Tracer, trace_path
from sdpipe_cli.runtime.stragglers import StragglerWatch
from sdpipe_cli.runtime.trackers import open_sinks
from sdpipe_cli.sync import journal
from sdpipe_cli.sync.replay import load as load_recorded
from sdpipe_cli.sync.journal import journal_path
from sdpipe_cli.model import checkpoint

log = logging.getLogger("sdpipe.scheduler")

TICK_S = 0.5  # longest sleep between ticks (heartbeats, time limit, progress)
PUBLISH_S = 0.2  # how often the progress snapshot is refreshed


class WorkerHung(RuntimeError):
    pass


class Ticker(threading.Thread):
    """Pushes ``tick`` events into the queue at the policy's deadlines (own store connection)."""

    def __init__(self, connect: Callable[[], object]):
        super().__init__(daemon=True, name="ticker")
        self.events = store.namespace(connect())
        self.cond = threading.Condition()
        self.deadline: Optional[float] = None
        self.stopped = False

    def wake_at(self, deadline: Optional[float]) -> None:
        with self.cond:
            # Only a sooner deadline needs the thread now: a later one (or none) is seen when it
            # wakes for the one it sleeps towards, and it goes back to sleep without a tick. Waking
            # it on every event costs a context switch per event under load.
            sooner = deadline is not None and (self.deadline is None or deadline < self.deadline)
            self.deadline = deadline
            if sooner:
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def run(self) -> None:
        next_beat = time.monotonic() + TICK_S
        while True:
            with self.cond:
                while not self.stopped:
                    now = time.monotonic()
                    due = next_beat if self.deadline is None else min(self.deadline, next_beat)
                    if due <= now:
                        break
                    self.cond.wait(due - now)
                if self.stopped:
                    return
                self.deadline = None
            next_beat = time.monotonic() + TICK_S
            store.push(self.events, store.EVENTS, protocol.Tick())


class _Held:
    """The store, for a scheduler replaying its journal: reads go through, writes are held
    (those of the batch being replayed, for :meth:`Scheduler.go_live`)."""

    def __init__(self, real):
        self.store = real
        self.last_batch: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> None:
        self.last_batch[key] = value

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.last_batch.update(zip(keys, values))

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def get(self, key: str) -> Any:
        return self.store.get(key)


class _Muted:
    """``metrics.jsonl`` while replaying: the dead scheduler wrote those lines already."""

    def write(self, record: Optional[dict]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


class Scheduler:
    """Event handling of one run; the store and the clock are injected."""

    def __init__(self, cfg: DictConfig, run_dir: Path, events, clock=time.monotonic,
                 resume: Optional[Path] = None, live: bool = True):
        plan = RunPlan.of(cfg)
        P, S = plan.pipelines, plan.stages
        # ``live=False``: replaying a dead scheduler's journal; what it wrote is held back
        self.live = live
        events = events if live else _Held(events)
        self.cfg, self.run_dir, self.events, self.clock = cfg, run_dir, events, clock
        self.grid = plan.grid
        self.stop_seen: Optional[bool] = None  # the stop flag as the transport read it
        self.tracker = RunTracker(P, S, plan.budget, clock=clock,
                                  heartbeat_timeout=cfg.run.heartbeat_timeout)
        self.stragglers = StragglerWatch(cfg, plan) if cfg.fault.on_slowdown != "off" else None
        # sync.replay: a recorded run's decisions instead of the policy's (sync/replay.py)
        self.recorded = (load_recorded(cfg.sync.replay, cfg) if cfg.sync.get("replay")
                         else None)
        self.policy = (make_policy(cfg, plan, clock) if mode(cfg.sync.name).group_policy
                       and self.recorded is None else None)
        # the policy counts meetings (sync.every iterations each); checkpoints and heals, steps
        self.meetings = meetings_of(cfg.sync)
        self.metrics = self._metrics() if live else _Muted()
        self.rounds = [[0] * P for _ in range(S)]  # rounds each replica took part in
        self.group_sizes: list[int] = []
        self.started = clock()
        self.t0 = store.run_clock(events)  # the workers' time axis, for metrics lines
        self.published = 0.0
        self.saved: dict[int, dict[int, int]] = {}  # checkpoint id -> rank -> step
        self.shards_from: dict[int, set[int]] = {}  # checkpoint id -> pipelines that save a shard
        self.stand_ins: dict[int, dict[int, int]] = {}  # checkpoint id -> the others' iterations
        self.global_seen = [0] * S  # global decisions per stage, to match policy.global_history
        self.global_checkpoint: dict[int, Optional[int]] = {}  # global index -> checkpoint id
        self.incarnation = [0] * P  # of each pipeline's processes: restarts so far
        self.rejoining: set[tuple[int, int]] = set()  # (stage, pipeline) waiting to be healed
        self.tolerant = cfg.fault.on_pipeline_loss != "stop"
        self.hung: set[int] = set()  # ranks named hung, until their pipeline is lost
        self.heals = self.restarts = 0
        self.scheduler_restarts = 0  # times this leg's scheduler was started again (go_live)
        self.checkpoints = GlobalSyncCheckpoints(Cadence.from_config(cfg), clock())
        self.tracer = (self._tracer() if cfg.run.trace and self.policy is not None and live
                       else None)
        if resume is not None:
            self._resume(resume)
        self._handlers: dict[type, Callable[[Any], None]] = {
            protocol.Tick: lambda _: None,
            protocol.Ready: self._ready if self.recorded is None else self._replayed,
            protocol.Begin: self._begin, protocol.Saved: self._saved,
            protocol.Lost: self._lost, protocol.Restart: self._restart,
            protocol.Rejoin: self._rejoin, protocol.Report: self._report}

    def _metrics(self) -> MetricsLog:
        return MetricsLog(self.run_dir / "metrics.jsonl", open_sinks(self.cfg, self.run_dir))

    def go_live(self, replayed: int, last: Optional[float], restart: int = 1) -> None:
        """The journal is replayed: write again what the last batch's handling wrote to the
        store (the dead scheduler may have died before it did; a key the workers already took
        is never read again), and from now on write for real."""
        held, self.events = self.events, self.events.store
        for key, value in held.last_batch.items():
            self.events.set(key, value)
        self.live, self.metrics = True, self._metrics()
        self.scheduler_restarts = restart
        now = self.clock()
        self.metrics.write({"kind": "scheduler_restart", "time": round(time.time() - self.t0, 4),
                            "restart": restart, "replayed_batches": replayed,
                            "silent_s": None if last is None else round(now - last, 4)})
        self.publish_progress()

    def new_batch(self) -> None:
        """Replaying: the next batch begins (only the last one's store writes are written again)."""
        if isinstance(self.events, _Held):
            self.events.last_batch.clear()

    def _stop_asked(self) -> bool:
        if self.stop_seen is not None:
            return self.stop_seen
        return self.events.check([store.STOP_REQUESTED])

    def _tracer(self) -> Tracer:
        """The scheduler's track of ``trace.json``: row 0 the batches of events, row 1 + s the
        ready signals and rounds of stage s."""
        tracer = Tracer(self.tracker.world_size, "scheduler", lambda: time.time() - self.t0, self.cfg.run.trace_events)
        tracer.rows = {0: "events", **{1 + s: f"stage {s}" for s in range(self.cfg.pipeline.stages)}}
        return tracer

    def _resume(self, ckpt: Path) -> None:
        shard = checkpoint.load_shard(ckpt, "scheduler")
        steps = {int(p): k for p, k in shard["steps"].items()}
        for p, k in steps.items():
            self.tracker.state[p].steps = k
            self.tracker.state[p].samples = k * self.cfg.train.batch_size
        if self.policy is not None:
            self.policy.resume({p: self.meetings.meeting(k) for p, k in steps.items()})
        self.checkpoints.resume(self._average(steps))
        # where this leg begins: readers of metrics.jsonl tell timelines apart by it (a leg
        # resumed from an older checkpoint goes back in iterations); ``at``: the checkpoint's
        # moment on the run clock, where its past ends
        self.metrics.write({"kind": "resume", "time": round(time.time() - self.t0, 4),
                            "checkpoint": ckpt.name, "steps": steps,
                            "at": round(float(shard.get("elapsed", 0.0)), 4)})

    def _average(self, steps: dict[int, int]) -> int:
        """Iterations of an average pipeline: how checkpoints are numbered in every sync mode."""
        return round(sum(steps.values()) / self.cfg.cluster.pipelines)

    def handle(self, event: protocol.Event) -> None:
        """Act on one event; one from a process of a replaced incarnation is dropped."""
        if not self._admit(event):
            return
        kind = event.type
        self._handlers[type(event)](event)
        if self.rejoining and self.policy is not None and self.policy.finished:
            self._answer_rejoins()
        if self.policy is not None:
            if kind == "tick" and not self.policy.stop_requested and self._stop_asked():
                log.info("stop requested: ending the run at the next global sync")
                self._publish(self.policy.request_stop())
            # ready and begin ran the policy's tick already. After other events a tick can only
            # close a round whose deadline passed (the ticker's tick for it may be queued behind
            # them); otherwise it is a pass over every replica that changes nothing.
            due = self.policy.next_deadline()
            if kind == "tick" or (kind not in ("ready", "begin")
                                  and due is not None and due <= self.clock()):
                self._publish(self.policy.tick())
        if kind == "tick":  # silence and start-up are measured in time: one look per tick will do
            self._check_health()
        # a worker's start is published at once: the launcher treats a Ctrl-C before every
        # worker started as an interrupted start-up, after that as a graceful stop
        if kind == "start" or self.clock() - self.published > PUBLISH_S:
            self.publish_progress()

    def _admit(self, event: protocol.Event) -> bool:
        """Whether ``event`` is acted on. Its sender must be a process of this run: rank, pipeline
        and stage in range and consistent (:class:`~sdpipe_cli.runtime.protocol.ProtocolError`
        otherwise). A worker's event from an incarnation its pipeline has left behind is stale
        (the process was stopped after it sent it) and is dropped; one from an incarnation the
        launcher never announced cannot come from this run."""
        if isinstance(event, protocol.Tick):
            return True
        P, S = self.cfg.cluster.pipelines, self.cfg.pipeline.stages
        key = store.PREFIX + store.EVENTS
        stage = getattr(event, "stage", self.grid.stage_of(event.rank))
        if not (0 <= event.pipeline < P and 0 <= stage < S
                and event.rank == self.grid.rank(event.pipeline, stage)):
            raise protocol.ProtocolError(key, f"{event.type} event from rank {event.rank}, pipeline "
                                              f"{event.pipeline}, stage {stage}: no such worker "
                                              f"in a run of {P} pipeline(s) x {S} stage(s)")
        if isinstance(event, (protocol.Lost, protocol.Restart)):
            return True
        known = self.incarnation[event.pipeline]
        if event.incarnation > known:
            raise protocol.ProtocolError(key, f"{event.type} event from incarnation "
                                              f"{event.incarnation} of pipeline {event.pipeline}, "
                                              f"which was never started (latest: {known})")
        if event.incarnation < known:
            log.debug("dropped a stale %s event of pipeline %d", event.type, event.pipeline)
            return False
        return True

    def _ready(self, event: protocol.Ready) -> None:
        if self.tracer is not None:
            self.tracer.instant(f"ready {event.pipeline}", "ready", "pipeline", event.pipeline,
                                "iteration", event.iteration, row=1 + event.stage)
        self._publish(self._policy().ready(event.stage, event.pipeline, event.iteration))

    def _replayed(self, event: protocol.Ready) -> None:
        """``sync.replay``: the recorded decision for this replica's round, at once (its members
        meet in the all-reduce, whenever each comes)."""
        group = self.recorded.get((event.stage, event.pipeline, event.iteration))
        if group is None:
            raise WorkerHung(f"sync.replay: the recorded run has no decision for stage "
                             f"{event.stage} of pipeline {event.pipeline} at iteration "
                             f"{event.iteration}; this run left the recording")
        store.put(self.events, store.decision_key(event.stage, event.pipeline, event.iteration),
                  group)
        if group.members[0] == event.pipeline:  # once per round
            for p in group.members:
                self.rounds[event.stage][p] += 1
            self.group_sizes.append(len(group.members))

    def _begin(self, event: protocol.Begin) -> None:
        """Asynchronous schedules: may this pipeline's segment go on?"""
        last, decisions = self._policy().begin(event.pipeline, event.iteration)
        store.put(self.events, store.begin_key(event.pipeline, event.iteration,
                                               self.incarnation[event.pipeline]),
                  protocol.BeginAnswer(last))
        self._publish(decisions)

    def _restart(self, event: protocol.Restart) -> None:
        """The launcher starts a lost pipeline's processes again."""
        self.restarts += 1
        self.incarnation[event.pipeline] = event.incarnation
        if self.stragglers is not None:
            self.stragglers.reset(event.pipeline)
        self.metrics.write(self.tracker.update(protocol.record(event)))

    def _report(self, event: protocol.Report) -> None:
        record = event.record()
        if event.type == "healed":  # the restarted worker's clock may not be the run's yet
            record["time"] = round(time.time() - self.t0, 4)
        line = self.tracker.update(record)
        if line is not None:
            self.metrics.write(line)
        for line in self.stragglers.lines(record) if self.stragglers is not None else ():
            log.warning("slow device %s (pipeline %d, stage %d): %s", line["device"],
                        line["pipeline"], line["stage"], line["kind"])
            self.metrics.write(line)
            self.published = 0.0  # the console says so at the next event
        self.heals += event.type == "healed"

    def _policy(self):
        """The group policy; an sdpipe event in a run without one cannot come from this run."""
        if self.policy is None:
            raise protocol.ProtocolError(store.PREFIX + store.EVENTS,
                                         f"a group event in a run with sync={self.cfg.sync.name}")
        return self.policy

    def _lost(self, event: protocol.Lost) -> None:
        p = event.pipeline
        self.metrics.write(self.tracker.update(protocol.record(event)))
        log.warning("pipeline %d lost%s: %s", p, " (restarting)" if event.restart else "",
                    event.reason)
        if self.hung & set(self.grid.pipeline_ranks(p)):
            self.hung -= set(self.grid.pipeline_ranks(p))
            self._name_hung()
        self.rejoining = {(s, q) for s, q in self.rejoining if q != p}
        if self.policy is not None:
            self._publish(self.policy.leave(p))
        for ckpt, pipelines in list(self.shards_from.items()):  # its shards will not come
            if p in pipelines:
                pipelines.discard(p)
                self.stand_ins[ckpt][p] = self._resume_step(p)
                self._finalize(ckpt)

    def _rejoin(self, event: protocol.Rejoin) -> None:
        s, p = event.stage, event.pipeline
        policy = self._policy()
        self.tracker.update(protocol.record(event))
        self.rejoining.add((s, p))
        if not policy.finished:
            self._publish(policy.rejoin(s, p))

    def _answer_rejoins(self) -> None:
        """The run ended while some restarted replicas waited to be healed: they stop."""
        for s, p in sorted(self.rejoining):
            store.put(self.events, store.heal_key(s, p, self.incarnation[p]),
                      protocol.HealAnswer(stop=True, iteration=self._resume_step(p, None)))
        self.rejoining.clear()

    def _publish(self, decisions: list[Decision]) -> None:
        # the run's global progress, for the members' learning-rate schedule
        done = self.policy.iterations_done() if decisions else None
        for d in decisions:
            ckpt = self._checkpoint_at(d) if d.kind == "global" else None
            # the restarted replicas this round's first member heals after its update
            heal = [protocol.HealTarget(q, self.incarnation[q], d.round) for q, _ in d.heal]
            # every member gets the same record, in one message: a set per member is a send and a
            # wake-up of the store each, which the last member of a large group waits behind
            group = protocol.Group(
                members=list(d.members), round=d.round, kind=d.kind, stop=d.stop,
                incarnations=[self.incarnation[p] for p in d.members], checkpoint=ckpt,
                done=done, twins=d.twins, weight_shares=list(d.weight_shares),
                grad_shares=list(d.grad_shares))
            keys = [store.decision_key(d.stage, p, k, self.incarnation[p])
                    for p, k in zip(d.members, d.iterations)]
            values = [protocol.encode(group)] * len(keys)
            if heal:  # to the source only
                values[0] = protocol.encode(dataclasses.replace(group, heal=heal))
            for q, k in d.heal:
                self.rejoining.discard((d.stage, q))
                keys.append(store.heal_key(d.stage, q, self.incarnation[q]))
                values.append(protocol.encode(protocol.HealAnswer(
                    stop=False, source=d.members[0],
                    source_incarnation=self.incarnation[d.members[0]],
                    iteration=self.meetings.steps(k), done=done,
                    round=d.round)))
            # stamped before the write: a member may read the decision before the write returns
            # here, and a stamp after it would then be later than the read it caused
            published = self.tracer.clock() if self.tracer is not None else None
            self.events.multi_set(keys, values)
            if self.tracer is not None:
                self.tracer.span(f"{d.kind} {d.round}", "round", published - max(d.waited),
                                 published, "members", list(d.members), "iterations",
                                 list(d.iterations), "twins", d.twins, row=1 + d.stage)
            for p in d.members:
                self.rounds[d.stage][p] += 1
            self.group_sizes.append(len(d.members))
            line = {
                "kind": "group", "time": round(time.time() - self.t0, 4), "stage": d.stage,
                "round": d.round, "group": d.kind, "members": list(d.members),
                "iterations": list(d.iterations), "size": len(d.members), "stop": d.stop,
                "twins": d.twins, "done": done,
                "max_wait_s": round(max(d.waited), 6), "waits": [round(w, 6) for w in d.waited]}
            if self.meetings.every > 1:  # iterations above count meetings of this many
                line["every"] = self.meetings.every
            if d.heal:  # the restarted replicas the first member heals: [pipeline, iteration]
                line["heal"] = [list(h) for h in d.heal]
            if d.weight_shares:  # a stale member counted less (sync.stale)
                line["weight_shares"] = list(d.weight_shares)  # exact: a replay uses them
                line["grad_shares"] = list(d.grad_shares)
            self.metrics.write(line)

    # -- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_at(self, d: Decision) -> Optional[int]:
        """With sdpipe, checkpoints are taken right after global syncs (the same one on every
        stage); which ones, :class:`~sdpipe_cli.core.cadence.GlobalSyncCheckpoints` decides."""
        g = self.global_seen[d.stage]
        self.global_seen[d.stage] += 1
        if g not in self.global_checkpoint:
            steps = {**self._missing_steps(d.members),
                     **{p: self.meetings.steps(k + 1)
                        for p, k in self.policy.global_history[g].items()}}
            ckpt = self.checkpoints.at_global_sync(self._average(steps), d.stop, self.clock())
            self.global_checkpoint[g] = ckpt
            if ckpt is not None:
                self.shards_from[ckpt] = set(d.members)
                self.stand_ins[ckpt] = self._missing_steps(d.members)
        return self.global_checkpoint[g]

    def _missing_steps(self, members) -> dict[int, int]:
        """Pipelines not at a global sync (lost, or restarting): the iterations each has done."""
        return {q: self._resume_step(q)
                for q in range(self.cfg.cluster.pipelines) if q not in members}

    def _resume_step(self, p: int, unknown: Optional[int] = 0) -> Optional[int]:
        """The local step a left pipeline would go on from (the policy counts meetings)."""
        k = self.policy.resume_at.get(p)
        return unknown if k is None else self.meetings.steps(k)

    def _saved(self, event: protocol.Saved) -> None:
        """A worker wrote its shard; once every worker due to did, finalize the checkpoint."""
        ckpt = event.checkpoint
        self.saved.setdefault(ckpt, {})[event.rank] = event.step
        self._finalize(ckpt)

    def _finalize(self, ckpt: int) -> None:
        """Finalize checkpoint ``ckpt`` once the shards of the pipelines at its global sync are
        in. Right after a global sync every replica of a stage is identical, so a pipeline that
        was missing (lost, or restarting) gets a copy of a present replica's shard, at its own
        iteration count: the checkpoint is complete, and a resume restarts that pipeline too."""
        S, P = self.cfg.pipeline.stages, self.cfg.cluster.pipelines
        shards = self.saved.get(ckpt, {})
        present = sorted(self.shards_from.get(ckpt, range(P)))
        if not present or any(self.grid.rank(p, s) not in shards for p in present
                              for s in range(S)):
            return
        del self.saved[ckpt]
        self.shards_from.pop(ckpt, None)
        staging = checkpoint.staging_dir(self.run_dir, ckpt)
        steps = {p: shards[self.grid.rank(p, 0)] for p in present}
        stand_ins = self.stand_ins.pop(ckpt, {})
        steps.update(stand_ins)
        if not self.live and not staging.is_dir():  # replaying: the dead scheduler finalized it
            self.checkpoints.saved(self.clock())
            return
        for q, k in sorted(stand_ins.items()):
            for s in range(S):
                checkpoint.stand_in(staging, str(self.grid.rank(present[0], s)),
                                    str(self.grid.rank(q, s)),
                                    {"step": k, "pipeline": q})
        elapsed = time.time() - self.t0
        checkpoint.save_shard(staging, "scheduler",
                              {"steps": steps, "elapsed": elapsed, "metrics": self.summary()})
        path = checkpoint.finalize(
            self.run_dir, ckpt, keep=self.cfg.checkpoint.keep,
            expected=[str(r) for r in range(self.tracker.world_size)] + ["scheduler"],
            meta={"config": OmegaConf.to_container(self.cfg, resolve=True), "steps": steps,
                  "elapsed": elapsed, "partition": list(self.cfg.pipeline.partition),
                  "stand_ins": sorted(set(range(P)) - set(present))})
        self.checkpoints.saved(self.clock())
        self.metrics.write({"kind": "checkpoint", "step": ckpt, "time": round(elapsed, 4),
                            "steps": steps, "path": str(path)})
        log.info("checkpoint %s", path)

    def _check_health(self) -> None:
        if self.policy is not None:
            # a replica the policy holds (a round not closed, a global sync waiting for a hung
            # replica) waits for us: as good as a report, so its silence starts when we let it go
            self.tracker.heard(self.grid.rank(p, s) for s, p in self.policy.held())
        hung = self.tracker.silent_workers()
        live = set(self.policy.live) if self.policy is not None else set()
        if hung and self.tolerant and live - {self.grid.pipeline_of(r) for r in hung}:
            if not set(hung) <= self.hung:  # the launcher kills them; their pipelines are lost
                self.hung |= set(hung)
                log.warning("no report from rank(s) %s for %g s: named hung", hung,
                            self.cfg.run.heartbeat_timeout)
                self._name_hung()
        elif hung:  # (every live pipeline silent is the run's hang, not a replica's)
            raise WorkerHung(f"no report from rank(s) {hung} for {self.cfg.run.heartbeat_timeout:g} s")
        missing = self.tracker.world_size - len(self.tracker.started)
        if missing and self.clock() - self.started > self.cfg.run.timeout:
            raise WorkerHung(f"{missing} worker(s) never started within run.timeout")

    def _name_hung(self) -> None:
        """Tell the launcher which processes are hung: (rank, incarnation), so that a restarted
        process is never taken for the one it replaced."""
        store.put(self.events, store.HUNG,
                  protocol.Hung([(r, self.incarnation[self.grid.pipeline_of(r)])
                                 for r in sorted(self.hung)]))

    def publish_progress(self) -> None:
        store.set_json(self.events, store.PROGRESS, self.summary())
        self.published = self.clock()

    def summary(self) -> dict:
        summary = self.tracker.snapshot()
        if self.restarts or self.heals:
            summary["restarts"], summary["heals"] = self.restarts, self.heals
        if self.scheduler_restarts:
            summary["scheduler_restarts"] = self.scheduler_restarts
        if self.stragglers is not None:
            summary["stragglers"] = self.stragglers.current()
        if self.policy is not None or self.recorded is not None:
            summary["rounds"] = self.rounds
            summary["mean_group_size"] = (sum(self.group_sizes) / len(self.group_sizes)
                                          if self.group_sizes else None)
        return summary


# events a worker blocks on, that unblock its peers, or that say which incarnation is live (the
# restart comes before the events of the processes it announces)
URGENT = ("ready", "begin", "lost", "restart", "rejoin")
BATCH = 512  # most events taken from the queue at once


def next_batch(events) -> list[str]:
    """The next events, as popped: all that are queued (up to :data:`BATCH`), else the next
    one to come (blocking)."""
    raw = []
    while len(raw) < BATCH:
        try:
            raw.append(events.queue_pop(store.EVENTS, block=False))
        except dist.QueueEmptyError:
            break
    if not raw:
        raw.append(events.queue_pop(store.EVENTS))
    # bytes that are not UTF-8 become a message that fails to decode, naming the queue
    return [r.decode("utf-8", errors="replace") if isinstance(r, bytes) else r for r in raw]


def in_order(raw: list[str]) -> list[protocol.Event]:
    """A batch decoded, urgent events first (the launcher's lost and restart events must not
    wait behind P x S arrivals, and a round of P x S arrivals is not decided behind P x S
    metrics writes); the order is kept within each kind."""
    batch = [protocol.decode_event(r, store.PREFIX + store.EVENTS) for r in raw]
    return sorted(batch, key=lambda e: e.type not in URGENT)


class BatchClock:
    """The scheduler's clock: one moment per batch (set by :func:`serve`), so that the journal
    can replay every decision at the moment it was made."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def act(scheduler: Scheduler, writer: journal.Journal, raw: list[str], now: float
        ) -> list[protocol.Event]:
    """Journal one batch at moment ``now``, then act on it (the scheduler's clock must be a
    :class:`BatchClock`); returns the batch, decoded."""
    scheduler.clock.now = now
    batch = in_order(raw)
    # the flag matters only to a tick (read there, once per batch at most)
    stop = (any(isinstance(e, protocol.Tick) for e in batch)
            and scheduler.events.check([store.STOP_REQUESTED]))
    writer.record(now, stop, raw)  # before acting on it: see the journal's note
    scheduler.stop_seen = stop
    for event in batch:
        scheduler.handle(event)
    return batch


def replay(cfg: DictConfig, run_dir: Path, events, resume: Optional[Path] = None,
           now: Callable[[], float] = time.monotonic, path: Optional[Path] = None,
           restart: int = 1) -> Scheduler:
    """A scheduler started again after the run's first died: the dead one's journal (``path``,
    default the first leg's) replayed, then live from moment ``now()`` on
    (:mod:`~sdpipe_cli.sync.journal`)."""
    started, batches = journal.read(path or journal_path(run_dir))
    clock = BatchClock(started)
    scheduler = Scheduler(cfg, run_dir, events, clock=clock, resume=resume, live=False)
    for batch in batches:
        clock.now, scheduler.stop_seen = batch.t, batch.stop
        scheduler.new_batch()
        for event in in_order(list(batch.events)):
            scheduler.handle(event)
    log.info("replayed %d batches of the journal", len(batches))
    clock.now = now()
    scheduler.go_live(len(batches), batches[-1].t if batches else None, restart)
    return scheduler


def serve(cfg: DictConfig, run_dir: Path, events, connect: Callable[[], object],
          resume: Optional[Path] = None, restarted: int = 0,
          config: str = "config.yaml") -> Scheduler:
    """Run until every worker reported done; ``restarted``: how many times this leg's scheduler
    was started again after it died (it then replays its journal first: the leg's, named after
    ``config``)."""
    path = journal_path(run_dir, config)
    if restarted:
        scheduler = replay(cfg, run_dir, events, resume, path=path, restart=restarted)
        writer = journal.Journal.resume(path)
    else:
        clock = BatchClock(time.monotonic())
        writer = journal.Journal.create(path, clock.now)
        scheduler = Scheduler(cfg, run_dir, events, clock=clock, resume=resume)
    ticker = Ticker(connect)
    ticker.start()
    tracer = scheduler.tracer
    failed = True  # until every worker reported done
    try:
        while not scheduler.tracker.all_done():
            raw = next_batch(events)
            popped = tracer.clock() if tracer is not None else 0.0
            batch = act(scheduler, writer, raw, time.monotonic())
            if scheduler.policy is not None:
                ticker.wake_at(scheduler.policy.next_deadline())
            if tracer is not None:
                tracer.span(f"{len(batch)} events", "scheduler", popped, tracer.clock(),
                            "events", len(batch))
        failed = False
    finally:
        ticker.stop()
        writer.close()
        scheduler.metrics.close(failed)
        if tracer is not None:
            tracer.write(trace_path(run_dir, tracer.rank))
    scheduler.publish_progress()
    return scheduler


def main() -> int:
    resume = os.environ.get("SDPIPE_RESUME")
    with child("scheduler", role="scheduler") as started:
        run_dir, cfg = started.run_dir, started.cfg

        def connect():
            return connect_store(cfg)

        events = store.namespace(connect())
        scheduler = serve(cfg, run_dir, events, connect, Path(resume) if resume else None,
                          restarted=int(os.environ.get("SDPIPE_SCHEDULER_RESTART", "0")),
                          config=os.environ.get("SDPIPE_CONFIG", "config.yaml"))
        summary = scheduler.summary()
        (run_dir / "summary.json").write_text(strict_json(summary, indent=1))
        if cfg.run.save_final:  # every worker wrote its weights there before it was done
            steps = {str(p): state["steps"] for p, state in summary["pipelines"].items()}
            config = OmegaConf.to_container(cfg, resolve=True)
            if checkpoint.seal_final(run_dir, {"config": config, "steps": steps},
                                     scheduler.grid.pipelines, scheduler.grid.stages) is None:
                log.warning("final/ is not one model's (a replica did not write its weights "
                            "there): it has no manifest")
        for p, state in summary["pipelines"].items():
            log.info("pipeline %s: %d iterations, loss %s", p, state["steps"], state["loss"])
        if "rounds" in summary:
            for s, per_pipeline in enumerate(summary["rounds"]):
                log.info("stage %d: rounds per replica %s", s, per_pipeline)
            log.info("mean group size %.2f", summary["mean_group_size"] or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
