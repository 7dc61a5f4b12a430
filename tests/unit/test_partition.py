"""Partitioning: uniform splits, the exact balanced DP against brute force, ranges and resolve."""

from __future__ import annotations

import itertools
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.partition import balanced, device_cost, optimal, plan, resolve, stage_ranges, stage_times, uniform

# PARTITION_EXAMPLES=2000 for a longer hunt against the brute force
PARTITION_EXAMPLES = int(os.environ.get("PARTITION_EXAMPLES", "100"))


def sizes(bounds, blocks):
    return [stop - start for start, stop in stage_ranges(bounds, blocks)]


def bottleneck(costs, bounds):
    return max(sum(costs[a:b]) for a, b in stage_ranges(bounds, len(costs)))


def brute_force(costs, stages):
    """The optimal bottleneck over every choice of S - 1 boundaries."""
    n = len(costs)
    return min(bottleneck(costs, list(c)) for c in itertools.combinations(range(1, n), stages - 1))


# ---------------------------------------------------------------------------- uniform


@pytest.mark.parametrize("blocks", range(1, 13))
def test_uniform_every_split(blocks):
    for stages in range(1, blocks + 1):
        bounds = uniform(blocks, stages)
        assert len(bounds) == stages - 1
        parts = sizes(bounds, blocks)
        assert sum(parts) == blocks
        assert min(parts) >= 1
        assert max(parts) - min(parts) <= 1
        # the earlier stages take the remainder
        assert parts == sorted(parts, reverse=True)
        assert all(a < b for a, b in zip([0, *bounds], [*bounds, blocks]))


def test_uniform_examples():
    assert uniform(6, 2) == [3]
    assert uniform(5, 3) == [2, 4]
    assert uniform(7, 3) == [3, 5]


@pytest.mark.parametrize("blocks", [1, 2, 6, 10])
def test_uniform_one_stage_is_empty(blocks):
    assert uniform(blocks, 1) == []


@pytest.mark.parametrize("blocks", [1, 2, 6, 10])
def test_uniform_one_block_each(blocks):
    assert uniform(blocks, blocks) == list(range(1, blocks))
    assert sizes(uniform(blocks, blocks), blocks) == [1] * blocks


@pytest.mark.parametrize("blocks, stages", [(3, 4), (6, 7), (1, 2), (4, 0), (0, 1)])
def test_uniform_rejects_impossible_splits(blocks, stages):
    with pytest.raises(ValueError):
        uniform(blocks, stages)


# ---------------------------------------------------------------------------- balanced

positive_costs = st.one_of(
    st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=8),
    st.lists(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
             min_size=1, max_size=8),
)


@st.composite
def costs_and_stages(draw):
    costs = draw(positive_costs)
    stages = draw(st.integers(min_value=1, max_value=len(costs)))
    return costs, stages


@settings(max_examples=PARTITION_EXAMPLES, deadline=None)
@given(costs_and_stages())
def test_balanced_matches_brute_force(case):
    costs, stages = case
    bounds = balanced(costs, stages)
    n = len(costs)
    assert len(bounds) == stages - 1
    edges = [0, *bounds, n]
    assert all(a < b for a, b in zip(edges, edges[1:])), bounds  # strictly increasing, no empty
    assert min(sizes(bounds, n)) >= 1
    assert math.isclose(bottleneck(costs, bounds), brute_force(costs, stages),
                        rel_tol=1e-9, abs_tol=1e-12)
    assert balanced(list(costs), stages) == bounds  # deterministic
    assert balanced(tuple(costs), stages) == bounds


def test_balanced_examples():
    assert balanced([1, 1, 1, 1], 2) == [2]
    assert balanced([3, 1, 1, 1], 2) == [1]
    assert balanced([1, 1, 1, 10], 2) == [3]
    assert balanced([5], 1) == []
    assert balanced([1, 2, 3], 3) == [1, 2]


def test_balanced_ties_end_earliest():
    # [1 | 1 1] and [1 1 | 1] both have bottleneck 2: the earlier cut wins.
    assert balanced([1, 1, 1], 2) == [1]


