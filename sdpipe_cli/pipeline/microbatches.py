"""Cutting a batch into micro-batches: the same cut for training and for validation.

A stage's batch (a tensor, or a tuple or dict of them, as a dataset yields it) is cut along its
first dimension with ``torch.chunk``, so micro-batch ``i`` of the inputs on the first stage and
of the targets on the last stage hold the same examples. Training (the worker's ``batch``) and
the validation pass (:mod:`~sdpipe_cli.pipeline.validation`, also behind ``sdpipe eval``) both
cut here, so a run's ``eval`` records and ``sdpipe eval`` see the same micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split"]


def split(x: Any, microbatches: int, device: torch.device) -> list[Any]:
    """``x`` (a tensor, or a tuple or dict of them) cut into ``microbatches``, on ``device``."""
    if isinstance(x, torch.Tensor):
        return [t.to(device, non_blocking=True) for t in x.chunk(microbatches)]
    if isinstance(x, dict):
        parts = {k: split(v, microbatches, device) for k, v in x.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(microbatches)]
    return [type(x)(p) for p in zip(*(split(v, microbatches, device) for v in x))]
