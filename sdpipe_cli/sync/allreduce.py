"""``sync=allreduce``: synchronous data parallelism, one flat all-reduce of a stage's gradients
over its P replicas every iteration. Also the agreement (stop, checkpoint) of the lock-step modes
that meet less often (``adpsgd``, ``diloco``), which is why it is a module of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli.config.schema import SyncConfig
from sdpipe_cli.core import balance
from sdpipe_cli.sync.base import Sync, Wiring
from sdpipe_cli.sync.groups import GroupCache, statistics


class AllReduceSync(Sync):
    """Synchronous data parallelism over the stage's replica group (one flat all-reduce).

    ``share``: this replica's part of the samples of an iteration, where pipelines take unequal
    shares of the global batch (``pipeline.balance``): its mean gradient is weighted by it, so
    that the sum is the mean gradient of every sample (``None``: the plain mean)."""

    name = "allreduce"

    def __init__(self, groups: GroupCache, replicas: list[int], device: torch.device,
                 share: float | None = None):
        self.groups, self.replicas, self.device = groups, replicas, device
        self.size = len(replicas)
        self.share = share

    @classmethod
    def build(cls, settings: SyncConfig, wiring: Wiring) -> Sync:
        replicas = wiring.where.replicas()
        shares = balance.shares(wiring.samples)
        share = shares[wiring.where.pipeline] if shares else None
        return cls(wiring.groups, replicas, wiring.device, share) if len(replicas) > 1 else Sync()

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        if self.size == 1:  # one pipeline: nobody to agree with
            return local_go
        flag = torch.tensor([1 if local_go else 0], device=self.device)
        self.groups.all_reduce(flag, self.replicas, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def agree_on_checkpoint(self, wanted: bool) -> bool:
        if self.size == 1:
            return wanted
        flag = torch.tensor([1 if wanted else 0], device=self.device)
        self.groups.all_reduce(flag, self.replicas, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def after_backward(self, module: nn.Module, step: int) -> None:
        if self.size == 1:  # the mean over one replica is itself
            return
        # The gradients, and the normalisation layers' running statistics (averaged where DDP
        # broadcasts rank 0's: every replica then evaluates with the same, better estimate).
        tensors = [p.grad for p in module.parameters() if p.grad is not None] + statistics(module)
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        if self.share is not None:
            flat *= self.share
        self.groups.all_reduce(flat, self.replicas)
        if self.share is None:
            flat /= self.size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