@pytest.mark.parametrize("costs, stages", [([1, 2], 3), ([], 1), ([1, 2, 3], 0)])
def test_balanced_rejects_impossible_splits(costs, stages):
    with pytest.raises(ValueError):
        balanced(costs, stages)


# ---------------------------------------------------------------------------- stage_ranges, resolve


@pytest.mark.parametrize("blocks", range(1, 9))
def test_stage_ranges_round_trip(blocks):
    for stages in range(1, blocks + 1):
        for bounds in itertools.combinations(range(1, blocks), stages - 1):
            ranges = stage_ranges(list(bounds), blocks)
            assert len(ranges) == stages
            assert ranges[0][0] == 0 and ranges[-1][1] == blocks
            assert all(r1[1] == r2[0] for r1, r2 in zip(ranges, ranges[1:]))
            assert [start for start, _ in ranges[1:]] == list(bounds)


def test_stage_ranges_example():
    assert stage_ranges([2], 6) == [(0, 2), (2, 6)]
    assert stage_ranges([], 4) == [(0, 4)]
    assert stage_ranges([2, 4, 5], 6) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_resolve_uniform():
    assert resolve("uniform", 6, 2) == uniform(6, 2) == [3]
    assert resolve("uniform", 6, 4) == uniform(6, 4)


def test_resolve_params():
    counts = [1000, 10, 10, 10, 10, 1000]
    assert resolve("params", 6, 2, counts) == balanced(counts, 2)
    assert resolve("params", 6, 3, counts) == balanced(counts, 3)


def test_resolve_params_needs_counts():
    with pytest.raises(ValueError):
        resolve("params", 6, 2)


def test_resolve_explicit_list():
    assert resolve([3], 6, 2) == [3]
    assert resolve([2, 4, 5], 6, 4) == [2, 4, 5]
    assert resolve(("1", 3), 6, 3) == [1, 3]  # ints, whatever the list held


@pytest.mark.parametrize("blocks, stages", [(6, 7), (2, 3)])
def test_resolve_rejects_more_stages_than_blocks(blocks, stages):
    with pytest.raises(ValueError):
        resolve("uniform", blocks, stages)
    with pytest.raises(ValueError):
        resolve("params", blocks, stages, [1] * blocks)


# ---------------------------------------------------------------------------- heterogeneous devices


@st.composite
def device_block_costs(draw):
    """block_ms[p][s][i]: block i's time on the device of pipeline p's stage s."""
    blocks = draw(st.integers(min_value=1, max_value=7))
    stages = draw(st.integers(min_value=1, max_value=min(blocks, 4)))
    pipelines = draw(st.integers(min_value=1, max_value=3))
    base = draw(st.lists(st.floats(min_value=0.01, max_value=100, allow_nan=False),
                         min_size=blocks, max_size=blocks))
    speeds = draw(st.lists(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5]), min_size=stages,
                                    max_size=stages), min_size=pipelines, max_size=pipelines))
    return [[[b / v for b in base] for v in row] for row in speeds], blocks, stages


def brute_force_device(block_ms, blocks, stages):
    def worst(bounds):
        return max(max(sum(pipe[s][a:b]) for pipe in block_ms)
                   for s, (a, b) in enumerate(stage_ranges(list(bounds), blocks)))
    return min(worst(c) for c in itertools.combinations(range(1, blocks), stages - 1))


@settings(max_examples=PARTITION_EXAMPLES, deadline=None)
@given(device_block_costs())
def test_auto_partition_is_optimal_for_heterogeneous_devices(case):
    block_ms, blocks, stages = case
    cost = device_cost(block_ms)
    bounds = optimal(cost, blocks, stages)
    assert len(bounds) == stages - 1 and min(sizes(bounds, blocks)) >= 1  # never an empty stage
    best = brute_force_device(block_ms, blocks, stages)
    assert math.isclose(max(stage_times(bounds, cost, blocks)), best, rel_tol=1e-9, abs_tol=1e-12)
    p = plan(cost, blocks, stages)
    assert p.bounds == bounds and p.uniform_bounds == uniform(blocks, stages)
    assert max(p.times) <= max(p.uniform_times) + 1e-9 and p.speedup >= 1 - 1e-9


