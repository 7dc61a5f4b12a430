"""Sync strategies: how the P replicas of one stage keep their weights in step.

A strategy sees one stage's module at two points of every iteration: after the backward passes
(:meth:`Sync.after_backward`, where synchronous data parallelism averages gradients) and after the
local optimizer step (:meth:`Sync.after_step`, where weight-averaging strategies mix replicas).
On the first stage it also decides whether the pipeline goes on (:meth:`Sync.should_continue`):
strategies that all-reduce every iteration need every replica to stop at the same iteration, or
the last all-reduce would wait forever for a replica that has stopped.

- ``allreduce``: average gradients over all P replicas every iteration (replicas stay identical).
- ``sdpipe``: after the local step, send a ready signal to the scheduler, receive a group, and
  average weights with exactly that group (a group of one: no communication). The scheduler also
  decides when the run ends, since fast pipelines do more iterations than slow ones.
- ``none``: no communication; every pipeline trains its own replica (the speed limit).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from sdpipe_cli import store


class GroupCache:
    """Communicators over subsets of ranks, created on first use by their members only.

    Groups change every round, so they are made on demand and cached, and only the members take
    part: no global collective per round. ``dist.new_group(..., use_local_synchronization=True)``
    is not usable for this: it names a group after its ranks *and the number of groups the calling
    process made before*, so two members with different histories rendezvous under different names
    and hang. Here a group's rendezvous keys are named after its ranks alone, and each process
    creates a given set once, so members always meet.
    """

    def __init__(self, store: dist.Store, rank: int, backend: str, timeout: float):
        self.store, self.rank, self.backend = store, rank, backend
        self.timeout = timedelta(seconds=timeout)
        self._groups: dict[tuple[int, ...], Any] = {}

    def get(self, ranks: list[int]):
        key = tuple(sorted(ranks))
        if key not in self._groups:
            prefix = dist.PrefixStore("groups/" + "-".join(map(str, key)) + "/", self.store)
            me, size = key.index(self.rank), len(key)
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._groups[key] = dist.ProcessGroupNCCL(prefix, me, size, options)
            else:
                self._groups[key] = dist.ProcessGroupGloo(prefix, me, size, self.timeout)
        return self._groups[key]

    def all_reduce(self, tensor: torch.Tensor, ranks: list[int], op=dist.ReduceOp.SUM) -> None:
        """In-place all-reduce of ``tensor`` over ``ranks`` (this rank must be one of them)."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.get(ranks).allreduce([tensor], options).wait()

    def __len__(self) -> int:
        return len(self._groups)


def average_parameters(module: nn.Module, groups: GroupCache, ranks: list[int]) -> None:
    """Replace each parameter by the mean over ``ranks`` (one flat all-reduce, exact weights 1/n)."""
    flat = parameters_to_vector(module.parameters())
    groups.all_reduce(flat, ranks)
    flat /= len(ranks)
    vector_to_parameters(flat, module.parameters())


class Sync:
    """No synchronization: every hook is a no-op; each pipeline stops after ``train.steps``."""

    name = "none"

    def should_continue(self, step: int, local_go: bool) -> bool:
        return local_go

    def after_backward(self, module: nn.Module) -> None:
        pass

    def after_step(self, module: nn.Module, step: int) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        """What the last sync did, for the step event (group size, waiting, communication)."""
        return {}


class AllReduceSync(Sync):
    """Synchronous data parallelism over the stage's replica group (one flat all-reduce)."""

    name = "allreduce"

    def __init__(self, groups: GroupCache, replicas: list[int], device: torch.device):
        self.groups, self.replicas, self.device = groups, replicas, device
        self.size = len(replicas)

    def should_continue(self, step: int, local_go: bool) -> bool:
        flag = torch.tensor([1 if local_go else 0], device=self.device)
        self.groups.all_reduce(flag, self.replicas, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def after_backward(self, module: nn.Module) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.groups.all_reduce(flat, self.replicas)
        flat /= self.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class GroupSync(Sync):
    """SDPipe's worker side: ready signal -> group from the scheduler -> group weight average."""

    name = "sdpipe"

    def __init__(self, events: dist.Store, rank: int, pipeline: int, stage: int, stages: int,
                 groups: GroupCache):
        self.events, self.rank, self.pipeline, self.stage, self.stages = (
            events, rank, pipeline, stage, stages)
        self.groups = groups
        self.stop = False
        self._stats: dict[str, Any] = {}

    def should_continue(self, step: int, local_go: bool) -> bool:
        return not self.stop  # the scheduler ends the run (train.steps counts all pipelines)

    def after_step(self, module: nn.Module, step: int) -> None:
        start = time.perf_counter()
        store.push(self.events, store.EVENTS, {"type": "ready", "rank": self.rank,
                                               "pipeline": self.pipeline, "stage": self.stage,
                                               "iteration": step})
        decision = store.wait_json(self.events, store.decision_key(self.stage, self.pipeline, step))
        got = time.perf_counter()
        members = decision["members"]
        if len(members) > 1:
            ranks = [p * self.stages + self.stage for p in members]
            average_parameters(module, self.groups, ranks)
        self.stop = bool(decision["stop"])
        self._stats = {"group_size": len(members), "round": decision["round"],
                       "group_kind": decision["kind"], "wait_s": got - start,
                       "comm_s": time.perf_counter() - got}

    def stats(self) -> dict[str, Any]:
        return self._stats


def make_sync(name: str, *, events: dist.Store, groups: GroupCache, rank: int, pipeline: int,
              stage: int, pipelines: int, stages: int, device: torch.device) -> Sync:
    """The strategy for ``sync.name``."""
    if name == "sdpipe":
        return GroupSync(events, rank, pipeline, stage, stages, groups)
    if name == "none" or pipelines == 1:
        return Sync()
    if name == "allreduce":
        return AllReduceSync(groups, [p * stages + stage for p in range(pipelines)], device)
    raise ValueError(f"sync.name: unknown strategy '{name}'")
