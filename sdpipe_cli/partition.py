"""Pipeline partitioning: which contiguous range of blocks each stage holds.

A partition is written as S - 1 *boundaries* (block indices where a new stage starts), so that
``[2]`` on a 6-block model gives stage 0 blocks 0-1 and stage 1 blocks 2-5. Replicas of one stage
hold the same blocks on every pipeline (they average weights), so one partition serves all.

The functions here are pure: they take block costs and return boundaries, no I/O.
"""

from __future__ import annotations

from typing import Sequence


def uniform(blocks: int, stages: int) -> list[int]:
    """Split ``blocks`` into ``stages`` near-equal parts; the earlier stages take the remainder."""
    _check(blocks, stages)
    size, extra = divmod(blocks, stages)
    bounds, start = [], 0
    for s in range(stages - 1):
        start += size + (1 if s < extra else 0)
        bounds.append(start)
    return bounds


def balanced(costs: Sequence[float], stages: int) -> list[int]:
    """Boundaries that minimize the largest stage cost (exact dynamic program over contiguous ranges).

    O(stages x blocks^2): trivial for the tens of blocks a pipeline has. Ties go to the partition
    whose stages end earliest, so the result is deterministic.
    """
    n = len(costs)
    _check(n, stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: smallest bottleneck when the first j blocks form k stages; cut[k][j]: last start.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(stages, 1, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]


def stage_ranges(bounds: Sequence[int], blocks: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` per stage, from boundaries."""
    edges = [0, *bounds, blocks]
    return list(zip(edges, edges[1:]))


def resolve(partition, blocks: int, stages: int, param_counts: Sequence[int] | None = None) -> list[int]:
    """Boundaries for a ``pipeline.partition`` setting: ``uniform``, ``params`` or explicit list."""
    if partition == "uniform":
        return uniform(blocks, stages)
    if partition == "params":
        if param_counts is None:
            raise ValueError("partition=params needs the blocks' parameter counts")
        return balanced(param_counts, stages)
    return [int(b) for b in partition]


def _check(blocks: int, stages: int) -> None:
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot split {blocks} blocks into {stages} non-empty stages")
