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
  decides when the run ends, since fast pipelines do more iterations than slow ones
  (:mod:`sdpipe_cli.sync.group_sync`).
- ``adpsgd``: gossip: average with one peer per round, from a matching both sides derive alone.
- ``ps``: push gradients to a parameter server per stage, pull its weights (stale-synchronous).
- ``diloco``: local SGD with an outer Nesterov step every ``sync.local_steps`` updates
  (:mod:`sdpipe_cli.sync.diloco`).
- ``none``: no communication; every pipeline trains its own replica (the speed limit).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import vector_to_parameters

from sdpipe_cli.config.schema import SyncConfig
from sdpipe_cli.core.grouping import gossip_peer
from sdpipe_cli.core.placement import Grid, Placement
from sdpipe_cli.core.segments import Segments
from sdpipe_cli.sync.allreduce import AllReduceSync
from sdpipe_cli.sync.base import Sync, Wiring
from sdpipe_cli.sync.diloco import DilocoSync
from sdpipe_cli.sync.group_sync import GroupSync
from sdpipe_cli.sync.groups import GroupCache, average_parameters
from sdpipe_cli.sync.traffic import Traffic

log = logging.getLogger("sdpipe.sync")


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
    def build(cls, settings: SyncConfig, wiring: Wiring) -> Sync:
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
    def build(cls, settings: SyncConfig, wiring: Wiring) -> PSSync:
        traffic = wiring.groups.traffic if wiring.groups is not None else None
        return cls(wiring.where.server_rank(), wiring.device, traffic)

    def __init__(self, server: int, device: torch.device, traffic: Traffic | None = None):
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


def make_sync(settings: SyncConfig, *, events: dist.Store, groups: GroupCache, where: Placement,
              device: torch.device, seed: int = 0,
              optimizer: torch.optim.Optimizer | None = None, incarnation: int = 0,
              steps: int = 0, segments: Segments | None = None,
              samples: tuple[int, ...] = ()) -> Sync:
    """The strategy of the worker at ``where`` for the run's ``sync`` settings (the dataclass of
    its mode: :func:`~sdpipe_cli.config.settings.settings_of`; ``optimizer``:
    whose state sdpipe's global syncs average, see :class:`GroupSync`; ``steps``: the run's
    ``train.steps``, which a strategy that meets only now and then needs to end together;
    ``segments``: what replicas average, where pipelines are split differently; ``samples``:
    each pipeline's micro-batches an iteration): the mode's class builds it (:meth:`Sync.build`)."""
    wiring = Wiring(events, groups, where, device, seed, optimizer, incarnation, steps, segments,
                    samples)
    return strategy_class(settings.name).build(settings, wiring)
