"""The optimizer and its learning-rate schedule: one owner for both training loops and the PS.

``train.optimizer`` is ``adamw`` (the default) or ``sgd`` (with ``train.momentum``): SGD's update is
linear in the gradient, so averaging weights after local steps equals gradient all-reduce, which is
the setting of the method's convergence analysis; AdamW's is not (see ``docs/SYNC.md``).

The schedule is a function of a *position* in iterations of an average pipeline, not of one
replica's iteration count: pipelines progress at different speeds, and a schedule that followed
each replica's own count would decay the fast ones early while the slow ones stay at the peak.
Lock-step modes pass their iteration (every replica is there); ``sync=sdpipe`` and ``ps`` pass the
run's global progress, pipeline-iterations of all pipelines over P (see :meth:`Sync.position`).

The optimizer state is created eagerly, with the values the optimizer would give it at its first
step, so that it has the same shape on every replica from the start: group syncs average it.

Gradient clipping is by the norm of the whole model's gradient, as Megatron-LM, DeepSpeed and
torchtitan clip: each stage holds a slice of the model, so its squared norm is summed over the
pipeline's stages (one scalar all-reduce) before torch's own clipping applies the common factor.
Clipping each stage by its own norm would change the training math with the number of stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

import torch
from omegaconf import DictConfig

from sdpipe_cli.config.schema import TrainConfig

ADAMW_BETAS = (0.9, 0.95)


def lr_at(position: float, train: TrainConfig | DictConfig) -> float:
    """Linear warm-up, then ``train.schedule``: cosine or linear decay to ``train.final_lr`` of
    the peak at ``train.steps``, step decay (x ``decay_factor`` every ``decay_every``
    iterations after the warm-up, the ResNet recipe's), or constant.

    ``position``: iterations of an average pipeline done before this update (0 for the first);
    ``train``: the config's ``train`` section.
    """
    t = train
    position = max(0.0, position)
    if t.warmup and position < t.warmup:
        return t.lr * (position + 1) / t.warmup
    after = position - t.warmup
    schedule = t.schedule
    if schedule == "constant":
        return t.lr
    if schedule == "step":
        return t.lr * t.decay_factor ** int(after // t.decay_every)
    final = t.final_lr
    progress = min(1.0, after / max(1, t.steps - t.warmup))
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return t.lr * (final + (1 - final) * shape)


def state_slots(train: TrainConfig | DictConfig) -> int:
    """Tensors of optimizer state per parameter: AdamW's two moments, SGD's momentum buffer or
    nothing (what the memory estimate and a checkpoint's size count)."""
    return 2 if train.optimizer != "sgd" else (1 if train.momentum else 0)


def build_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig | DictConfig) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params`` (``train``: the config's ``train`` section), its state
    already created (see the module's note).

    The multi-tensor (``foreach``) update on every device: torch picks it by itself only on CUDA,
    and on CPU the per-parameter loop cost a small model's step twice the optimizer's time (29
    parameters: 1.18 ms a step against 0.64)."""
    t = train
    params = list(params)
    if t.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum,
                                    weight_decay=t.weight_decay, foreach=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=t.lr, betas=ADAMW_BETAS,
                                      weight_decay=t.weight_decay, foreach=True)
    _create_state(optimizer, params, t.optimizer)
    return optimizer


def _create_state(optimizer: torch.optim.Optimizer, params: list, kind: str) -> None:
    for p in params:
        if kind == "sgd":
            if optimizer.defaults["momentum"]:
                # torch starts the buffer at the first gradient; 0.9 x 0 + g is that gradient
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}
        else:
            optimizer.state[p] = {"step": torch.tensor(0.0),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> list:
    """The optimizer's per-parameter state in a fixed order (moments, and AdamW's step count),
    for averaging in a group; the same list on every replica of a stage."""
    tensors = []
    for p in params:
        state = optimizer.state.get(p, {})
        tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
    return tensors


def scale_gradients(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` (fp16: undo the loss scale)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def finite_gradients(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite (one norm over them all, so one host sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                   sum_over_stages: Callable[[torch.Tensor], None] | None = None,
                   exclude: Collection[int] = ()) -> float:
    """Scale the gradients so that the model's 2-norm is at most ``max_norm``; returns the norm
    (not finite if any gradient is not).

    ``sum_over_stages`` sums a one-element tensor in place over the pipeline's stages (None: this
    stage is the whole model). ``exclude``: ids of parameters another stage counts in the norm
    (a tied weight's copy); they are still clipped.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if id(p) not in exclude]
    device = params[0].grad.device if params else torch.device("cpu")
    # Squared norms in float64, summed: the same total (to float64 rounding) however the model
    # is cut into stages, so the clipping factor, and the training, do not depend on the cut.
    squared = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        squared += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).pow(2)
    if sum_over_stages is not None:
        sum_over_stages(squared)
    total = squared.sqrt().to(torch.float32).reshape(())
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
