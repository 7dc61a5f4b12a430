"""``sync=sdpipe``, the worker's side: ready signal -> group from the scheduler -> group average.

A worker averages what it holds in common with other pipelines' replicas: its stage, or, where
pipelines are split differently (``pipeline.partitions``), each *segment* of blocks its stage
holds (:mod:`~sdpipe_cli.core.segments`). Each segment is a :class:`Unit` with rounds of its
own, and the scheduler forms its groups as it does a stage's. A worker says all its units are
ready at once, so their rounds are decided side by side, and averages them in segment order,
which every worker shares, so no two rounds wait on each other in a cycle.
With one partition for every pipeline a worker has one unit, its stage.

A pipeline re-split in place (``fault.replan_in_place``) comes back under a new incarnation,
its segments on other stages: from the first decision or heal that names that incarnation, a
worker looks its new split up (:class:`~sdpipe_cli.runtime.protocol.Split`) to find its ranks.
The segments are then per block, so the units themselves never change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli.config.schema import SdpipeSyncConfig, SyncConfig
from sdpipe_cli.core.meetings import BYTES, Meetings, average_of, meetings_of, precision_of
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.core.segments import Segments
from sdpipe_cli.core.wire import Blocks, Measured, ring_bytes
from sdpipe_cli.model import optim
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync import wire_probe
from sdpipe_cli.sync.base import Sync, Wiring
from sdpipe_cli.sync.groups import GroupCache, average_changes, average_tensors, flatten, statistics
from sdpipe_cli.sync.healing import Healing
from sdpipe_cli.sync.overlap import Behind, overlap_on

__all__ = ["GroupSync", "Unit"]

log = logging.getLogger("sdpipe.sync")


@dataclass
class Unit:
    """One segment this worker averages (the scheduler's "stage" ``index``): its blocks within
    the worker's stage module, and its own anchor and residual (bf16, int8 changes) and pending heals."""

    index: int
    start: int = 0
    stop: int | None = None
    anchor: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    heal: list[protocol.HealTarget] = field(default_factory=list)
    behind: Behind | None = None  # its last round's average, still running (sync.overlap)

    def module(self, stage: nn.Module) -> nn.Module:
        """The segment's blocks (the whole stage when it is one segment)."""
        if self.start == 0 and self.stop is None:
            return stage
        return stage[self.start:self.stop]


class GroupSync(Healing, Sync):
    """SDPipe's worker side: per unit, ready signal -> group from the scheduler -> group average.

    ``average="weights_grads"``: the round comes before the local step and averages the weights
    and the gradients (and, at global syncs, the optimizer state); ``"weights"``: it comes after
    the step and averages the weights. ``optimizer``: whose state a global sync averages.
    ``meetings``: after which local steps the replica meets (the others it trains alone; the
    scheduler counts meetings); ``precision``: ``bf16`` or ``int8`` sends a group round's
    changes since the anchor in that precision (:mod:`~sdpipe_cli.core.meetings`; ``average`` must then be ``weights``).
    ``segments``: the run's, when pipelines are split differently (None: the units are stages).
    """

    name = "sdpipe"
    scheduled_checkpoints = True
    mixes_weights = True

    @classmethod
    def build(cls, settings: SyncConfig, wiring: Wiring) -> GroupSync:
        assert isinstance(settings, SdpipeSyncConfig)  # strategy_class: sdpipe's own settings
        w = wiring.where
        sync = cls(wiring.events, w.rank, w.pipeline, w.stage, w.stages, w.pipelines,
                   wiring.groups, average_of(settings), wiring.optimizer, wiring.incarnation,
                   meetings_of(settings), precision_of(settings), wiring.segments,
                   overlap_on(settings.overlap,
                              getattr(wiring.groups, "backend", "")))
        if wire_probe.unresolved(settings):  # measured before the first meeting
            sync._unsettled = settings
        return sync

    def __init__(self, events: dist.Store, rank: int, pipeline: int, stage: int, stages: int,
                 pipelines: int, groups: GroupCache, average: str = "weights_grads",
                 optimizer: torch.optim.Optimizer | None = None, incarnation: int = 0,
                 meetings: Meetings = Meetings(), precision: str = "fp32",
                 segments: Segments | None = None, overlap: int = 0):
        if (meetings.every > 1 or precision != "fp32") and average != "weights":
            raise ValueError("meetings every H > 1 steps and low-precision changes average weights")
        self.events, self.rank, self.pipeline, self.stage, self.stages = (
            events, rank, pipeline, stage, stages)
        self.pipelines, self.groups, self.average = pipelines, groups, average
        self.grid = Grid(pipelines, stages)
        self.segments = segments if segments is not None and not segments.uniform else None
        self.units = ([Unit(k, *self.segments.local(pipeline, k))
                       for k in self.segments.held(pipeline, stage)]
                      if self.segments is not None else [Unit(stage)])
        self.optimizer, self.incarnation = optimizer, incarnation
        self.seen: dict[int, int] = {}  # each pipeline's latest incarnation named to this worker
        self.meetings, self.precision, self.overlap = meetings, precision, overlap
        self.stop = False
        self._early = False  # meet after the coming step, whatever the block (meet_now)
        self._met = -1  # the last meeting this replica went to
        self._checkpoint: int | None = None
        self._stats: dict[str, Any] = {}
        self._merged: dict[str, float] = {}  # the rounds merged late at this step: wire, waited
        self._done: int | None = None  # pipeline-meetings begun, at the last decision
        self._decided_at = 0  # the local step of the last decision
        self._t0: float | None = None  # the run's time axis, for the reports; read when needed
        # sync settings whose meetings the wire decides (wire_probe)
        self._unsettled: SdpipeSyncConfig | None = None
        self._began: float | None = None  # when the first iteration began (its compute)
        # meetings that follow the wire: this replica's blocks, the run's pipeline-steps at the
        # last decision, its last round (seconds, bytes through its link), when its block began
        self.blocks: Blocks | None = None
        self._done_steps: int | None = None
        self._wire: tuple[float | None, float | None] = (None, None)
        self._block_began: float | None = None

    def _clock(self) -> float:
        if self._t0 is None:
            self._t0 = store.run_clock(self.events)
        return round(time.time() - self._t0, 4)

    def _ranks(self, unit: Unit, pipelines: list[int]) -> list[int]:
        """The workers holding ``unit``'s segment in ``pipelines``."""
        if self.segments is None:
            return self.grid.stage_ranks(unit.index, pipelines)
        return [self.grid.rank(q, self.segments.holder(q, unit.index)) for q in pipelines]

    def _follow(self, pipelines: list[int], incarnations: list[int]) -> None:
        """Incarnations of ``pipelines`` the scheduler named: one not seen before may be a
        pipeline re-split in place, whose segments are then where its new split puts them."""
        for q, g in zip(pipelines, incarnations):
            if self.segments is None or g <= self.seen.get(q, 0):
                continue
            self.seen[q] = g
            split = store.read(self.events, store.split_key(q), protocol.Split)
            if split is not None and split.incarnation <= g:
                self.segments = self.segments.resplit(q, split.partition)

    def started(self) -> None:
        self._began = self._block_began = time.perf_counter()

    def _settle(self, module: nn.Module) -> None:
        """Meetings left to the measured wire (:mod:`~sdpipe_cli.sync.wire_probe`): at the
        first iteration, time its compute and probe the links to every replica of the stage,
        report both, and meet as the scheduler then decides. A restarted replica (or one that
        only heals) reads the decision already made."""
        settings, self._unsettled = self._unsettled, None
        assert settings is not None  # called only while unsettled
        timeout = getattr(self.events, "timeout", None)
        timeout = timeout.total_seconds() if timeout is not None else 300.0
        if self.incarnation == 0 and self.segments is None:
            step_s = time.perf_counter() - (self._began or time.perf_counter())
            unit = self.units[0]
            values = flatten(self._replica(unit.module(module))).numel()
            found = wire_probe.probe(self.groups, self._ranks(unit, list(range(self.pipelines))),
                                     values)
            wire_probe.report(self.events, self.rank,
                              Measured(self.pipeline, self.stage, step_s, values, found))
        made = wire_probe.choice(self.events, timeout)
        chosen = wire_probe.settled(settings, made)
        self.meetings, self.precision = meetings_of(chosen), precision_of(chosen)
        self.average = average_of(chosen)
        if made.adapt:
            self.blocks = Blocks(made.every)

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        return not self.stop  # the scheduler ends the run (train.steps counts all pipelines)

    def after_backward(self, module: nn.Module, step: int) -> None:
        if self._unsettled is not None:
            self._settle(module)
        for unit in self.units:
            if self.precision != "fp32" and unit.anchor is None:
                # before the first local step: the weights every replica starts from (or resumes
                # from: a checkpoint follows a global sync), the first anchor
                unit.anchor = flatten(self._replica(unit.module(module)))
        self._checkpoint = None
        if self.average == "weights_grads":
            self._rounds(module, step, grads=True)

    def meet_now(self) -> None:
        self._early = True

    def after_step(self, module: nn.Module, step: int) -> None:
        early, self._early = self._early, False
        self._merged = {}
        if self.average == "weights":
            meets = self.blocks.meets(step) if self.blocks else self.meetings.meets(step)
            self._merge(module, step, early or meets)
            if early or meets:
                self._rounds(module, step, grads=False)
            else:  # training alone until the next meeting
                self._checkpoint = None
                self._stats = {}
        # after the step: the state the replica goes on from, in the order of the run's heals
        given = sorted(((t.order, k, t) for k, unit in enumerate(self.units) for t in unit.heal),
                       key=lambda h: h[:2])
        if given:  # a restarted replica takes this replica's state as merged
            self._merge(module, step, True)
        for _, k, target in given:
            self._give_heal(self.units[k], self.units[k].module(module), target)
        for unit in self.units:
            unit.heal = []

    def _merge(self, module: nn.Module, step: int, meets: bool) -> None:
        """Merge each unit's round running behind (``sync.overlap``) once its steps are done,
        or before this replica's next round; what its wire took is reported with the next ready
        signal, as a round in step's."""
        for unit in self.units:
            behind = unit.behind
            if behind is None or not (meets or step >= behind.due):
                continue
            unit.behind = None
            waited = behind.merge(self._replica(unit.module(module)))
            self._merged = {"behind_s": round(behind.seconds, 6),
                            "behind_wait_s": round(waited, 6)}
            if behind.error is not None:
                self.groups.forget(*behind.group)
                log.warning("group %s failed (%s); going on alone", behind.group[0], behind.error)
            else:
                self._wire = (round(behind.seconds, 6), behind.moved)

    def position(self, step: int) -> float:
        """The run's global progress: pipeline-iterations begun over P, as the scheduler counted
        them (in meetings of H iterations) at the last decision, plus this replica's steps since.
        Before the step (weights_grads) that count includes the current iteration of every
        pipeline; after it (weights), the iterations up to the next one's."""
        if self._done is None:
            return float(step)
        if self._done_steps is not None:  # blocks of their own: the scheduler counts steps
            return self._done_steps / self.pipelines + (step - self._decided_at - 1)
        if self.meetings.every == 1:
            return self._done / self.pipelines - (1.0 if self.average == "weights_grads" else 0.0)
        # between meetings (flushed schedules: a round is an iteration), the steps since
        return self.meetings.steps(self._done) / self.pipelines + (step - self._decided_at - 1)

    @staticmethod
    def _replica(module: nn.Module) -> list[torch.Tensor]:
        """What a group round averages: the weights, then the running statistics."""
        return list(module.parameters()) + statistics(module)

    def _rounds(self, module: nn.Module, step: int, grads: bool) -> None:
        """A round of each unit. Every unit is ready at once, so the scheduler decides their
        rounds side by side (a worker's waits overlap instead of adding up); the averages follow
        in segment order, each as soon as its round is decided. (Waiting for a later unit's
        round before averaging an earlier one could wait on a member whose pipeline waits for
        that earlier average.) The stats are the last round's, with the time spent waiting
        and communicating over all."""
        start = time.perf_counter()
        meeting = self._meeting(step)  # the scheduler counts meetings
        # a block cut short by the run's end: the scheduler's checkpoint counts these steps
        steps = None if self.meetings.steps(meeting + 1) == step + 1 else step + 1
        self._met = meeting
        followed: dict[str, Any] = {}
        if self._apart:  # blocks of their own: what they and the wire took
            steps = step + 1
            followed = {"wire_s": self._wire[0], "wire_bytes": self._wire[1],
                        "block_s": round(start - (self._block_began or start), 6)}
        for unit in self.units:
            store.push(self.events, store.EVENTS, protocol.Ready(
                self.rank, self.pipeline, unit.index, meeting, self.incarnation, steps,
                **followed))
        stats, spent, stop, checkpoint, failed = {}, 0.0, False, None, False
        for unit in self.units:
            decision = self._decision(unit, step, meeting)
            stats = self._average(unit, decision, module, grads, step)
            spent += stats["comm_s"]
            stop, checkpoint = stop or decision.stop, decision.checkpoint
            failed = failed or stats["failed"]
        if checkpoint is not None and failed:
            self._drop(checkpoint, step + 1)
            checkpoint = None
        self.stop, self._checkpoint = stop, checkpoint
        if self.blocks is None and stats.get("next") is not None:
            # a replay of meetings that followed the wire: from here, blocks as decided
            self.blocks = Blocks(self.meetings.every)
            self.blocks.met, self.blocks.next = meeting - 1, step
        if self.blocks is not None:
            self.blocks.went(step, stats.get("next"))
        if self._apart:
            self._wire = (stats.get("wire_s"), stats.get("wire_bytes"))
            self._block_began = time.perf_counter()
        self._stats = {"group_size": stats["group_size"], "round": stats["round"],
                       "group_kind": stats["group_kind"],
                       "wait_s": time.perf_counter() - start - spent, "comm_s": spent}

    @property
    def _apart(self) -> bool:
        """Whether the scheduler decides this replica's blocks (meetings apart, or following
        the wire): its ready signals then say its steps, its block's time and its last round's
        wire, which the scheduler decides the blocks from."""
        return self.blocks is not None or self.meetings.every > 1

    def _meeting(self, step: int) -> int:
        """The meeting after local step ``step``: its block's, or, where the run's end cut blocks
        short (:meth:`meet_now`), the one after the last this replica went to. Only the run's
        last meetings come early, so every checkpoint and resume still finds blocks of H steps:
        one taken here holds the steps actually done, and a resume's next meeting is the one its
        step falls in, on both sides."""
        if self.blocks is not None:
            return self.blocks.meeting()
        return max(self.meetings.meeting(step), self._met + 1)

    def _drop(self, checkpoint: int, step: int) -> None:
        """The global sync that checkpoint ``checkpoint`` follows failed here (a member was
        lost inside its all-reduce), so this replica was never averaged with the others: its
        shard is not written, and the scheduler is told, so that no checkpoint claims to be
        one model where it is not."""
        why = "the global sync it follows failed (a member was lost in its all-reduce)"
        log.warning("checkpoint %d is not written: %s", checkpoint, why)
        store.push(self.events, store.EVENTS, protocol.Saved(
            self.rank, self.pipeline, self.stage, checkpoint, step, self.incarnation,
            self._clock(), dropped=why))

    def _decision(self, unit: Unit, step: int, meeting: int) -> protocol.Group:
        """Unit ``unit``'s round of ``meeting`` (its ready signal is sent), as the scheduler
        decided it."""
        decision = store.take(self.events, store.decision_key(unit.index, self.pipeline, meeting,
                                                              self.incarnation), protocol.Group)
        self._follow(decision.members, decision.incarnations)
        if decision.done is not None:
            self._done, self._decided_at = decision.done, step
        if decision.done_steps is not None:
            self._done_steps = decision.done_steps
        unit.heal = decision.heal
        return decision

    def _average(self, unit: Unit, decision: protocol.Group, module: nn.Module, grads: bool,
                 step: int) -> dict[str, Any]:
        """Unit ``unit``'s average over its round's group."""
        got = time.perf_counter()
        members, incarnations = decision.members, decision.incarnations
        module = unit.module(module)
        changes = self.precision != "fp32" and decision.kind == "group"
        distance, failed, payload = None, False, 0
        if len(members) > 1:
            ranks = self._ranks(unit, members)
            params = list(module.parameters())
            tensors = params + statistics(module)
            shares = []  # this member's share of each weighted mean (sync.stale)
            me = members.index(self.pipeline)
            if decision.weight_shares and not decision.twins:
                shares.append((len(tensors), decision.weight_shares[me]))
            if grads:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                if decision.twins:  # the same weights already (never at a global sync)
                    tensors = []
                tensors += [p.grad for p in params]
                if decision.grad_shares:
                    shares.append((len(params), decision.grad_shares[me]))
                if decision.kind == "global" and self.optimizer is not None:
                    tensors += optim.state_tensors(self.optimizer, params)
            # changes: precision is not fp32, so after_backward set the unit's anchor
            payload = (cast(torch.Tensor, unit.anchor).numel() * BYTES[self.precision] if changes
                       else sum(t.numel() * t.element_size() for t in tensors))
            anchor, residual = (unit.anchor, self._residual(unit)) if changes else (None, None)
            tag = f"r{decision.round}"

            def average(tensors: list[torch.Tensor]) -> float | None:
                if changes:  # bf16 or int8 changes since the anchor (weights, statistics)
                    average_changes(tensors, anchor, residual, self.groups, ranks, self.precision,
                                    shares[0][1] if shares else None, incarnations, tag)
                    return None
                return average_tensors(tensors, self.groups, ranks, consensus=len(params) if
                                       decision.kind == "global" else 0,
                                       incarnations=incarnations, tag=tag, shares=shares)
            try:
                if self.overlap and decision.kind == "group" and not grads:
                    self.groups.get(ranks, incarnations, tag)  # its rendezvous, in step
                    running = [u.behind for u in self.units if u.behind is not None]
                    unit.behind = Behind(tensors, average, step + self.overlap, (ranks, incarnations),
                                         ring_bytes(len(members), payload),
                                         running[-1] if running else None)
                else:
                    distance = average(tensors)
            except (RuntimeError, dist.DistError) as err:
                # A member died mid-round (its pipeline was lost). The tensors are only written
                # back after a complete all-reduce, so ours are untouched; the scheduler drops
                # that pipeline from every later group.
                self.groups.forget(ranks, incarnations)
                log.warning("group %s failed (%s); going on alone", members, err)
                members = [self.pipeline]
                failed = True
        if decision.kind == "global" and self.precision != "fp32" and not failed:
            # every replica now holds the same weights: the next changes start here
            unit.anchor = flatten(self._replica(module))
            self._residual(unit).zero_()
        if distance is not None and self.pipeline == members[0]:
            store.push(self.events, store.EVENTS, protocol.Report(
                "consensus", self.rank, self.pipeline, self.stage, self._clock(),
                self.incarnation, {"iteration": step, "round": decision.round,
                                   "members": members, "consensus": distance,
                                   **self._segment(unit)}))
        comm_s = time.perf_counter() - got
        out = {"group_size": len(members), "round": decision.round,
               "group_kind": decision.kind, "comm_s": comm_s, "failed": failed}
        if decision.nexts:  # this member's next block
            out["next"] = decision.nexts[decision.members.index(self.pipeline)]
        if len(members) > 1 and not failed and unit.behind is None:  # the wire: s, bytes via this link
            out.update(wire_s=round(comm_s, 6), wire_bytes=ring_bytes(len(members), payload))
        return out

    def _segment(self, unit: Unit) -> dict[str, int]:
        """A report's segment, where units are not stages."""
        return {} if self.segments is None else {"segment": unit.index}

    @staticmethod
    def _residual(unit: Unit) -> torch.Tensor:
        """What rounding lost of this unit's change since the anchor (zeros at first)."""
        if unit.residual is None:
            unit.residual = torch.zeros_like(unit.anchor)
        return unit.residual

    def stats(self) -> dict[str, Any]:
        return {**self._stats, **self._merged}

    def agree_on_checkpoint(self, wanted: bool) -> bool:
        return False  # the scheduler picks the global syncs to checkpoint at

    def drain_after(self, iteration: int) -> bool:
        # The scheduler counts the iterations begun and places global syncs at drained points.
        store.push(self.events, store.EVENTS, protocol.Begin(
            self.rank, self.pipeline, self.stage, iteration, self.incarnation))
        key = store.begin_key(self.pipeline, iteration, self.incarnation)
        return store.take(self.events, key, protocol.BeginAnswer).last

    def checkpoint_due(self) -> int | None:
        # Replicas are consistent only right after a global sync; the scheduler picks which.
        return self._checkpoint
