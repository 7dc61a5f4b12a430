"""``sync=diloco``: local SGD with an outer optimizer (DiLoCo), the communication-light baseline.

Each replica takes ``sync.local_steps`` steps of its own optimizer without talking to anyone.
Then the stage's replicas average their change since the last outer step (the outer gradient,
``anchor - weights``), and every replica applies the same outer step to the anchor, SGD with
Nesterov momentum (``sync.outer_lr``, ``sync.outer_momentum``; DiLoCo's defaults 0.7 and 0.9), so
all replicas leave an outer step identical. Communication falls by ``local_steps``, but each
outer step waits for every replica, as all-reduce does each iteration: a straggler still sets
the pace, once per outer step.

With ``local_steps=1``, ``outer_lr=1`` and ``outer_momentum=0`` the outer step is the mean of the
replicas' updated weights: for plain SGD, exactly gradient all-reduce. The run's last update
(``train.steps``) is an outer step too, so the replicas end identical; a time limit or a stop
request ends the run at the next outer step.

``precision="bf16"`` (or ``"int8"``) averages the outer gradient in bfloat16 (or int8 with a scale
per chunk, as INTELLECT-1 sends its pseudo-gradients) with error feedback
(:func:`~sdpipe_cli.sync.groups.mean_of_changes`): half (about a quarter) of float32's bytes, the
baseline sdpipe's changes in the same precision are compared with.

The anchor, the outer momentum, the rounding residual and the count of updates are the
strategy's state: they are in the worker's checkpoint shard (``sync``), so a resumed run takes
its next outer step where the interrupted one would have.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
from torch import nn

from sdpipe_cli.config.schema import DilocoSyncConfig, SyncConfig
from sdpipe_cli.core.meetings import precision_of
from sdpipe_cli.sync.allreduce import AllReduceSync
from sdpipe_cli.sync.base import Sync, Wiring
from sdpipe_cli.sync.groups import GroupCache, flatten, mean_of_changes, statistics, unflatten


class DilocoSync(Sync):
    name = "diloco"
    mixes_weights = True  # the replicas' weights are averaged (tied copies: training/tied.py)
    flat_state = ("anchor", "momentum", "residual")

    def __init__(self, groups: GroupCache | None, replicas: list[int], local_steps: int,
                 outer_lr: float, outer_momentum: float, agree: Sync | None, steps: int,
                 precision: str = "fp32"):
        self.groups, self.replicas = groups, replicas
        self.local_steps, self.outer_lr, self.mu = local_steps, outer_lr, outer_momentum
        self.agree = agree  # lock-step: every replica must stop at the same update
        self.steps = steps  # the budget (train.steps): the last update is an outer step too
        self.updates = 0
        self.anchor: torch.Tensor | None = None  # the weights after the last outer step
        self.momentum: torch.Tensor | None = None
        self.precision = precision
        self.residual: torch.Tensor | None = None  # bf16, int8: what rounding lost so far
        self._stats: dict[str, Any] = {}

    @classmethod
    def build(cls, settings: SyncConfig, wiring: Wiring) -> DilocoSync:
        assert isinstance(settings, DilocoSyncConfig)  # strategy_class: diloco's own settings
        replicas = wiring.where.replicas()
        agree = AllReduceSync(wiring.groups, replicas, wiring.device) if len(replicas) > 1 else None
        return cls(wiring.groups, replicas, settings.local_steps, settings.outer_lr,
                   settings.outer_momentum, agree, wiring.steps, precision_of(settings))

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        """Replicas stop together, and only where they meet: at an outer step. The budget is the
        same number on every replica, so it needs no message; a time limit or a stop request
        (``timed_out``, seen by each replica at its own moment) is agreed on at the next outer
        step, in one all-reduce there, instead of one every iteration."""
        if step >= self.steps:
            return False
        if step % self.local_steps:  # between outer steps: go on to the next one
            return True
        return self.agree.should_continue(step, local_go, timed_out) if self.agree else local_go

    def agree_on_checkpoint(self, wanted: bool) -> bool:
        return self.agree.agree_on_checkpoint(wanted) if self.agree else wanted

    def after_backward(self, module: nn.Module, step: int) -> None:
        if self.anchor is None:  # before the first local step: where the first round starts
            self.anchor = flatten(list(module.parameters()))

    def after_step(self, module: nn.Module, step: int) -> None:
        self.updates += 1
        if self.updates % self.local_steps and self.updates != self.steps:
            self._stats = {"group_size": 1, "comm_s": 0.0}
            return
        start = time.perf_counter()
        params = list(module.parameters())
        anchor = cast(torch.Tensor, self.anchor)  # set by a resume, or by after_backward
        if anchor.device != params[0].device:  # restored from a checkpoint, on the CPU
            self.anchor = anchor.to(params[0].device)
            self.momentum = None if self.momentum is None else self.momentum.to(params[0].device)
            self.residual = None if self.residual is None else self.residual.to(params[0].device)
        outer_grad = self.anchor - flatten(params)
        buffers = statistics(module)
        groups = cast(GroupCache, self.groups)  # None only with one replica, which never averages
        if len(self.replicas) > 1 and self.precision != "fp32":
            if self.residual is None:
                self.residual = torch.zeros_like(outer_grad)
            mean_of_changes(outer_grad, self.residual, groups, self.replicas, self.precision)
            if buffers:  # the running statistics are no change: averaged in float32
                flat = flatten(buffers)
                groups.all_reduce(flat, self.replicas)
                unflatten(flat / len(self.replicas), buffers)
        elif len(self.replicas) > 1:
            # one all-reduce: the outer gradient and the running statistics, averaged
            flat = torch.cat([outer_grad] + [b.reshape(-1).float() for b in buffers])
            groups.all_reduce(flat, self.replicas)
            flat /= len(self.replicas)
            outer_grad = flat[:outer_grad.numel()]
            if buffers:
                unflatten(flat[outer_grad.numel():], buffers)
        self.momentum = (outer_grad.clone() if self.momentum is None
                         else self.mu * self.momentum + outer_grad)
        self.anchor = self.anchor - self.outer_lr * (outer_grad + self.mu * self.momentum)
        unflatten(self.anchor, params)
        self._stats = {"group_size": len(self.replicas), "comm_s": time.perf_counter() - start}

    def stats(self) -> dict[str, Any]:
        return self._stats

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"updates": self.updates}
        if self.anchor is not None:
            state["anchor"] = self.anchor.detach().cpu()
        if self.momentum is not None:
            state["momentum"] = self.momentum.detach().cpu()
        if self.residual is not None:
            state["residual"] = self.residual.detach().cpu()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state.get("updates", 0))
        self.anchor, self.momentum = state.get("anchor"), state.get("momentum")
        self.residual = state.get("residual")
