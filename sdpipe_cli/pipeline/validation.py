"""The validation pass: the same for a pipeline's stages during training and for ``sdpipe eval``.

A run's ``eval`` records and ``sdpipe eval`` must give the same number for the same weights, so
both cut each validation batch into the run's micro-batches the same way
(:func:`~sdpipe_cli.pipeline.microbatches.split`, as training does), run
them through :meth:`~sdpipe_cli.pipeline.executor.Executor.forward_only` (one stage of a
pipeline, or the whole model as one stage) and average alike: the loss is the mean over batches
of the mean over their micro-batches; a classifier's accuracy counts every target that takes
part in the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from sdpipe_cli.model.models import IGNORE_INDEX
from sdpipe_cli.pipeline.microbatches import split

__all__ = ["Outcome", "validate"]


@dataclass(frozen=True)
class Outcome:
    """The last stage's result of one validation pass."""

    loss: float
    accuracy: float | None  # classifiers only
    batches: int


def validate(stage: Any, batches: Iterable[tuple[Any, Any]], microbatches: int, *, first: bool,
             last: bool, classify: bool, device: torch.device,
             on_batch: Callable[[int], None] | None = None) -> Outcome | None:
    """Run ``batches`` of ``(inputs, targets)`` through ``stage`` (anything with
    ``forward_only``) without gradients; the caller sets the module's eval mode. A first stage
    reads the inputs, a last one the targets; a middle one gets ``(None, None)`` batches. The
    :class:`Outcome` on the last stage, None elsewhere. ``on_batch(n)`` after each batch."""
    hits = [0, 0]

    def observe(output: torch.Tensor, target: torch.Tensor) -> None:
        counted = target != IGNORE_INDEX
        hits[0] += int((output.argmax(-1) == target)[counted].sum())
        hits[1] += int(counted.sum())

    losses = []
    for x, y in batches:
        losses.append(stage.forward_only(split(x, microbatches, device) if first else None,
                                         split(y, microbatches, device) if last else None,
                                         microbatches=microbatches,
                                         observe=observe if classify else None))
        if on_batch is not None:
            on_batch(len(losses))
    if not last:
        return None
    accuracy = hits[0] / hits[1] if classify and hits[1] else None
    return Outcome(sum(losses) / len(losses), accuracy, len(losses))
