"""Sync strategies: how the P replicas of one stage keep their weights in step.

A strategy sees one stage's module at two points of every update: after the backward passes
(:meth:`Sync.after_backward`, where synchronous data parallelism averages gradients, and where
``sync.average=weights_grads`` averages a group's weights and gradients) and after the local
optimizer step (:meth:`Sync.after_step`, where ``sync.average=weights`` mixes replicas). It also
says where the run is for the learning-rate schedule (:meth:`Sync.position`).
On the first stage it also decides whether the pipeline goes on (:meth:`Sync.should_continue`,
given ``local_go``: the local budget ``train.steps`` is left and ``train.time_limit`` has not
passed): strategies that meet every iteration need every replica to stop at the same iteration,
or the last meeting would wait forever for a replica that has stopped.

- ``allreduce``: average gradients over all P replicas every iteration (replicas stay identical).
- ``sdpipe``: send a ready signal to the scheduler, receive a group, and average with exactly that
  group (a group of one: no communication). ``sync.average=weights_grads`` (default): before the
  local step, the group averages weights *and* gradients (gradients only where the scheduler knows
  the members hold the same state: ``twins``), so each member then takes the step that gradient
  all-reduce would take on the group's mean (exact with full groups, for AdamW too);
  global syncs also average the optimizer state, so replicas leave them identical. ``weights``
  (the paper's rule): after the local step, the group averages weights. The scheduler also
  decides when the run ends, since fast pipelines do more iterations than slow ones.
- ``adpsgd``: gossip: average with one peer per round, from a matching both sides derive alone.
- ``ps``: push gradients to a parameter server per stage, pull its weights (stale-synchronous).
- ``diloco``: local SGD with an outer Nesterov step every ``sync.local_steps`` updates
  (:mod:`sdpipe_cli.sync.diloco`).
- ``none``: no communication; every pipeline trains its own replica (the speed limit).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import vector_to_parameters

from sdpipe_cli.core.grouping import gossip_peer
from sdpipe_cli.core.placement import Grid, Placement
from sdpipe_cli.core.meetings import Meetings, average_of, meetings_of, precision_of
from sdpipe_cli.sync.groups import (GroupCache, average_changes, average_parameters,
                                    average_tensors, flatten, statistics, unflatten)
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync.allreduce import AllReduceSync
from sdpipe_cli.sync.base import Sync, Wiring
from sdpipe_cli.sync.diloco import DilocoSync
from sdpipe_cli.sync.traffic import Traffic
from sdpipe_cli.model import optim

log = logging.getLogger("sdpipe.sync")


class GroupSync(Sync):
    """SDPipe's worker side: ready signal -> group from the scheduler -> group average.

    ``average="weights_grads"``: the round comes before the local step and averages the weights
    and the gradients (and, at global syncs, the optimizer state); ``"weights"``: it comes after
    the step and averages the weights. ``optimizer``: whose state a global sync averages.
    ``meetings``: after which local steps the replica meets (the others it trains alone; the
    scheduler counts meetings); ``precision``: ``bf16`` sends a group round's changes since the
    anchor in bfloat16 (:mod:`~sdpipe_cli.core.meetings`; ``average`` must then be ``weights``).
    """

    name = "sdpipe"
    scheduled_checkpoints = True
    mixes_weights = True

    @classmethod
    def build(cls, settings: Any, wiring: Wiring) -> "GroupSync":
        w = wiring.where
        return cls(wiring.events, w.rank, w.pipeline, w.stage, w.stages, w.pipelines,
                   wiring.groups, average_of(settings), wiring.optimizer, wiring.incarnation,
                   meetings_of(settings), precision_of(settings))

    def __init__(self, events: dist.Store, rank: int, pipeline: int, stage: int, stages: int,
                 pipelines: int, groups: GroupCache, average: str = "weights_grads",
                 optimizer: Optional[torch.optim.Optimizer] = None, incarnation: int = 0,
                 meetings: Meetings = Meetings(), precision: str = "fp32"):
        if (meetings.every > 1 or precision != "fp32") and average != "weights":
            raise ValueError("meetings every H > 1 steps and bf16 changes average weights")
        self.events, self.rank, self.pipeline, self.stage, self.stages = (
            events, rank, pipeline, stage, stages)
        self.pipelines, self.groups, self.average = pipelines, groups, average
        self.grid = Grid(pipelines, stages)
        self.optimizer, self.incarnation = optimizer, incarnation
        self.meetings, self.precision = meetings, precision
        # bf16: the weights at the last global sync, alike on every replica, and what rounding
        # lost of this replica's change since (error feedback)
        self.anchor: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None
        self.stop = False
        self._checkpoint: int | None = None
        self._stats: dict[str, Any] = {}
        self._done: Optional[int] = None  # pipeline-meetings begun, at the last decision
        self._decided_at = 0  # the local step of the last decision
        self._heal: list[protocol.HealTarget] = []  # replicas to heal after this update
        self._t0: Optional[float] = None  # the run's time axis, for the reports; read when needed

    def _clock(self) -> float:
        if self._t0 is None:
            self._t0 = store.run_clock(self.events)
        return round(time.time() - self._t0, 4)

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        return not self.stop  # the scheduler ends the run (train.steps counts all pipelines)

    def after_backward(self, module: nn.Module, step: int) -> None:
        if self.precision != "fp32" and self.anchor is None:
            # before the first local step: the weights every replica starts from (or resumes
            # from: a checkpoint follows a global sync), the first anchor
            self.anchor = flatten(self._replica(module))
        self._checkpoint = None
        if self.average == "weights_grads":
            self._round(module, step, grads=True)

    def after_step(self, module: nn.Module, step: int) -> None:
        if self.average == "weights":
            if self.meetings.meets(step):
                self._round(module, step, grads=False)
            else:  # training alone until the next meeting
                self._checkpoint = None
                self._stats = {}
        for target in self._heal:  # after the step: the state the replica goes on from
            self._give_heal(module, target)
        self._heal = []

    def position(self, step: int) -> float:
        """The run's global progress: pipeline-iterations begun over P, as the scheduler counted
        them (in meetings of H iterations) at the last decision, plus this replica's steps since.
        Before the step (weights_grads) that count includes the current iteration of every
        pipeline; after it (weights), the iterations up to the next one's."""
        if self._done is None:
            return float(step)
        if self.meetings.every == 1:
            return self._done / self.pipelines - (1.0 if self.average == "weights_grads" else 0.0)
        # between meetings (flushed schedules: a round is an iteration), the steps since
        return self.meetings.steps(self._done) / self.pipelines + (step - self._decided_at - 1)

    def _replica(self, module: nn.Module) -> list[torch.Tensor]:
        """What a group round averages: the weights, then the running statistics."""
        return list(module.parameters()) + statistics(module)

    def _round(self, module: nn.Module, step: int, grads: bool) -> None:
        start = time.perf_counter()
        meeting = self.meetings.meeting(step)  # the scheduler counts meetings
        store.push(self.events, store.EVENTS, protocol.Ready(
            self.rank, self.pipeline, self.stage, meeting, self.incarnation))
        decision = store.take(self.events, store.decision_key(self.stage, self.pipeline, meeting,
                                                              self.incarnation), protocol.Group)
        got = time.perf_counter()
        members, incarnations = decision.members, decision.incarnations
        if decision.done is not None:
            self._done, self._decided_at = decision.done, step
        changes = self.precision != "fp32" and decision.kind == "group"
        self._heal = decision.heal
        distance, failed = None, False
        if len(members) > 1:
            ranks = self.grid.stage_ranks(self.stage, members)
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
            try:
                if changes:  # bf16 changes since the anchor (the tensors: weights, statistics)
                    average_changes(tensors, self.anchor, self._residual(), self.groups, ranks,
                                    shares[0][1] if shares else None,
                                    incarnations=incarnations, tag=f"r{decision.round}")
                else:
                    distance = average_tensors(tensors, self.groups, ranks,
                                               consensus=len(params) if decision.kind == "global"
                                               else 0, incarnations=incarnations,
                                               tag=f"r{decision.round}", shares=shares)
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
            self.anchor = flatten(self._replica(module))
            self._residual().zero_()
        if distance is not None and self.pipeline == members[0]:
            store.push(self.events, store.EVENTS, protocol.Report(
                "consensus", self.rank, self.pipeline, self.stage, self._clock(),
                self.incarnation, {"iteration": step, "round": decision.round,
                                   "members": members, "consensus": distance}))
        self.stop = decision.stop
        self._checkpoint = decision.checkpoint
        self._stats = {"group_size": len(members), "round": decision.round,
                       "group_kind": decision.kind, "wait_s": got - start,
                       "comm_s": time.perf_counter() - got}

    def _residual(self) -> torch.Tensor:
        """What rounding lost of this replica's change since the anchor (zeros at first)."""
        if self.residual is None:
            self.residual = torch.zeros_like(self.anchor)
        return self.residual

    def stats(self) -> dict[str, Any]:
        return self._stats

    # -- healing a restarted replica (fault.on_pipeline_loss=restart) ---------------------------
    def _state(self, module: nn.Module) -> list[torch.Tensor]:
        """What a replica is: its weights and its optimizer's state, in a fixed order; with bf16
        changes also the anchor they are taken from (a restarted replica's is filled in by the
        broadcast that heals it)."""
        params = list(module.parameters())
        state = params + statistics(module) + (optim.state_tensors(self.optimizer, params)
                                               if self.optimizer else [])
        if self.precision != "fp32":
            if self.anchor is None:
                self.anchor = torch.zeros_like(flatten(self._replica(module)))
            state.append(self.anchor)
        return state

    def _give_heal(self, module: nn.Module, target: protocol.HealTarget) -> None:
        """Send this replica's state to a restarted one (the scheduler chose us as its source)."""
        ranks = [self.rank, self.grid.rank(target.pipeline, self.stage)]
        incarnations = [self.incarnation, target.incarnation]
        try:
            self.groups.broadcast(flatten(self._state(module)), ranks, self.rank, incarnations,
                                  tag=f"heal{target.round}")
        except (RuntimeError, dist.DistError) as err:  # it died again; its pipeline is lost again
            self.groups.forget(ranks, incarnations)
            log.warning("healing pipeline %d failed (%s); going on", target.pipeline, err)

    def rejoin(self, module: nn.Module) -> Optional[int]:
        """A restarted replica: ask the scheduler for a source, take its state; returns the
        iteration to go on from. When the run ended first, ``stop`` is set instead and the state
        is not taken (the iteration is then where the pipeline was, if the scheduler knows)."""
        start = time.perf_counter()
        store.push(self.events, store.EVENTS, protocol.Rejoin(
            self.rank, self.pipeline, self.stage, self.incarnation))
        answer = store.take(self.events, store.heal_key(self.stage, self.pipeline,
                                                        self.incarnation), protocol.HealAnswer)
        answered = time.perf_counter()
        if answer.stop:
            self.stop = True
            return answer.iteration
        source = self.grid.rank(answer.source, self.stage)
        state = self._state(module)
        flat = flatten(state)
        self.groups.broadcast(flat, [source, self.rank], source,
                              [answer.source_incarnation, self.incarnation],
                              tag=f"heal{answer.round}")
        unflatten(flat, state)
        # the run's progress as of now; the steps from here count on from it (position)
        self._done, self._decided_at = answer.done, answer.iteration - 1
        store.push(self.events, store.EVENTS, protocol.Report(
            "healed", self.rank, self.pipeline, self.stage, self._clock(), self.incarnation,
            {"source": answer.source, "iteration": answer.iteration,
             "bytes": flat.numel() * flat.element_size(),
             "seconds": round(time.perf_counter() - start, 4),
             "transfer_s": round(time.perf_counter() - answered, 4)}))
        return answer.iteration

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


