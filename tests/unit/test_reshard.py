"""Resharding's decisions (:mod:`sdpipe_cli.core.reshard_plan`): which old stage each new stage's
blocks come from, the iterations and budget of the new layout, and where its data streams start
(no sample read twice in an epoch; none skipped when the old pipelines stood together)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.reshard_plan import Layout, data_position, pieces, plan
from sdpipe_cli.data.sampling import Order


@st.composite
def layouts(draw, blocks=None):
    """A layout, interleaved (several chunks a stage) or not."""
    blocks = blocks or draw(st.integers(1, 12))
    stages = draw(st.integers(1, blocks))
    chunks = draw(st.integers(1, blocks // stages)) if stages > 1 else 1
    pieces = stages * chunks
    cuts = sorted(draw(st.sets(st.integers(1, blocks - 1), min_size=pieces - 1,
                               max_size=pieces - 1))) if pieces > 1 else []
    return Layout(draw(st.integers(1, 8)), tuple(cuts), blocks, chunks=chunks)


@given(st.data())
def test_every_block_of_a_new_stage_comes_from_the_old_stage_that_held_it(data):
    old = data.draw(layouts())
    new = data.draw(layouts(blocks=old.blocks))
    got = pieces(old, new)
    assert len(got) == new.stages
    for held, runs in zip(new.held(), got):
        blocks = [b for _, a, z in runs for b in range(a, z)]
        assert blocks == held  # each block once, in the new stage's order
        for s, a, z in runs:
            assert set(range(a, z)) <= set(old.held()[s])


def test_interleaved_stages_hold_their_chunks_blocks_in_chunk_order():
    # 6 blocks in 4 pieces [0,1 | 2,3 | 4 | 5] on 2 stages: stage 0 holds pieces 0 and 2
    chunked = Layout(2, (2, 4, 5), 6, chunks=2)
    assert chunked.stages == 2 and chunked.held() == [[0, 1, 4], [2, 3, 5]]
    assert pieces(Layout(2, (3,), 6), chunked) == [[(0, 0, 2), (1, 4, 5)], [(0, 2, 3), (1, 3, 4), (1, 5, 6)]]
    assert "S=2 of 2 chunks" in chunked.describe()


def test_pipelines_split_their_own_way_take_their_blocks_from_their_own_stages():
    # pipeline 1 split at [1] before, at [5] after; the others at [3] throughout
    old, new = Layout(2, (3,), 6, ((1, (1,)),)), Layout(2, (3,), 6, ((1, (5,)),))
    assert old.held(1) == [[0], [1, 2, 3, 4, 5]] and new.held(0) == [[0, 1, 2], [3, 4, 5]]
    assert pieces(old, new, 1, 1) == [[(0, 0, 1), (1, 1, 5)], [(1, 5, 6)]]
    assert pieces(old, new, 0, 0) == [[(0, 0, 3)], [(1, 3, 6)]]
    assert pieces(old, new, 1, 0) == [[(0, 0, 1), (1, 1, 3)], [(1, 3, 6)]]
    assert "pipeline 1: [5]" in new.describe()


def test_pieces_of_a_known_split():
    # 6 blocks: [0,1,2 | 3,4,5] -> [0,1 | 2,3 | 4,5]
    assert pieces(Layout(4, (3,), 6), Layout(3, (2, 4), 6)) == [
        [(0, 0, 2)], [(0, 2, 3), (1, 3, 4)], [(1, 4, 6)]]


@settings(max_examples=300)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=8), st.integers(1, 9),
       st.booleans(), st.integers(1, 600))
def test_the_budget_and_the_iterations_done_are_kept(steps, new_p, even, train_steps):
    old = dict(enumerate(steps))
    train_steps = max(train_steps, max(steps))
    got = plan(old, train_steps, 8, new_p, even=even)
    assert sorted(got.steps) == list(range(new_p))
    assert sorted(got.sources) == list(range(new_p))
    assert all(0 <= p < len(steps) for p in got.sources.values())
    if even:
        assert len(set(got.steps.values())) == 1
    else:  # sdpipe: shared out exactly, at most one apart
        assert sum(got.steps.values()) == sum(steps)
        assert max(got.steps.values()) - min(got.steps.values()) <= 1
    exact = len(steps) * train_steps % new_p == 0 and (not even or sum(steps) % new_p == 0)
    if exact:
        assert got.changed == 0
        assert got.budget[0] == got.budget[1] and got.done[0] == got.done[1]
    # the learning rate's place (a fraction of the budget) moves by less than one iteration
    assert abs(got.done[1] / got.budget[1] - got.done[0] / got.budget[0]) <= 1 / got.train_steps


def test_four_pipelines_to_three_and_to_six_at_a_lockstep_checkpoint():
    old = {p: 150 for p in range(4)}
    three = plan(old, 300, 8, 3, even=True)
    assert three.steps == {0: 200, 1: 200, 2: 200} and three.train_steps == 400
    assert three.changed == 0 and three.sources == {0: 0, 1: 1, 2: 2}
    six = plan(old, 300, 8, 6, even=True)
    assert six.steps == {q: 100 for q in range(6)} and six.train_steps == 200
    assert six.sources == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1}


def test_the_users_train_steps_is_the_new_layouts_own():
    got = plan({0: 10, 1: 10}, 20, 4, 4, even=True, new_train_steps=50)
    assert got.train_steps == 50 and got.budget == (160, 800)


def test_the_same_number_of_pipelines_keeps_every_stream():
    got = plan({0: 10, 1: 12}, 20, 4, 2, even=False, positions={0: 40, 1: 48}, samples=1000)
    assert got.positions == {0: 40, 1: 48}


def consumed(n, pipelines, positions, seed=0):
    """Per epoch, the samples the pipelines read (every epoch up to their positions)."""
    read: dict[int, list[int]] = {}
    for p, k in positions.items():
        order = Order(n, p, pipelines, seed)
        for position in range(k):
            read.setdefault(order.epoch_of(position), []).append(order.index(position))
    return read


@settings(max_examples=200, deadline=None)
@given(st.integers(8, 120), st.integers(1, 6), st.integers(1, 6), st.data())
def test_new_streams_read_nothing_twice_in_an_epoch(n, old_p, new_p, data):
    old_p, new_p = min(old_p, n), min(new_p, n)
    shard = n // old_p
    positions = {p: data.draw(st.integers(0, 3 * shard)) for p in range(old_p)}
    start = data_position(positions, old_p, new_p, n)
    before = consumed(n, old_p, positions)
    new_shard = n // new_p
    epoch = start // new_shard
    ahead = max(k // shard for k in positions.values())
    assert epoch in (ahead, ahead + 1)  # the latest epoch, or the next one once it is used up
    old_reads = before.get(epoch, [])
    later = [Order(n, q, new_p, 0).index(k) for q in range(new_p)
             for k in range(start, (epoch + 1) * new_shard)]
    assert not set(old_reads) & set(later)
    assert len(set(later)) == len(later)


@given(st.integers(8, 200), st.integers(1, 6), st.integers(1, 6), st.integers(0, 400))
def test_lockstep_streams_skip_nothing_when_the_counts_divide(n, old_p, new_p, k):
    old_p, new_p = min(old_p, n), min(new_p, n)
    k %= n // old_p  # within the first epoch
    if (old_p * k) % new_p:
        return
    start = data_position({p: k for p in range(old_p)}, old_p, new_p, n)
    if old_p * k // new_p < n // new_p:
        assert start == old_p * k // new_p  # exactly the samples read, shared anew


def test_a_bad_plan_request_is_refused():
    with pytest.raises(ValueError):
        plan({}, 10, 4, 2, even=True)
    with pytest.raises(ValueError):
        plan({0: 1}, 10, 4, 2, even=True, positions={0: 4})  # positions need the set's size
    with pytest.raises(ValueError):
        pieces(Layout(2, (1,), 4), Layout(2, (1,), 5))
