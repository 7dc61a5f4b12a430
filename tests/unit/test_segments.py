"""Segments: what replicas average when pipelines are split differently (core/segments.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st
from omegaconf import OmegaConf

from sdpipe_cli.core.partition import stage_ranges
from sdpipe_cli.core.segments import Segments, partitions_of


@st.composite
def layouts(draw):
    """Block count, then 1-4 pipelines' partitions into the same number of stages."""
    blocks = draw(st.integers(2, 24))
    stages = draw(st.integers(1, min(blocks, 6)))
    pipelines = draw(st.integers(1, 4))
    cuts = st.lists(st.integers(1, blocks - 1), min_size=stages - 1, max_size=stages - 1,
                    unique=True).map(sorted)
    return blocks, [draw(cuts) for _ in range(pipelines)]


@given(layouts())
def test_every_segment_lies_on_one_stage_of_each_pipeline(layout):
    blocks, partitions = layout
    seg = Segments.of(partitions)
    for p, bounds in enumerate(partitions):
        ranges = stage_ranges(bounds, blocks)
        for k in range(seg.count):
            lo, hi = seg.start(k), seg.stop(k) or blocks
            s = seg.holder(p, k)
            assert ranges[s][0] <= lo < hi <= ranges[s][1]
            # and as a slice of that stage's blocks
            a, b = seg.local(p, k)
            stage_blocks = list(range(*ranges[s]))
            assert stage_blocks[a:b] == list(range(lo, hi))


@given(layouts())
def test_a_stages_segments_are_its_blocks_in_order(layout):
    blocks, partitions = layout
    seg = Segments.of(partitions)
    for p, bounds in enumerate(partitions):
        for s, (lo, hi) in enumerate(stage_ranges(bounds, blocks)):
            held = seg.held(p, s)
            assert held == list(range(held[0], held[-1] + 1))  # consecutive, at least one
            covered = [b for k in held for b in range(seg.start(k), seg.stop(k) or blocks)]
            assert covered == list(range(lo, hi))


@given(layouts())
def test_one_partition_for_all_makes_the_stages_the_segments(layout):
    _, partitions = layout
    seg = Segments.of([partitions[0]] * len(partitions))
    assert seg.uniform and seg.count == len(partitions[0]) + 1
    assert all(seg.held(p, s) == [s] and seg.local(p, s) == (0, None)
               for p in range(len(partitions)) for s in range(seg.count))


def test_a_pipeline_split_its_own_way():
    seg = Segments.of([(4, 8, 12), (5, 8, 12)])
    assert seg.cuts == (4, 5, 8, 12) and not seg.uniform
    assert seg.held(0, 0) == [0] and seg.held(0, 1) == [1, 2]
    assert seg.held(1, 0) == [0, 1] and seg.held(1, 1) == [2]
    assert seg.local(1, 0) == (0, 4) and seg.local(1, 1) == (4, None)
    assert seg.local(0, 1) == (0, 1) and seg.local(0, 2) == (1, None)


def test_partitions_must_have_as_many_stages():
    with pytest.raises(ValueError):
        Segments.of([(4,), (4, 8)])


def test_partitions_of_a_section():
    section = OmegaConf.create({"partition": [4, 8], "partitions": {1: [3, 8]}})
    assert partitions_of(section, 3) == ((4, 8), (3, 8), (4, 8))
    assert partitions_of(OmegaConf.create({"partition": [2]}), 2) == ((2,), (2,))


@given(layouts(), st.data())
def test_segments_per_block_stay_the_units_when_a_pipeline_is_split_anew(layout, data):
    """With ``grain`` (the block count) every block is a segment, whatever the splits: a pipeline
    re-split mid-run holds whole segments, so every replica keeps its units and their rounds."""
    blocks, partitions = layout
    seg = Segments.of(partitions, blocks)
    assert seg.count == blocks and [seg.start(k) for k in range(blocks)] == list(range(blocks))
    p = data.draw(st.integers(0, len(partitions) - 1))
    bounds = sorted(data.draw(st.lists(st.integers(1, blocks - 1), min_size=len(partitions[0]),
                                       max_size=len(partitions[0]), unique=True)))
    after = seg.resplit(p, bounds)
    assert after.cuts == seg.cuts and after.partitions[p] == tuple(bounds)
    ranges = stage_ranges(bounds, blocks)
    for k in range(blocks):  # each block on the stage of the new split that holds it
        assert ranges[after.holder(p, k)][0] <= k < ranges[after.holder(p, k)][1]
        for q in range(len(partitions)):
            if q != p:
                assert after.holder(q, k) == seg.holder(q, k)
    # the units are the stages only where every stage is one block and all pipelines agree
    assert seg.uniform == (len(set(seg.partitions)) == 1 and len(partitions[0]) == blocks - 1)


@st.composite
def interleaved_layouts(draw):
    """Block count, stages, then 1-4 pipelines' partitions into ``v x S`` pieces each."""
    stages, chunks = draw(st.integers(2, 4)), draw(st.integers(2, 3))
    blocks = draw(st.integers(stages * chunks, 20))
    pipelines = draw(st.integers(1, 4))
    cuts = st.lists(st.integers(1, blocks - 1), min_size=stages * chunks - 1,
                    max_size=stages * chunks - 1, unique=True).map(sorted)
    return blocks, stages, [draw(cuts) for _ in range(pipelines)], draw(st.booleans())


@given(interleaved_layouts())
def test_interleaved_stages_hold_their_segments_in_their_module_s_order(layout):
    """A stage of several chunks holds its blocks chunk after chunk (the worker's module): its
    segments, in order, are slices of that list that tile it, each the segment's blocks."""
    from sdpipe_cli.core.interleaved import stage_blocks

    blocks, stages, partitions, per_block = layout
    seg = Segments.of(partitions, blocks if per_block else 0, stages)
    assert not seg.uniform
    for p, bounds in enumerate(partitions):
        for s, chunks in enumerate(stage_blocks(bounds, blocks, stages)):
            module = [b for lo, hi in chunks for b in range(lo, hi)]
            covered = []
            for k in seg.held(p, s):
                a, b = seg.local(p, k)
                assert module[a:b] == list(range(seg.start(k), seg.stop(k) or blocks))
                covered += module[a:b]
            assert covered == module


def test_one_split_of_interleaved_stages_is_not_the_stages():
    """Pieces 0 and 2 lie on stage 0: four segments, two a stage, in the module's order."""
    seg = Segments.of([[2, 4, 5]] * 2, stages=2)
    assert seg.count == 4 and not seg.uniform
    assert seg.held(0, 0) == [0, 2] and seg.held(1, 1) == [1, 3]
    assert [seg.local(0, k) for k in (0, 2)] == [(0, 2), (2, None)]
    assert [seg.local(0, k) for k in (1, 3)] == [(0, 2), (2, None)]
    assert Segments.of([[2, 4, 5]] * 2, stages=4) == Segments.of([[2, 4, 5]] * 2)  # one chunk
    with pytest.raises(ValueError, match="4 pieces do not make 3 stages"):
        Segments.of([[2, 4, 5]], stages=3)
