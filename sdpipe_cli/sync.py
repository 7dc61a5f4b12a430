"""Sync strategies: how the P replicas of one stage keep their weights in step.

A strategy sees one stage's module at two points of every iteration: after the backward passes
(:meth:`Sync.after_backward`, where synchronous data parallelism averages gradients) and after the
local optimizer step (:meth:`Sync.after_step`, where weight-averaging strategies mix replicas).
It also decides, on the first stage, whether the pipeline goes on (:meth:`Sync.agree_to_continue`):
strategies that all-reduce every iteration need every replica to stop at the same iteration, or the
last all-reduce would wait forever for a replica that has stopped.

- ``allreduce``: average gradients over all P replicas every iteration (replicas stay identical).
- ``none``: no communication; every pipeline trains its own replica (the speed limit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Sync:
    """No synchronization: the base class does nothing at every hook."""

    name = "none"

    def agree_to_continue(self, go: bool) -> bool:
        return go

    def after_backward(self, module: nn.Module) -> None:
        pass

    def after_step(self, module: nn.Module, step: int) -> None:
        pass


class AllReduceSync(Sync):
    """Synchronous data parallelism over the stage's replica group (one flat all-reduce)."""

    name = "allreduce"

    def __init__(self, group: dist.ProcessGroup, size: int, device: torch.device):
        self.group, self.size, self.device = group, size, device

    def agree_to_continue(self, go: bool) -> bool:
        flag = torch.tensor([1 if go else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def after_backward(self, module: nn.Module) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat /= self.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def make_sync(name: str, group: dist.ProcessGroup | None, size: int, device: torch.device) -> Sync:
    """The strategy for ``sync.name``; a single replica needs no communication."""
    if name == "none" or size == 1 or group is None:
        return Sync()
    if name == "allreduce":
        return AllReduceSync(group, size, device)
    raise ValueError(f"sync.name: unknown strategy '{name}'")
