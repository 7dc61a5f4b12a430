"""Interleaved zero bubble as pure action lists (sdpipe_cli/core/interleaved.py): each chunk's
F, B and W once and in order, the same messages as interleaved 1F1B in the same order, no
deadlock whatever the actions' times, ``v S`` micro-batch chunks held at most, and the iteration
in its ``3 v m + S - 1`` ticks."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.interleaved import (
    interleaved_1f1b,
    interleaved_zero_bubble,
    messages,
    schedule_of,
    zero_bubble_lists,
)
from sdpipe_cli.core.iteration_plan import IterationPlan
from sdpipe_cli.core.schedule import SPLIT_SCHEDULES, Action, Kind, in_flight, one_f_one_b, tick_order, zero_bubble_h1

layouts = st.tuples(st.integers(2, 6), st.integers(2, 4), st.integers(1, 4)).map(
    lambda t: (t[0], t[1], t[0] * t[2]))  # stages, chunks, micro-batches (groups of the stages)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_every_chunk_runs_f_then_b_then_w_of_each_micro_batch_in_order(layout):
    stages, chunks, m = layout
    for s in range(stages):
        actions = interleaved_zero_bubble(chunks)(stages, m, s)
        assert len(actions) == len(set(actions)) == 3 * m * chunks
        for c in range(chunks):
            for kind in (Kind.F, Kind.B):  # what neighbours exchange: in micro-batch order
                assert [a.microbatch for a in actions if a.chunk == c and a.kind is kind] == list(range(m))
        done = set()
        for a in actions:
            before = {Kind.B: Kind.F, Kind.W: Kind.B}.get(a.kind)
            assert before is None or Action(before, a.microbatch, a.chunk) in done, (s, a)
            done.add(a)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_neighbours_post_interleaved_1f1b_s_messages_in_its_order(layout):
    """Its F and B keep interleaved 1F1B's order on every stage, so every channel carries the
    same messages in the same order at both ends (``W`` sends nothing)."""
    stages, chunks, m = layout
    sent, received = collections.defaultdict(list), collections.defaultdict(list)
    for s in range(stages):
        ours = interleaved_zero_bubble(chunks)(stages, m, s)
        theirs = interleaved_1f1b(chunks)(stages, m, s)
        assert [a for a in ours if a.kind is Kind.F] == [a for a in theirs if a.kind is Kind.F]
        assert [a for a in ours if a.kind is Kind.B] == [a for a in theirs if a.kind is Kind.B]
        out, into = messages(ours, s, stages, chunks)
        for channel, what in out:
            sent[channel].append(what)
        for channel, what in into:
            received[channel].append(what)
    assert sent == received


@settings(max_examples=60, deadline=None)
@given(layouts, st.sampled_from([{}, {Kind.W: 2}, {Kind.F: 2, Kind.B: 3, Kind.W: 1}, {Kind.B: 4}]))
def test_no_deadlock_whatever_the_actions_take_and_no_more_than_v_s_held(layout, ticks):
    """The lists are placed on a clock of one tick an action; run on another clock they still
    end (each action was placed after what it waits for), and a stage holds what at most
    ``v S`` micro-batch chunks saved (interleaved 1F1B's first stage: 1F1B's ``S`` stages'
    worth)."""
    stages, chunks, m = layout
    tick_order(interleaved_zero_bubble(chunks), stages, m, ticks, chunks)
    for s in range(stages):
        assert in_flight(interleaved_zero_bubble(chunks)(stages, m, s)) <= stages * chunks


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_every_stage_idles_s_minus_one_ticks_fewer_than_interleaved_1f1b(layout):
    """With F, B and W a tick each, the iteration is its work and the first forward's way to
    the last virtual stage and back: ``3 v m + S - 1`` ticks; interleaved 1F1B, whose backward
    is B and W together, takes ``3 v m + 3 (S - 1)``, and 1F1B ``3 v m + 3 v (S - 1)``."""
    stages, chunks, m = layout
    ours = len(tick_order(interleaved_zero_bubble(chunks), stages, m, None, chunks)[0])
    assert ours == 3 * chunks * m + stages - 1
    theirs = len(tick_order(interleaved_1f1b(chunks), stages, m, {Kind.B: 2}, chunks)[0])
    assert theirs == 3 * chunks * m + 3 * (stages - 1)
    whole = len(tick_order(one_f_one_b, stages, m, {Kind.F: chunks, Kind.B: 2 * chunks})[0])
    assert whole == 3 * chunks * (m + stages - 1)


def test_the_four_stage_two_chunk_timeline():
    rows = zero_bubble_lists(4, 8, 2)
    assert " ".join(map(str, rows[0][:14])) == "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B0.1 W0.1 B1.1 F4 B2.1 W1.1"
    assert " ".join(map(str, rows[3][-12:])) == "B4 B5 B6 B7 W4.1 W5.1 W6.1 W7.1 W4 W5 W6 W7"


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 8), (3, 9)])
def test_one_chunk_is_zb_h1_and_a_split_schedule(stages, m):
    for s in range(stages):
        assert schedule_of("interleaved_zb", 1)(stages, m, s) == zero_bubble_h1(stages, m, s)
    assert {"zb_h1", "interleaved_zb"} <= set(SPLIT_SCHEDULES)
    assert {a.chunk for a in schedule_of("interleaved_zb", 2)(2, 4, 1)} == {0, 1}


def test_micro_batches_come_in_groups_of_the_stages():
    with pytest.raises(ValueError, match="6 is not a multiple of 4"):
        interleaved_zero_bubble(2)(4, 6, 0)


def test_the_simulator_times_an_iteration_on_the_schedule_s_own_timeline():
    """A chunk's forward 1 / v of a stage's, its backward 2 / v, split into B and W halves:
    interleaved zero bubble's 51 ticks of a third of a chunk's work (S = 4, v = 2, m = 8),
    against ZB-H1's 27 stage-thirds, interleaved 1F1B's 28.5 and 1F1B's 33."""
    def cost(chunks):
        return lambda stage, backward, chunk: (2.0 if backward else 1.0) / chunks

    spans = {name: IterationPlan(name, 4, 8, v).makespan(cost(v))
             for name, v in (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2))}
    assert spans == {"1f1b": 33.0, "zb_h1": 27.0, "interleaved_1f1b": 28.5, "interleaved_zb": 25.5}