class GossipSync(Sync):
    """AD-PSGD-style gossip without a scheduler: after each step, average with one peer.

    The peers of round k come from :func:`~sdpipe_cli.core.grouping.gossip_peer`, a random perfect
    matching that every replica derives from (seed, stage, k) alone; an odd replica out skips the
    round. The price of needing no coordinator is that a pair meets at the same
    iteration: a straggler makes its partner of the round wait, and through changing partners,
    everyone.
    """

    name = "adpsgd"
    mixes_weights = True

    @classmethod
    def build(cls, settings: Any, wiring: Wiring) -> Sync:
        w = wiring.where
        if w.pipelines == 1:
            return Sync()
        # replicas must stop at the same round (time limit, Ctrl-C): they agree on it
        agree = AllReduceSync(wiring.groups, w.replicas(), wiring.device)
        return cls(wiring.groups, w.pipeline, w.pipelines, w.stage, w.stages, wiring.seed, agree)

    def __init__(self, groups: GroupCache, pipeline: int, pipelines: int, stage: int, stages: int,
                 seed: int, agree: AllReduceSync):
        self.groups, self.pipeline, self.pipelines = groups, pipeline, pipelines
        self.stage, self.stages, self.seed, self.agree = stage, stages, seed, agree
        self._stats: dict[str, Any] = {}

    def peer(self, step: int) -> int | None:
        return gossip_peer(self.seed, self.stage, step, self.pipeline, self.pipelines)

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        # Every replica must take part in the same rounds: stopping needs agreement.
        return self.agree.should_continue(step, local_go, timed_out)

    def agree_on_checkpoint(self, wanted: bool) -> bool:
        return self.agree.agree_on_checkpoint(wanted)

    def after_step(self, module: nn.Module, step: int) -> None:
        start = time.perf_counter()
        peer = self.peer(step)
        if peer is not None:
            average_parameters(module, self.groups,
                               Grid(self.pipelines, self.stages).stage_ranks(
                                   self.stage, [self.pipeline, peer]))
        self._stats = {"group_size": 1 if peer is None else 2,
                       "comm_s": time.perf_counter() - start}

    def stats(self) -> dict[str, Any]:
        return self._stats


