"""Interleaved 1F1B as pure action lists (sdpipe_cli/core/interleaved.py): every action once and
in order, no deadlock, neighbours that post their messages in the same order on every channel,
activations within the bound, and fewer idle ticks than 1F1B's."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.interleaved import (
    channel_of,
    forward_order,
    interleaved_1f1b,
    interleaved_zero_bubble,
    messages,
    schedule_of,
    stage_blocks,
    virtual_stage,
)
from sdpipe_cli.core.partition import uniform
from sdpipe_cli.core.schedule import Action, Kind, gpipe, in_flight, one_f_one_b, tick_order

layouts = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4)).map(
    lambda t: (t[0], t[1], t[0] * t[2]))  # stages, chunks, micro-batches (groups of the stages)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_every_chunk_runs_each_micro_batch_forward_then_backward_in_order(layout):
    stages, chunks, m = layout
    for s in range(stages):
        actions = interleaved_1f1b(chunks)(stages, m, s)
        assert len(actions) == len(set(actions)) == 2 * m * chunks
        for c in range(chunks):  # a chunk is a stage of a pipeline of its own: its order is 1F1B's
            forwards = [a.microbatch for a in actions if a.chunk == c and a.kind is Kind.F]
            backwards = [a.microbatch for a in actions if a.chunk == c and a.kind is Kind.B]
            assert forwards == backwards == list(range(m))
        done = set()
        for a in actions:
            assert a.kind is Kind.F or Action(Kind.F, a.microbatch, a.chunk) in done, (s, a)
            done.add(a)


@settings(max_examples=60, deadline=None)
@given(layouts, st.sampled_from([{}, {Kind.B: 2}, {Kind.F: 2, Kind.B: 3}]))
def test_no_deadlock_and_fewer_idle_ticks_than_1f1b(layout, ticks):
    """On a clock where a chunk's action takes its ticks (1F1B's, a whole stage's, ``chunks``
    times as many), the iteration ends, no later than 1F1B's, and each stage is idle
    ``(S - 1) (F + B)`` ticks: 1F1B's idle time over ``chunks``."""
    stages, chunks, m = layout
    rows = tick_order(interleaved_1f1b(chunks), stages, m, ticks, chunks)
    f, b = ticks.get(Kind.F, 1), ticks.get(Kind.B, 1)
    assert len(rows[0]) == m * chunks * (f + b) + (stages - 1) * (f + b)
    whole = {Kind.F: f * chunks, Kind.B: b * chunks}
    assert len(rows[0]) <= len(tick_order(one_f_one_b, stages, m, whole)[0])


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_both_ends_of_every_channel_post_its_messages_in_the_same_order(layout):
    """Messages are matched by order on a channel (NCCL ignores tags): the sender's order of
    each channel's messages is the receiver's, for activations, gradients and the wrap."""
    stages, chunks, m = layout
    sent, received = collections.defaultdict(list), collections.defaultdict(list)
    for s in range(stages):
        out, into = messages(interleaved_1f1b(chunks)(stages, m, s), s, stages, chunks)
        for channel, what in out:
            assert channel.src == s
            sent[channel].append(what)
        for channel, what in into:
            assert channel.dst == s
            received[channel].append(what)
    assert sent == received
    assert all(not c.wrap or (c.src, c.dst) in ((stages - 1, 0), (0, stages - 1)) for c in sent)
    assert sum(len(v) for v in sent.values()) == 2 * m * (stages * chunks - 1)


def test_two_stages_keep_activations_and_gradients_apart_on_the_wrap():
    """With two stages, stage 0 sends stage 1 activations (chunk c to c) and gradients (chunk
    c + 1 back to c): on one channel their orders at the two ends would differ."""
    assert channel_of(virtual_stage(0, 0, 2), 2, gradient=False) == (0, 1, False)
    assert channel_of(virtual_stage(1, 0, 2), 2, gradient=True) == (0, 1, True)
    sent, received = messages(interleaved_1f1b(2)(2, 4, 0), 0, 2, 2)
    kinds = {wrap: {a.kind for c, a in sent if c.dst == 1 and c.wrap == wrap} for wrap in (0, 1)}
    assert kinds == {False: {Kind.F}, True: {Kind.B}}


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_a_stage_holds_at_most_1f1b_s_first_stage_worth_of_activations(layout):
    stages, chunks, m = layout
    for s in range(stages):
        held = in_flight(interleaved_1f1b(chunks)(stages, m, s))
        assert held <= min(stages - s + (chunks - 1) * stages, m * chunks)
        assert held <= stages * chunks  # chunks hold 1 / chunks of a stage: 1F1B's S at most