def test_a_slow_stage_gets_fewer_blocks():
    # 6 equal blocks; stage 1's devices run at half speed on every pipeline
    block_ms = [[[1.0] * 6, [2.0] * 6]] * 2
    p = plan(device_cost(block_ms), 6, 2)
    assert p.uniform_bounds == [3] and p.uniform_times == [3.0, 6.0]
    assert p.bounds == [4] and p.times == [4.0, 4.0] and p.speedup == 1.5


def test_the_slowest_replica_of_a_stage_decides():
    fast = [[1.0] * 4, [1.0] * 4]
    slow_stage0 = [[3.0] * 4, [1.0] * 4]
    cost = device_cost([fast, slow_stage0])
    assert cost(0, 0, 2) == 6.0 and cost(1, 0, 2) == 2.0
    assert optimal(cost, 4, 2) == [1]


def test_resolve_auto_needs_costs():
    with pytest.raises(ValueError, match="profile"):
        resolve("auto", 6, 2)
    assert resolve("auto", 4, 2, cost=device_cost([[[1.0] * 4, [3.0] * 4]])) == [3]


def _stage_sums(costs, speeds, bounds, stages):
    """Each stage's time: the sum of its pieces' (piece k on stage k mod stages)."""
    edges = [0, *bounds, len(costs)]
    out = [0.0] * stages
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        out[k % stages] += sum(costs[a:b]) / speeds[k % stages]
    return out


@settings(max_examples=PARTITION_EXAMPLES, deadline=None)
@given(st.integers(2, 3), st.integers(2, 3), st.data())
def test_interleaved_auto_balances_the_stages_sums_within_the_brute_force_s_reach(stages, chunks, data):
    """plan_chunks never does worse than either of its starts (the pieces balanced among
    themselves, the uniform pieces), reports each stage's sum of its pieces, and here lands
    within 1.5x of the best split found by brute force (a local search: not always at it; 1.21x
    at worst over 2,000 random cases)."""
    from sdpipe_cli.core.partition import plan_chunks

    pieces = stages * chunks
    costs = data.draw(st.lists(st.integers(1, 20), min_size=pieces, max_size=pieces + 4))
    speeds = data.draw(st.lists(st.sampled_from([1.0, 0.5, 0.25]), min_size=stages, max_size=stages))
    block_ms = [[[c / v for c in costs] for v in speeds]]
    got = plan_chunks(device_cost(block_ms), len(costs), stages, chunks)
    assert got.times == pytest.approx(_stage_sums(costs, speeds, got.bounds, stages))
    for start in (optimal(lambda k, a, b: device_cost(block_ms)(k % stages, a, b), len(costs), pieces),
                  uniform(len(costs), pieces)):
        assert max(got.times) <= max(_stage_sums(costs, speeds, start, stages)) + 1e-9
    best = min(max(_stage_sums(costs, speeds, list(cut), stages))
               for cut in itertools.combinations(range(1, len(costs)), pieces - 1))
    assert max(got.times) <= 1.5 * best + 1e-9


def test_interleaved_auto_moves_boundaries_off_the_balanced_pieces():
    """Seven blocks of 1 and one of 10 on two equal stages of two chunks: the balanced pieces
    [2, 4, 7] give stages of 5 and 12; moving the first boundary gives 6 and 11 (the best)."""
    from sdpipe_cli.core.partition import plan_chunks

    costs = [1] * 7 + [10]
    got = plan_chunks(device_cost([[costs, costs]]), 8, 2, 2)
    assert got.bounds == [3, 4, 7] and got.times == [6.0, 11.0]
    assert got.uniform_bounds == [2, 4, 6] and got.uniform_times == [4.0, 13.0]
