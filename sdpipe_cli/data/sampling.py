"""Which sample a pipeline reads next: disjoint shards, epochs reshuffled by seed, and a position.

The order is a pure function, so that every process that needs a batch (the first stage for the
inputs, the last for the labels) computes the same one without talking, and a checkpoint only has
to remember one number, the pipeline's *position* (samples it has consumed):

* epoch ``e`` is a permutation of the ``n`` training samples drawn from ``(seed, e)``;
* pipeline ``p`` of ``P`` reads every ``P``-th entry of it, from the ``p``-th (the remainder, fewer
  than ``P`` samples, is left out of that epoch so that all pipelines have equal shards);
* the sample at position ``k`` of pipeline ``p`` is entry ``k mod m`` of its shard of epoch
  ``k div m``, where ``m = n div P``.

Pipelines of a heterogeneous cluster run at different speeds, so they are in different epochs at
any moment; since each epoch is a fresh permutation, a fast pipeline keeps seeing new samples
instead of cycling its own fixed slice. Within an epoch the shards are disjoint.

Each sample also gets a *key*: a seed for its random transform (crop, flip, masking), a function
of ``(seed, pipeline, position)``, so augmentation is as reproducible as the order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sdpipe_cli.runtime.errors import DataError

__all__ = ["Order", "seed_of"]


def seed_of(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same in every process, on every run and machine."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class Order:
    """The training order of pipeline ``pipeline`` of ``pipelines`` over ``n`` samples."""

    n: int
    pipeline: int
    pipelines: int
    seed: int
    _cached: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.pipeline < self.pipelines:
            raise ValueError(f"pipeline {self.pipeline} is not in range for {self.pipelines}")
        if self.n < self.pipelines:
            raise DataError("cluster.pipelines", f"{self.pipelines} pipelines share {self.n} training "
                            "samples, fewer than one each; use more data or fewer pipelines")

    @property
    def shard_size(self) -> int:
        """Samples per pipeline per epoch."""
        return self.n // self.pipelines

    def epoch_of(self, position: int) -> int:
        return position // self.shard_size

    def _shard(self, epoch: int) -> torch.Tensor:
        """This pipeline's samples in epoch ``epoch``, in order (the last epoch's is cached: a
        permutation of a large data set costs milliseconds, a batch needs it once per epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            g = torch.Generator().manual_seed(seed_of("epoch", self.seed, epoch))
            perm = torch.randperm(self.n, generator=g)
            self._cached = (epoch, perm[self.pipeline: self.shard_size * self.pipelines: self.pipelines])
        return self._cached[1]

    def index(self, position: int) -> int:
        """The data set index of the sample at ``position`` of this pipeline's stream."""
        if position < 0:
            raise ValueError(f"position {position} is negative")
        epoch, within = divmod(position, self.shard_size)
        return int(self._shard(epoch)[within])

    def key(self, position: int) -> int:
        """The seed of the random transform of the sample at ``position``."""
        return seed_of("sample", self.seed, self.pipeline, position)

    def take(self, position: int, count: int) -> list[tuple[int, int]]:
        """``(index, key)`` of the ``count`` samples from ``position`` on."""
        return [(self.index(k), self.key(k)) for k in range(position, position + count)]

    def batches(self, position: int, batch_size: int) -> Iterator[list[tuple[int, int]]]:
        """Batches of ``batch_size`` samples from ``position`` on, without end."""
        while True:
            yield self.take(position, batch_size)
            position += batch_size