@pytest.mark.parametrize("stages,m", [(1, 3), (2, 4), (4, 8), (3, 9)])
def test_one_chunk_is_1f1b(stages, m):
    for s in range(stages):
        assert interleaved_1f1b(1)(stages, m, s) == one_f_one_b(stages, m, s)


def test_micro_batches_come_in_groups_of_the_stages():
    with pytest.raises(ValueError, match="6 is not a multiple of 4"):
        interleaved_1f1b(2)(4, 6, 0)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        interleaved_1f1b(0)(4, 8, 0)


def test_an_action_prints_its_chunk():
    assert str(Action(Kind.F, 3, 1)) == "F3.1" and str(Action(Kind.B, 2)) == "B2"
    assert Action("F", 0) == Action(Kind.F, 0, 0)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 6), st.randoms(use_true_random=False))
def test_each_block_lies_on_the_stage_of_its_virtual_stage(stages, chunks, extra, rng):
    """A partition of ``v S`` pieces: stage s holds pieces s, s + S, ... in chunk order, and
    together the stages hold every block exactly once."""
    blocks = stages * chunks + extra
    bounds = sorted(rng.sample(range(1, blocks), stages * chunks - 1))
    held = stage_blocks(bounds, blocks, stages)
    assert len(held) == stages and all(len(ranges) == chunks for ranges in held)
    edges = [0, *bounds, blocks]
    for s, ranges in enumerate(held):
        for c, (lo, hi) in enumerate(ranges):
            k = virtual_stage(s, c, stages)
            assert (lo, hi) == (edges[k], edges[k + 1])
    every = sorted(b for ranges in held for lo, hi in ranges for b in range(lo, hi))
    assert every == list(range(blocks))


def test_one_chunk_a_stage_is_the_partition_itself():
    assert stage_blocks([2, 5], 8, 3) == [[(0, 2)], [(2, 5)], [(5, 8)]]
    assert stage_blocks(uniform(8, 4), 8, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    with pytest.raises(ValueError, match="3 pieces of the model do not make 2 stages"):
        stage_blocks([1, 2], 4, 2)


def test_a_schedule_by_name_and_chunks():
    assert schedule_of("interleaved_1f1b", 1)(3, 6, 1) == one_f_one_b(3, 6, 1)
    assert schedule_of("gpipe")(2, 4, 0) == gpipe(2, 4, 0)
    assert {a.chunk for a in schedule_of("interleaved_1f1b", 3)(2, 4, 1)} == {0, 1, 2}
    with pytest.raises(ValueError, match="runs one chunk a stage, not 2"):
        schedule_of("1f1b", 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 20))
def test_an_evaluation_s_forwards_each_wait_only_for_one_before_them(stages, chunks, m):
    """Every (micro-batch, chunk) once; each one's input (the same micro-batch on the virtual
    stage before) comes earlier in the order all stages share, so posting the sends and waiting
    on them at the end cannot deadlock; with ``m`` a multiple of ``S``, training's order."""
    order = forward_order(m, stages, chunks)
    assert sorted(order) == [(i, c) for i in range(m) for c in range(chunks)]
    place = {item: k for k, item in enumerate(order)}
    for i, c in order:
        assert c == 0 or place[(i, c - 1)] < place[(i, c)]
    if m % stages == 0:
        forwards = [a for a in interleaved_1f1b(chunks)(stages, m, 0) if a.kind is Kind.F]
        assert order == [(a.microbatch, a.chunk) for a in forwards]


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_with_a_group_for_each_direction_a_pair_of_processes_sends_one_way_in_each(layout):
    """What NCCL needs of an interleaved stage (``pipeline/p2p.py``, ``Directed``): on NCCL a
    pair of processes in one group shares one stream for both directions. The worker puts
    activations and gradients in groups of their own, and with two stages the wrap's in two
    more: then every message of a group between two processes goes the same way, under both
    interleaved schedules (one group for both directions would carry both ways)."""
    stages, chunks, m = layout
    ways = collections.defaultdict(set)
    for s in range(stages):
        for schedule in (interleaved_1f1b, interleaved_zero_bubble):
            sent, _ = messages(schedule(chunks)(stages, m, s), s, stages, chunks)
            for channel, what in sent:
                group = (channel.wrap and stages == 2, what.kind is Kind.B)
                ways[(group, frozenset((channel.src, channel.dst)))].add((channel.src, channel.dst))
    assert all(len(directions) == 1 for directions in ways.values()), dict(ways)