class PSSync(Sync):
    """Parameter-server baseline: push gradients to the stage's server, pull its weights.

    The server (:mod:`sdpipe_cli.sync.ps`) owns the stage's weights and optimizer; it answers pushes
    asynchronously, except that a replica more than ``sync.staleness`` iterations ahead of the
    slowest waits for its reply (stale-synchronous parallel). The first stage's server counts
    pipeline-iterations and ends the run after ``train.steps x P`` of them.
    """

    name = "ps"
    local_step = False
    mixes_weights = True
    PUSH, LEAVE = 0, 1
    HEADER_TAG, DATA_TAG = 11, 12  # distinct tags: the server receives headers from any source

    @classmethod
    def build(cls, settings: Any, wiring: Wiring) -> "PSSync":
        traffic = wiring.groups.traffic if wiring.groups is not None else None
        return cls(wiring.where.server_rank(), wiring.device, traffic)

    def __init__(self, server: int, device: torch.device, traffic: Optional[Traffic] = None):
        self.server, self.device = server, device
        self.traffic = traffic or Traffic()
        self.stop = False
        self._stats: dict[str, Any] = {}

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        # The server ends the run; a time limit may end a pipeline earlier (no one waits for it).
        return not self.stop and not timed_out

    def after_step(self, module: nn.Module, step: int) -> None:
        start = time.perf_counter()
        params = list(module.parameters())
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                           for p in params])
        header = torch.tensor([step, self.PUSH], dtype=torch.int64, device=self.device)
        dist.send(header, self.server, tag=self.HEADER_TAG)
        dist.send(grads, self.server, tag=self.DATA_TAG)
        reply = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(reply, self.server, tag=self.HEADER_TAG)
        weights = torch.empty_like(grads)
        dist.recv(weights, self.server, tag=self.DATA_TAG)
        with torch.no_grad():
            vector_to_parameters(weights, params)
        self.stop = bool(reply.item())
        self._stats = {"wait_s": time.perf_counter() - start}
        nbytes = grads.numel() * grads.element_size()
        self.traffic.point("server", nbytes + header.numel() * 8, nbytes + reply.numel() * 8,
                           self._stats["wait_s"])

    def stats(self) -> dict[str, Any]:
        return self._stats

    def finish(self) -> None:
        header = torch.tensor([-1, self.LEAVE], dtype=torch.int64, device=self.device)
        dist.send(header, self.server, tag=self.HEADER_TAG)


def strategy_class(name: str) -> type[Sync]:
    """The worker strategy of sync mode ``name``, for what it is rather than one of its objects."""
    for cls in (Sync, AllReduceSync, GroupSync, GossipSync, PSSync, DilocoSync):
        if cls.name == name:
            return cls
    raise ValueError(f"sync.name: unknown strategy '{name}'")


def make_sync(settings: Any, *, events: dist.Store, groups: GroupCache, where: Placement,
              device: torch.device, seed: int = 0,
              optimizer: Optional[torch.optim.Optimizer] = None, incarnation: int = 0,
              steps: int = 0) -> Sync:
    """The strategy of the worker at ``where`` for the run's ``sync`` settings (``optimizer``:
    whose state sdpipe's global syncs average, see :class:`GroupSync`; ``steps``: the run's
    ``train.steps``, which a strategy that meets only now and then needs to end together):
    the mode's class builds it (:meth:`Sync.build`)."""
    wiring = Wiring(events, groups, where, device, seed, optimizer, incarnation, steps)
    return strategy_class(settings.name).build(settings, wiring)
