"""Schedules as text: literal per-stage action orders, invariants, and the simulated timeline."""

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.schedule import (
    ASYNC_SCHEDULES,
    SCHEDULES,
    Action,
    Kind,
    async_next,
    async_one_f_one_b,
    flushed,
    format_actions,
    get_schedule,
    gpipe,
    in_flight,
    one_f_one_b,
    stash_versions,
    tick_order,
    timeline,
    zero_bubble_h1,
)

ONE_F_ONE_B_4x8 = [
    "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
]


@pytest.mark.parametrize("stage", range(4))
def test_1f1b_four_stages_eight_microbatches(stage):
    assert format_actions(one_f_one_b(4, 8, stage)) == ONE_F_ONE_B_4x8[stage]


@pytest.mark.parametrize("stage", range(3))
def test_gpipe_is_all_forwards_then_all_backwards(stage):
    assert format_actions(gpipe(3, 4, stage)) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_1f1b_fewer_microbatches_than_stages():
    # Warm-up is capped at m: the first stages become GPipe.
    assert [format_actions(one_f_one_b(4, 2, s)) for s in range(4)] == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_single_stage_and_single_microbatch():
    assert format_actions(one_f_one_b(1, 3, 0)) == "F0 B0 F1 B1 F2 B2"
    assert format_actions(gpipe(1, 3, 0)) == "F0 F1 F2 B0 B1 B2"
    assert [format_actions(one_f_one_b(3, 1, s)) for s in range(3)] == ["F0 B0"] * 3


def test_action_str_and_fields():
    a = Action("B", 3)
    assert str(a) == "B3" and a.kind == "B" and a.microbatch == 3
    assert format_actions([]) == ""


def test_action_kind_is_an_enum_that_prints_its_letter():
    a = Action(Kind.F, 0)
    assert a.kind is Kind.F and str(a) == "F0" and f"{a.kind}" == "F"
    # The letter is another spelling of the same action: equal, same hash, converted to Kind.
    assert Action("F", 0) == a and hash(Action("F", 0)) == hash(a)
    assert Action("B", 2).kind is Kind.B and isinstance(Action("B", 2).kind, Kind)
    assert {a: 1}[Action("F", 0)] == 1
    assert all(isinstance(x.kind, Kind) for x in one_f_one_b(3, 4, 1) + async_one_f_one_b(3, 6, 0))
    assert [k.value for k in Kind] == ["F", "B", "W"]


@pytest.mark.parametrize("kind", ["X", "C", "f", "", None])
def test_unknown_action_kind_fails_where_made(kind):
    with pytest.raises(ValueError):
        Action(kind, 0)


def test_action_survives_pickling_and_replace():
    import pickle

    a = Action(Kind.B, 7)
    for b in (pickle.loads(pickle.dumps(a)), a._replace(microbatch=7)):
        assert b == a and type(b) is Action and b.kind is Kind.B and str(b) == "B7"


def test_get_schedule():
    assert get_schedule("1f1b") is one_f_one_b
    assert get_schedule("gpipe") is gpipe
    with pytest.raises(ValueError, match="1f1b, gpipe"):
        get_schedule("interleaved")


@pytest.mark.parametrize("fn", [one_f_one_b, gpipe])
@pytest.mark.parametrize("args", [(0, 1, 0), (2, 1, 2), (2, 1, -1), (2, 0, 0)])
def test_validation(fn, args):
    with pytest.raises(ValueError):
        fn(*args)


@pytest.mark.parametrize("args", [(0, 1), (2, 0)])
def test_simulate_validation(args):
    with pytest.raises(ValueError):
        tick_order(one_f_one_b, *args)


def test_timeline_table():
    assert timeline(one_f_one_b, 2, 3) == "\n".join(
        [
            "stage 0: F0 F1 .  B0 F2 B1 .  B2",
            "stage 1: .  F0 B0 F1 B1 F2 B2 .",
        ]
    )
    assert timeline(gpipe, 2, 2) == "\n".join(
        [
            "stage 0: F0 F1 .  .  B0 B1",
            "stage 1: .  F0 F1 B0 B1 .",
        ]
    )


def test_simulate_detects_deadlock():
    def broken(stages, m, stage):  # stage 0 waits for B0 before F1, which stage 1 needs first
        return one_f_one_b(1, m, 0) if stage == 0 else gpipe(stages, m, stage)

    with pytest.raises(ValueError, match="deadlock"):
        tick_order(broken, 2, 2)


