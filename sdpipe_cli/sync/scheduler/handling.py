"""The scheduler's event handling: one run's global view, fed one worker event at a time.

:class:`Scheduler` admits an event (its sender must be a live process of this run), hands ready
signals and segment starts to the pure group policy (:mod:`sdpipe_cli.core.grouping`), or to a
recorded run's decisions under ``sync.replay``, and publishes each decision under
:func:`~sdpipe_cli.runtime.store.decision_key` in one write for all its members. It folds
progress reports into a :class:`~sdpipe_cli.runtime.metrics.RunTracker` (``metrics.jsonl``,
the snapshot the launcher shows), restarts and heals of pipelines, and the straggler watch.
Checkpoints (:mod:`.checkpoints`), the health check (:mod:`.health`) and blocks that follow the
wire (:mod:`.pacing`) are parts of their own; the loop and journal, :mod:`.process`'s."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig

from sdpipe_cli import checkpoint
from sdpipe_cli.analysis import records
from sdpipe_cli.config.schema import Config
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core.grouping import Decision, GroupScheduler, make_policy
from sdpipe_cli.core.meetings import meetings_of
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.runtime.metrics import MetricsLog, RunTracker
from sdpipe_cli.runtime.stragglers import StragglerWatch
from sdpipe_cli.runtime.trace import Tracer
from sdpipe_cli.runtime.trackers import open_sinks
from sdpipe_cli.sync.replay import Recorded, load as load_recorded
from sdpipe_cli.sync.scheduler.checkpoints import Checkpoints
from sdpipe_cli.sync.scheduler.health import Health, WorkerHung
from sdpipe_cli.sync.scheduler.held import Held, Muted
from sdpipe_cli.sync.scheduler.pacing import pacing_of, wire_summary
from sdpipe_cli.sync.scheduler.replanning import Replanning
from sdpipe_cli.sync.wire_probe import settled

__all__ = ["Scheduler", "WorkerHung", "PUBLISH_S"]

log = logging.getLogger("sdpipe.scheduler")

PUBLISH_S = 0.2  # how often the progress snapshot is refreshed


class Scheduler:
    """Event handling of one run; the store and the clock are injected."""

    def __init__(self, cfg: DictConfig, run_dir: Path, events, clock=time.monotonic,
                 resume: Path | None = None, live: bool = True,
                 wire: protocol.MeetingChoice | None = None, settings: Config | None = None):
        plan = RunPlan.of(cfg)
        P, S = plan.pipelines, plan.stages
        # ``live=False``: replaying a dead scheduler's journal; what it wrote is held back
        self.live = live
        events = events if live else Held(events)
        # ``cfg``, the record: what the policy, re-planning, replay and the trackers are made
        # from, and what checkpoints store; ``settings``, what this reads of it, typed (the
        # scheduler process's, built once from its run file; typed here when not given)
        self.cfg, self.run_dir, self.events, self.clock = cfg, run_dir, events, clock
        self.settings = settings = settings_of(cfg) if settings is None else settings
        run, fault = settings.run, settings.fault
        self.grid = plan.grid
        self.stop_seen: bool | None = None  # the stop flag as the transport read it
        self.tracker = RunTracker(P, S, plan.budget, clock=clock,
                                  heartbeat_timeout=run.heartbeat_timeout)
        self.stragglers = StragglerWatch(fault, plan) if fault.on_slowdown != "off" else None
        self.replanning = Replanning(cfg, settings, plan) if fault.on_slowdown == "replan" else None
        self.replan: dict | None = None  # the re-plan this leg stops for (the next leg's split)
        self.wire = wire  # the meetings this leg settled from its measured wire (pacing.py)
        grouped = mode(settings.sync.name).group_policy
        self.pacing = pacing_of(wire, settings) if grouped else None
        # the policy meets as the wire settled; the checkpoints keep the record's 0/auto
        meet = settings if wire is None else settled(settings, wire)
        self.began, self.first_step = clock(), None  # this leg's start-up: what a restart costs
        replay = getattr(settings.sync, "replay", None)  # a recorded run's decisions (replay.py)
        self.recorded = load_recorded(replay, settings) if replay else None
        self.policy = (make_policy(meet, plan, clock, spent=store.limit_spent(events),
                                   evaluations=self.pacing is None)  # blocks fall anywhere
                       if grouped and self.recorded is None else None)
        self.meetings = meetings_of(meet.sync)  # the policy counts them; checkpoints, steps
        self.metrics = self._metrics() if live else Muted()
        # what replicas average: the stages, or segments where pipelines are split differently
        self.segments = plan.segments
        self.batches = [plan.batch_of(p) for p in range(P)]  # samples an iteration
        self.rounds = [[0] * P for _ in range(self.segments.count)]  # rounds of each replica
        self.group_sizes: list[int] = []
        self.t0 = store.run_clock(events)  # the workers' time axis, for metrics lines
        self.published = 0.0
        self.incarnation = [0] * P  # of each pipeline's processes: restarts so far
        self.rejoining: set[tuple[int, int]] = set()  # (stage, pipeline) waiting to be healed
        self.health = Health(self.tracker, self.grid, run.heartbeat_timeout, run.timeout,
                             fault.on_pipeline_loss != "stop", clock)
        self.heals = self.restarts = 0
        self.heals_given = 0  # heals published so far: their order
        self.scheduler_restarts = 0  # times this leg's scheduler was started again (go_live)
        self.checkpoints = Checkpoints(cfg, settings, plan, run_dir, self.meetings, clock)
        self.tracer = (self._tracer() if run.trace and self.policy is not None and live
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
        return MetricsLog(self.run_dir / "metrics.jsonl",
                          open_sinks(self.settings.metrics, self.run_dir, self.cfg))

    def go_live(self, replayed: int, last: float | None, restart: int = 1) -> None:
        """The journal is replayed: write again what the last batch's handling wrote to the
        store (the dead scheduler may have died before it did; a key the workers already took
        is never read again), and from now on write for real."""
        held, self.events = self.events, self.events.store
        for key, value in held.last_batch.items():
            self.events.set(key, value)
        self.live, self.metrics = True, self._metrics()
        self.scheduler_restarts = restart
        now = self.clock()
        self.metrics.write(records.SchedulerRestartLine.line(
            time=round(time.time() - self.t0, 4), restart=restart, replayed_batches=replayed,
            silent_s=None if last is None else round(now - last, 4)))
        self.publish_progress()

    def new_batch(self) -> None:
        """Replaying: the next batch begins (only the last one's store writes are written again)."""
        if isinstance(self.events, Held):
            self.events.last_batch.clear()

    def _stop_asked(self) -> bool:
        if self.stop_seen is not None:
            return self.stop_seen
        return self.events.check([store.STOP_REQUESTED])

    def _tracer(self) -> Tracer:
        """The scheduler's track of ``trace.json``: row 0 the batches of events, row 1 + s the
        ready signals and rounds of stage s."""
        tracer = Tracer(self.tracker.world_size, "scheduler", lambda: time.time() - self.t0,
                        self.settings.run.trace_events)
        unit = "stage" if self.segments.uniform else "segment"
        tracer.rows = {0: "events", **{1 + s: f"{unit} {s}" for s in range(self.segments.count)}}
        return tracer

    def _resume(self, ckpt: Path) -> None:
        shard = checkpoint.load_shard(ckpt, "scheduler")
        steps = {int(p): k for p, k in shard["steps"].items()}
        for p, k in steps.items():
            self.tracker.state[p].steps = k
            self.tracker.state[p].samples = k * self.batches[p]
        if self.policy is not None:
            self.policy.resume({p: self.meetings.meeting(k) for p, k in steps.items()})
        if self.pacing is not None:  # blocks of their own: the steps, not the meetings
            self.pacing.resumed(steps)
        self.checkpoints.resume(steps)
        # where this leg begins: readers of metrics.jsonl tell timelines apart by it (a leg
        # resumed from an older checkpoint goes back in iterations); ``at``: the checkpoint's
        # moment on the run clock, where its past ends
        self.metrics.write(records.ResumeLine.line(
            time=round(time.time() - self.t0, 4), checkpoint=ckpt.name, steps=steps,
            at=round(float(shard.get("elapsed", 0.0)), 4)))

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
            if self.health.check(self.policy):
                self._name_hung()
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
        P, S = self.grid.pipelines, self.grid.stages
        key = store.PREFIX + store.EVENTS
        stage = getattr(event, "stage", self.grid.stage_of(event.rank))
        if type(event) is protocol.Ready or type(event) is protocol.Rejoin:  # of what it averages
            if not (0 <= event.pipeline < P and 0 <= stage < self.segments.count):
                stage = -1
            elif event.incarnation < self.incarnation[event.pipeline]:
                return False  # stale; its pipeline may have been re-split since
            elif not self.segments.uniform:
                stage = self.segments.holder(event.pipeline, stage)
        if not (0 <= event.pipeline < P and 0 <= stage < S
                and event.rank == self.grid.rank(event.pipeline, stage)):
            raise protocol.ProtocolError(key, f"{event.type} event from rank {event.rank}, pipeline "
                                              f"{event.pipeline}, stage {getattr(event, 'stage', stage)}"
                                              f": no such worker in a run of {P} pipeline(s) x "
                                              f"{S} stage(s)")
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
        if event.steps is not None:
            self.checkpoints.cut_short(event.pipeline, event.iteration, event.steps)
        if self.pacing is not None:  # what its last round and block took
            self.pacing.ready(event, self.clock())
        self._publish(self._policy().ready(event.stage, event.pipeline, event.iteration))

    def _replayed(self, event: protocol.Ready) -> None:
        """``sync.replay``: the recorded decision for this replica's round, at once (its members
        meet in the all-reduce, whenever each comes)."""
        group = cast(Recorded, self.recorded).get((event.stage, event.pipeline, event.iteration))
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
        """The launcher starts a lost pipeline's processes again (or a re-split one on its new
        split: its segments lie elsewhere from now on)."""
        p = event.pipeline
        self.incarnation[p] = event.incarnation
        split = (self.replanning.restarted(p) if self.replanning is not None and event.resplit
                 else None)
        if split is None:
            self.restarts += 1
        else:  # its workers find it there from the first decision naming this incarnation
            store.put(self.events, store.split_key(p), protocol.Split(p, event.incarnation, split))
            self.checkpoints.resplit(p, split, cast(Replanning, self.replanning).slowed_now())
            self.segments = self.checkpoints.plan.segments  # the run's plan, with the new split
            cast(StragglerWatch, self.stragglers).carry(p, cast(Replanning, self.replanning).slowed)
        if self.stragglers is not None:
            self.stragglers.reset(p)
        self.metrics.write(cast(dict[str, Any], self.tracker.update(protocol.record(event))))

    def _report(self, event: protocol.Report) -> None:
        record = event.record()
        if event.type == "healed":  # the restarted worker's clock may not be the run's yet
            record["time"] = round(time.time() - self.t0, 4)
        if (line := self.tracker.update(record)) is not None:
            self.metrics.write(line)
        if self.first_step is None and event.type == "step":
            self.first_step = self.clock() - self.began
        for line in self.stragglers.lines(record) if self.stragglers is not None else ():
            log.warning("slow device %s (pipeline %d, stage %d): %s", line["device"],
                        line["pipeline"], line["stage"], line["kind"])
            self.metrics.write(line)
            self.published = 0.0  # the console says so at the next event
            if self.replanning is not None:
                self._consider_replan(line, self.replanning)
        self.heals += event.type == "healed"

    def _consider_replan(self, straggler: dict, replanning: Replanning) -> None:
        """``fault.on_slowdown=replan``: what the measured speeds call for, recorded either way.
        When it pays, the re-split pipelines restart on their new splits while the others go on
        (in place), or the run stops at its next consistent point (as a graceful stop does,
        with a checkpoint) and the launcher goes on from there with the new split."""
        done = sum(state.samples for state in self.tracker.state.values())
        replanning.release(self.policy.live if self.policy is not None else frozenset())
        proposal = replanning.consider(cast(StragglerWatch, self.stragglers).own_slowdowns(), done,
                                       self.first_step or 0.0, self.policy)
        if proposal is None:
            return
        changed = (replanning.resplit(self.policy.live if self.policy is not None
                                      else frozenset()) if proposal.go else [])
        where = {k: straggler[k] for k in ("device", "pipeline", "stage")}
        self.metrics.write(records.ReplanLine.line(time=round(time.time() - self.t0, 4), **where, **proposal.record(),
                                                   **({"in_place": changed} if changed else {})))
        log.warning("re-plan after %s (%s): %s", straggler["device"], proposal.change(),
                    proposal.reason)
        if changed:
            self.publish_progress()  # the launcher restarts them on their new splits
        elif proposal.go:
            self.replan = replanning.next_leg()
            self.events.set(store.STOP_REQUESTED, "1")

    def _policy(self):
        """The group policy; an sdpipe event in a run without one cannot come from this run."""
        if self.policy is None:
            raise protocol.ProtocolError(store.PREFIX + store.EVENTS,
                                         f"a group event in a run with sync={self.settings.sync.name}")
        return self.policy

    def _lost(self, event: protocol.Lost) -> None:
        p = event.pipeline
        self.metrics.write(cast(dict[str, Any], self.tracker.update(protocol.record(event))))
        log.warning("pipeline %d lost%s: %s", p, " (restarting)" if event.restart else "", event.reason)
        if self.health.pipeline_lost(p):
            self._name_hung()
        self.rejoining = {(s, q) for s, q in self.rejoining if q != p}
        if self.policy is not None:
            # done at most up to its next train line due: a round decided but not written is redone
            recorded = self.tracker.state[p].steps + self.settings.train.log_every - 1
            self._publish(self.policy.leave(p, self.meetings.meeting(recorded)))
        for ckpt in self.checkpoints.pipeline_lost(p, self.policy):  # its shards will not come
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
                      protocol.HealAnswer(stop=True, iteration=self.checkpoints.resume_step(p, self.policy, None)))
        self.rejoining.clear()

    def _publish(self, decisions: list[Decision]) -> None:
        # the run's global progress, for the members' learning-rate schedule
        done = cast(GroupScheduler, self.policy).iterations_done() if decisions else None
        pacing = self.pacing
        for d in decisions:
            nexts = (pacing.nexts(d.members, d.iterations, self.policy, self.t0, self.clock())
                     if pacing is not None else [])
            ckpt = (self.checkpoints.at_global_sync(d, self.policy) if d.kind == "global"
                    else None)
            # the restarted replicas this round's first member heals after its update, in the
            # order of every heal of the run: a source gives, and a replica takes, in it
            orders = list(range(self.heals_given + 1, self.heals_given + 1 + len(d.heal)))
            self.heals_given += len(d.heal)
            heal = [protocol.HealTarget(q, self.incarnation[q], d.round, n)
                    for (q, _), n in zip(d.heal, orders)]
            # every member gets the same record, in one message: a set per member is a send and a
            # wake-up of the store each, which the last member of a large group waits behind
            group = protocol.Group(
                members=list(d.members), round=d.round, kind=d.kind, stop=d.stop,
                incarnations=[self.incarnation[p] for p in d.members], checkpoint=ckpt,
                done=done, twins=d.twins, weight_shares=list(d.weight_shares),
                grad_shares=list(d.grad_shares), nexts=nexts,
                done_steps=pacing.done_steps() if pacing is not None else None)
            keys = [store.decision_key(d.stage, p, k, self.incarnation[p])
                    for p, k in zip(d.members, d.iterations)]
            values = [protocol.encode(group)] * len(keys)
            if heal:  # to the source only
                values[0] = protocol.encode(dataclasses.replace(group, heal=heal))
            for (q, k), n in zip(d.heal, orders):
                self.rejoining.discard((d.stage, q))
                keys.append(store.heal_key(d.stage, q, self.incarnation[q]))
                values.append(protocol.encode(protocol.HealAnswer(
                    stop=False, source=d.members[0],
                    source_incarnation=self.incarnation[d.members[0]],
                    iteration=self.meetings.steps(k), done=done,
                    round=d.round, order=n)))
            # stamped before the write: a member may read the decision before the write returns
            # here, and a stamp after it would then be later than the read it caused
            published = self.tracer.clock() if self.tracer is not None else None
            self.events.multi_set(keys, values)
            if self.tracer is not None and published is not None:
                self.tracer.span(f"{d.kind} {d.round}", "round", published - max(d.waited),
                                 published, "members", list(d.members), "iterations",
                                 list(d.iterations), "twins", d.twins, row=1 + d.stage)
            for p in d.members:
                self.rounds[d.stage][p] += 1
            self.group_sizes.append(len(d.members))
            line: dict[str, Any] = dict(
                time=round(time.time() - self.t0, 4), stage=d.stage, round=d.round, group=d.kind,
                members=list(d.members), iterations=list(d.iterations), size=len(d.members),
                stop=d.stop, twins=d.twins, done=done, reason=d.reason,
                outside={str(q): w for q, w in d.outside}, inside={str(q): w for q, w in d.inside},
                max_wait_s=round(max(d.waited), 6), waits=[round(w, 6) for w in d.waited])
            if pacing is not None:  # meetings that follow the wire: blocks of their own
                line.update(pacing.fields(nexts))
            elif self.meetings.every > 1:  # iterations above count meetings of this many
                line["every"] = self.meetings.every
            if d.heal:  # the restarted replicas the first member heals: [pipeline, iteration]
                line["heal"] = [list(h) for h in d.heal]
            if d.weight_shares or d.grad_shares:  # a stale member counted less (sync.stale),
                # or members by their samples (pipeline.balance); exact: a replay uses them
                line["weight_shares"] = list(d.weight_shares)
                line["grad_shares"] = list(d.grad_shares)
            self.metrics.write(records.GroupLine.line(**line))
            for change in pacing.take_changes() if pacing is not None else ():
                self.metrics.write(change)

    # -- checkpoints and health -----------------------------------------------------------------
    def _saved(self, event: protocol.Saved) -> None:
        """A worker wrote its shard; once every worker due to did, finalize the checkpoint. A
        worker that could not (its global sync failed) drops the checkpoint for all."""
        if event.dropped is not None:
            if self.checkpoints.drop(event.checkpoint, self.live):
                reason = f"pipeline {event.pipeline}, stage {event.stage}: {event.dropped}"
                self.metrics.write(records.CheckpointDroppedLine.line(
                    step=event.checkpoint, time=round(time.time() - self.t0, 4), reason=reason))
                log.warning("checkpoint %d is not written: %s", event.checkpoint, reason)
            return
        self.checkpoints.shard_saved(event.checkpoint, event.rank, event.step)
        self._finalize(event.checkpoint)

    def _finalize(self, ckpt: int) -> None:
        elapsed = time.time() - self.t0
        done = self.checkpoints.finalize(ckpt, self.live, elapsed, self.summary)
        if done is None:
            return
        path, steps = done
        self.metrics.write(records.CheckpointLine.line(step=ckpt, time=round(elapsed, 4), steps=steps, path=str(path)))
        log.info("checkpoint %s", path)

    def _name_hung(self) -> None:
        """Tell the launcher which processes are hung (:meth:`.health.Health.named`)."""
        store.put(self.events, store.HUNG, self.health.named(self.incarnation))

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
            summary["straggler_news"] = self.stragglers.news_snapshot()
        if self.replan is not None:
            summary["replan"] = self.replan
        if self.wire is not None:
            summary["wire"] = wire_summary(self.wire, self.pacing)
        if self.replanning is not None:  # what a restart after a failure carries on
            summary["slowed"] = self.replanning.slowed_now()
            if self.replanning.asked is not None:
                summary["resplit"] = self.replanning.asked
        if self.policy is not None or self.recorded is not None:
            summary["rounds"] = self.rounds  # per stage, or per segment (pipelines split apart)
            if not self.segments.uniform:
                summary["rounds_of"] = "segment"
            summary["mean_group_size"] = (sum(self.group_sizes) / len(self.group_sizes)
                                          if self.group_sizes else None)
        return summary
