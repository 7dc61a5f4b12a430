"""fp16's dynamic loss scale: when to shrink it, when to grow it, and whether a step is taken.

fp16 gradients underflow unless the loss is scaled up before the backward; a scale too large
overflows instead. The usual remedy (Megatron, DeepSpeed, torch's ``GradScaler``): start high,
halve the scale and skip the step when the gradients are not finite, double it after a run of
good steps. Here the decision must be the same on every stage of a pipeline (their gradients
are one model's) and every member of a sync group, so the worker decides from the gradient norm
summed over the pipeline, after the group averaged its gradients: a non-finite value anywhere
in either makes the norm non-finite everywhere. This class is only the policy, with no tensors:
every stage feeds it the same verdicts, so every stage holds the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LossScale"]


@dataclass
class LossScale:
    value: float = 2.0 ** 16  # the initial scale
    growth_interval: int = 2000  # good steps in a row before the scale doubles
    factor: float = 2.0
    minimum: float = 1.0
    good_steps: int = 0
    skipped: int = 0  # steps skipped so far
    # the last verdict overflowed at the smallest scale: unscaled, the gradient is not finite
    # either, and halving cannot help (the run has diverged; skipping on would skip forever)
    exhausted: bool = False

    def update(self, finite: bool) -> bool:
        """Record one update's verdict; returns whether the optimizer steps."""
        self.exhausted = not finite and self.value <= self.minimum
        if not finite:
            self.value = max(self.minimum, self.value / self.factor)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.value *= self.factor
            self.good_steps = 0
        return True