shapes = st.integers(1, 6).flatmap(
    lambda S: st.tuples(st.just(S), st.integers(1, 12), st.integers(0, S - 1))
)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(sorted(SCHEDULES)))
def test_every_microbatch_once_forward_before_backward(shape, name):
    S, m, s = shape
    actions = get_schedule(name)(S, m, s)
    assert sorted(a for a in actions if a.kind == "F") == [Action("F", i) for i in range(m)]
    assert [a for a in actions if a.kind == "B"] == [Action("B", i) for i in range(m)]
    assert [a for a in actions if a.kind == "F"] == [Action("F", i) for i in range(m)]
    for i in range(m):
        assert actions.index(Action("F", i)) < actions.index(Action("B", i))


def _max_in_flight(actions):
    in_flight = peak = 0
    for a in actions:
        in_flight += 1 if a.kind == "F" else -1
        peak = max(peak, in_flight)
    return peak


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_in_flight_bound(shape):
    S, m, s = shape
    assert _max_in_flight(one_f_one_b(S, m, s)) == min(S - s, m)
    assert _max_in_flight(gpipe(S, m, s)) == m


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12))
def test_flushed_schedules_have_the_same_bubble(S, m):
    ticks = {name: len(tick_order(fn, S, m)[0]) for name, fn in SCHEDULES.items()}
    assert ticks["1f1b"] == ticks["gpipe"] == 2 * (m + S - 1)
    # Every row of the table is one stage's actions in its own order, idles removed.
    for fn in SCHEDULES.values():
        for s, row in enumerate(tick_order(fn, S, m)):
            assert [a for a in row if a is not None] == fn(S, m, s)


# -- asynchronous 1F1B (PipeDream) ---------------------------------------------------------------

