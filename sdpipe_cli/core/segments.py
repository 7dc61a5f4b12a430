"""What replicas average when pipelines are split differently: segments of blocks.

Replicas average what they hold in common. When every pipeline has the same partition, that is a
stage: stage s of each pipeline holds the same blocks, and the scheduler forms groups per stage.
A pipeline may have its own split (``pipeline.partitions``; a re-plan around a device that slowed
down gives one), and its stage s then holds other blocks than stage s of another pipeline. The
unit of averaging is then a *segment*: a maximal range of blocks that no pipeline's stage boundary
cuts. Every segment lies on exactly one stage of each pipeline (its *holder* there), a stage holds
one or more consecutive segments, and the scheduler forms groups per segment exactly as it does per
stage: to it, a segment is a stage whose replica in pipeline p runs on p's holder. With one
partition for all, the segments are the stages.

A run that may re-split a pipeline while the others go on (``fault.replan_in_place``) cuts its
segments at every block as well (``grain``: the model's block count): a new split then still
holds whole segments, so the units of averaging, and every replica's rounds of them, stay as
they were.

Interleaved stages (``stages`` fewer than a partition's pieces: ``v`` chunks a stage, piece ``k``
on stage ``k mod S``, :mod:`~sdpipe_cli.core.interleaved`) hold several ranges each: a segment
lies on the stage of its piece, and its place in that stage's module (its chunks' blocks one
after another) is counted over the chunks before its own.

Pure: boundaries in, indices out. A partition is written as in :mod:`~sdpipe_cli.core.partition`
(S - 1 block indices where a stage starts), so no block count is needed but for ``grain``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

__all__ = ["Segments", "partitions_of", "with_split"]


@dataclass(frozen=True)
class Segments:
    """The segments of a run whose pipeline ``p`` is split at ``partitions[p]`` (and, with
    ``grain`` blocks, at every block)."""

    partitions: tuple[tuple[int, ...], ...]
    grain: int = 0
    stages: int = 0  # stages of a pipeline; 0: one a piece of the partition (no interleaving)

    @classmethod
    def of(cls, partitions: Sequence[Sequence[int]], grain: int = 0, stages: int = 0) -> Segments:
        parts = tuple(tuple(int(b) for b in bounds) for bounds in partitions)
        if not parts or len({len(b) for b in parts}) != 1:
            raise ValueError("every pipeline needs a partition into the same number of stages")
        if stages and (len(parts[0]) + 1) % stages:
            raise ValueError(f"{len(parts[0]) + 1} pieces do not make {stages} stages of equal "
                             "chunk counts")
        return cls(parts, int(grain), 0 if stages == len(parts[0]) + 1 else int(stages))

    def resplit(self, pipeline: int, bounds: Sequence[int]) -> Segments:
        """These segments with ``pipeline`` split at ``bounds``: the same units when ``grain``
        cuts at every block."""
        parts = list(self.partitions)
        parts[pipeline] = tuple(int(b) for b in bounds)
        return Segments.of(parts, self.grain, self.stages)

    @cached_property
    def cuts(self) -> tuple[int, ...]:
        """Where a segment starts, after the first: every pipeline's boundaries together (and
        every block's, with ``grain``)."""
        return tuple(sorted({b for bounds in self.partitions for b in bounds}
                            | set(range(1, self.grain))))

    @cached_property
    def count(self) -> int:
        return len(self.cuts) + 1

    @cached_property
    def uniform(self) -> bool:
        """Whether the segments are the stages: every pipeline has the same partition, and it
        cuts wherever ``grain`` does."""
        return (len(set(self.partitions)) == 1 and self.cuts == self.partitions[0]
                and not self.stages)

    def start(self, k: int) -> int:
        """The first block of segment ``k``."""
        return 0 if k == 0 else self.cuts[k - 1]

    def stop(self, k: int) -> int | None:
        """The block after segment ``k`` (None for the last: the model's end)."""
        cuts = self.cuts
        return cuts[k] if k < len(cuts) else None

    def _piece(self, pipeline: int, k: int) -> int:
        """The piece of ``pipeline``'s partition (its stage, unless interleaved) holding ``k``."""
        return bisect_right(self.partitions[pipeline], self.start(k))

    def holder(self, pipeline: int, k: int) -> int:
        """The stage of ``pipeline`` that holds segment ``k``."""
        piece = self._piece(pipeline, k)
        return piece % self.stages if self.stages else piece

    def held(self, pipeline: int, stage: int) -> list[int]:
        """The segments stage ``stage`` of ``pipeline`` holds, in order (at least one): the
        order of its module's blocks."""
        return [k for k in range(self.count) if self.holder(pipeline, k) == stage]

    def local(self, pipeline: int, k: int) -> tuple[int, int | None]:
        """Segment ``k``'s blocks as a slice of its holder's blocks in ``pipeline`` (its
        chunks', one after another): (start, stop), with stop None where the segment runs to
        the end of that stage's blocks."""
        bounds, piece = self.partitions[pipeline], self._piece(pipeline, k)
        edges = [0, *bounds, None]
        pieces, step = len(bounds) + 1, self.stages or len(bounds) + 1
        before = sum(cast(int, edges[j + 1]) - cast(int, edges[j])
                     for j in range(piece % step, piece, step))  # its stage's earlier chunks
        first = cast(int, edges[piece])
        start, stop = self.start(k) - first + before, self.stop(k)
        if stop == edges[piece + 1] and piece + step >= pieces:
            return start, None  # to the end of the stage's last chunk
        return start, cast(int, stop) - first + before


def partitions_of(pipeline: Any, pipelines: int) -> tuple[tuple[int, ...], ...]:
    """Each pipeline's partition from a resolved ``pipeline`` section: ``pipeline.partition``,
    unless ``pipeline.partitions`` gives the pipeline its own."""
    own: Mapping[int, Any] = pipeline.get("partitions") or {}
    base = tuple(int(b) for b in pipeline.partition)
    return tuple(tuple(int(b) for b in own[p]) if p in own else base for p in range(pipelines))


def with_split(own: Mapping[int, Any] | None, shared: Sequence[int], pipeline: int,
               bounds: Sequence[int]) -> dict[int, list[int]]:
    """``pipeline.partitions`` once ``pipeline`` is split at ``bounds``: its own entry, or none
    where that is ``shared`` (``pipeline.partition``)."""
    splits = {int(p): [int(b) for b in v] for p, v in (own or {}).items()}
    splits.pop(int(pipeline), None)
    if [int(b) for b in bounds] != [int(b) for b in shared]:
        splits[int(pipeline)] = [int(b) for b in bounds]
    return dict(sorted(splits.items()))
