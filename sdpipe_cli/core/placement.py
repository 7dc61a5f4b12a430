"""Where a worker sits in the P x S grid, and the ranks of its neighbours and replicas.

Ranks are pipeline-major, ``rank = pipeline * stages + stage``; parameter servers (``sync=ps``)
come after the ``P * S`` workers, one per stage. This is the one place that knows the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Grid", "Placement"]


@dataclass(frozen=True)
class Grid:
    """The P x S grid of a run's workers, for those who see all of them (the launcher, the
    scheduler, a parameter server, a checkpoint's shards)."""

    pipelines: int
    stages: int

    @property
    def workers(self) -> int:
        return self.pipelines * self.stages

    def rank(self, pipeline: int, stage: int) -> int:
        return pipeline * self.stages + stage

    def pipeline_of(self, rank: int) -> int:
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def pipeline_ranks(self, pipeline: int) -> range:
        """The ranks of ``pipeline``, first stage first."""
        return range(pipeline * self.stages, (pipeline + 1) * self.stages)

    def stage_ranks(self, stage: int, pipelines=None) -> list[int]:
        """The ranks holding ``stage`` in ``pipelines`` (default: every pipeline)."""
        return [self.rank(p, stage) for p in (range(self.pipelines) if pipelines is None
                                              else pipelines)]

    def server_rank(self, stage: int) -> int:
        """The parameter server of ``stage`` (``sync=ps``): after the workers."""
        return self.workers + stage

    def neighbour_pairs(self) -> list[tuple[int, int]]:
        """(rank of stage s, rank of stage s+1) for every pipeline, in rank order."""
        return [(self.rank(p, s), self.rank(p, s + 1))
                for p in range(self.pipelines) for s in range(self.stages - 1)]

    def at(self, rank: int) -> Placement:
        return Placement(rank, self.pipelines, self.stages)


@dataclass(frozen=True)
class Placement:
    """Worker ``rank`` of a run of ``pipelines`` pipelines of ``stages`` stages."""

    rank: int
    pipelines: int
    stages: int

    @classmethod
    def of(cls, pipeline: int, stage: int, pipelines: int, stages: int) -> Placement:
        return cls(pipeline * stages + stage, pipelines, stages)

    @property
    def pipeline(self) -> int:
        return self.rank // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def workers(self) -> int:
        return self.pipelines * self.stages

    @property
    def grid(self) -> Grid:
        return Grid(self.pipelines, self.stages)

    def rank_of(self, pipeline: int, stage: int) -> int:
        return self.grid.rank(pipeline, stage)

    @property
    def prev_rank(self) -> int | None:
        """The previous stage of this pipeline (None on the first stage)."""
        return None if self.first else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        """The next stage of this pipeline (None on the last stage)."""
        return None if self.last else self.rank + 1

    def replicas(self, pipelines: list[int] | None = None) -> list[int]:
        """The ranks holding this stage in ``pipelines`` (default: every pipeline)."""
        members = range(self.pipelines) if pipelines is None else pipelines
        return [self.rank_of(p, self.stage) for p in members]

    def pipeline_ranks(self) -> list[int]:
        """The ranks of this worker's pipeline, first stage first."""
        return [self.rank_of(self.pipeline, s) for s in range(self.stages)]

    def server_rank(self) -> int:
        """The parameter server of this stage (``sync=ps``)."""
        return self.grid.server_rank(self.stage)