# A segment of 6 micro-batches: warm-up (S - s - 1 forwards), one forward and one backward, drain.
ASYNC_SEGMENTS = {
    2: ["F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
    3: ["F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
    4: ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
}


@pytest.mark.parametrize("stages", sorted(ASYNC_SEGMENTS))
def test_async_1f1b_segment_order(stages):
    for stage, expected in enumerate(ASYNC_SEGMENTS[stages]):
        assert format_actions(async_one_f_one_b(stages, 6, stage)) == expected


def test_async_weight_versions_and_staleness():
    """Version v = the weights after v updates: F(i) uses the number of backwards before it."""
    actions = async_one_f_one_b(4, 6, 0)  # F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
    assert stash_versions(actions) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 2}
    assert stash_versions(async_one_f_one_b(4, 6, 3)) == {i: i for i in range(6)}
    assert stash_versions(async_one_f_one_b(2, 4, 0)) == {0: 0, 1: 0, 2: 1, 3: 2}


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_async_stream_without_a_known_end(shape):
    """async_next with the end unknown gives the same prefix as the segment, never drains, and
    keeps at most S - s micro-batches (so at most S - s weight versions) in flight."""
    S, m, s = shape
    segment = async_one_f_one_b(S, m, s)
    forwarded = backwarded = 0
    stream = []
    for _ in range(4 * m + 2 * S):
        action = async_next(S, s, forwarded, backwarded, None)
        assert action is not None and forwarded - backwarded <= S - s
        stream.append(action)
        forwarded += action.kind == "F"
        backwarded += action.kind == "B"
    assert _max_in_flight(stream) == S - s
    # Before the segment's last forward, the stream and the segment agree.
    last_f = max(i for i, a in enumerate(segment) if a.kind == "F")
    assert stream[: last_f + 1] == segment[: last_f + 1]
    versions = stash_versions(segment)
    for i in range(m):
        # Staleness: the updates between F(i) and B(i), i.e. the version B(i) applies its gradient
        # to minus the one F(i) used: i - version; S - s - 1 once the warm-up is over.
        updates_before_b = sum(a.kind == "B" for a in segment[: segment.index(Action("B", i))])
        assert updates_before_b - versions[i] == min(i, S - s - 1)
    # The forwards of the warm-up share version 0; every later forward has its own.
    assert len(set(versions.values())) == len(versions) - min(S - s - 1, m - 1)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_async_segment_is_1f1b_order(shape):
    """Within a segment the order is PipeDream-Flush's; what differs is the update per backward
    and that a segment spans many iterations."""
    S, m, s = shape
    assert async_one_f_one_b(S, m, s) == one_f_one_b(S, m, s)


@pytest.mark.parametrize("stages, m, iterations", [(4, 4, 2), (4, 2, 10), (2, 4, 5), (4, 8, 3)])
def test_async_pays_the_bubble_once_per_segment(stages, m, iterations):
    """k flushed iterations take k x 2(m + S - 1) ticks, one segment of k iterations 2(km + S - 1):
    the saving tends to the bubble fraction (S - 1) / (m + S - 1) of a flushed iteration."""
    flushed_ticks = len(tick_order(flushed(one_f_one_b, iterations), stages, m)[0])
    async_ticks = len(tick_order(async_one_f_one_b, stages, iterations * m)[0])
    assert flushed_ticks == iterations * 2 * (m + stages - 1)
    assert async_ticks == 2 * (iterations * m + stages - 1)
    saved = 1 - async_ticks / flushed_ticks
    bubble = (stages - 1) / (m + stages - 1)
    assert saved == pytest.approx(bubble * (1 - 1 / iterations))


def test_async_timeline_table():
    assert timeline(async_one_f_one_b, 2, 4) == "\n".join([
        "stage 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        "stage 1: .  F0 B0 F1 B1 F2 B2 F3 B3 .",
    ])


def test_async_schedules_registry():
    assert get_schedule("async_1f1b") is async_one_f_one_b
    assert "async_1f1b" in ASYNC_SCHEDULES and "async_1f1b" not in SCHEDULES
    with pytest.raises(ValueError, match="1f1b, gpipe, zb_h1, async_1f1b"):
        get_schedule("pipedream")
    with pytest.raises(ValueError):
        flushed(one_f_one_b, 0)


# -- zero bubble (ZB-H1) ---------------------------------------------------------------------------

def test_zb_h1_four_stages_eight_microbatches_fill_the_bubble_with_weight_gradients():
    """The table of the schedule's docstring: 27 ticks where 1F1B, whose backward is B and W in
    one, takes 33; and 1F1B's own table with its backward two ticks long."""
    assert timeline(zero_bubble_h1, 4, 8) == "\n".join([
        "stage 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "stage 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ])
    assert timeline(one_f_one_b, 2, 2, ticks={Kind.B: 2}) == "\n".join([
        "stage 0: F0 F1 .  .  B0 -  .  B1 -",
        "stage 1: .  F0 B0 -  F1 B1 -  .  .",
    ])


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_zb_h1_keeps_each_kind_in_order_and_the_memory_of_1f1b(shape):
    """Forwards and backwards in micro-batch order (what neighbours match messages by), one W
    of each micro-batch after its B; fewer than S - s micro-batches wait for their B (1F1B's
    bound), at most S for their W (1F1B's peak, the first stage's)."""
    S, m, s = shape
    actions = zero_bubble_h1(S, m, s)
    for kind in (Kind.F, Kind.B):
        assert [a.microbatch for a in actions if a.kind is kind] == list(range(m))
    assert sorted(a.microbatch for a in actions if a.kind is Kind.W) == list(range(m))
    for i in range(m):
        assert actions.index(Action("B", i)) < actions.index(Action("W", i))
    assert _max_in_flight([a for a in actions if a.kind is not Kind.W]) <= min(S - s, m)
    assert in_flight(actions) <= min(S, m) and in_flight(one_f_one_b(S, m, s)) == min(S - s, m)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16))
def test_zb_h1_takes_fewer_ticks_than_1f1b_with_the_same_work(S, m):
    """With B and W a tick each and 1F1B's backward both (two ticks), ZB-H1 never takes longer,
    and is shorter whenever there is a pipeline (1F1B: 3 (m + S - 1) ticks)."""
    ours = len(tick_order(zero_bubble_h1, S, m)[0])
    theirs = len(tick_order(one_f_one_b, S, m, ticks={Kind.B: 2})[0])
    assert theirs == 3 * (m + S - 1)
    assert ours <= theirs and (ours < theirs) == (S > 1)
    assert ours >= 3 * m + (S - 1)  # the work, and the first forward's way down and back
    if m >= S:  # the paper's bubble, (S - 1)(F + B - W): nothing idles but the fill
        assert ours == 3 * m + (S - 1)
