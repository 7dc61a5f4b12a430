"""The re-plan decision (:mod:`sdpipe_cli.core.replan`): the split the measured speeds call for,
the run's pace before and after under the sync mode's rule, and whether moving pays."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.partition import uniform
from sdpipe_cli.core.replan import MIN_GAIN, as_config, called_for, move_cost, pace_bound, pipeline_ms, propose

P, S, BLOCKS, M, BATCH = 4, 4, 16, 4, 16
EVEN = [uniform(BLOCKS, S)] * P  # every pipeline split evenly (the speeds' advice at the start)
LOCK_STEP, SDPIPE, ALONE = math.inf, 1.5, 1.0  # pace bounds: everyone, patience 0.5, nobody


def speeds(slow: dict[tuple[int, int], float]) -> list[list[list[float]]]:
    """1 ms per block everywhere, except the (pipeline, stage) devices in ``slow``, whose
    speed is the given fraction."""
    return [[[1.0 / slow.get((p, s), 1.0)] * BLOCKS for s in range(S)] for p in range(P)]


def test_a_pipeline_takes_its_stages_once_and_its_slowest_m_minus_1_more_times():
    row = speeds({(0, 1): 0.25})[0]  # stages of 4, 16, 4 and 4 ms a micro-batch
    assert pipeline_ms(row, uniform(BLOCKS, S), M) == 28.0 + (M - 1) * 16.0


@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=4), st.integers(1, 12))
def test_one_chunk_a_stage_keeps_1f1b_s_formula_to_the_bit(times, m):
    """The re-plan decision compares predicted rates against thresholds: a run of one chunk a
    stage must get exactly the figure it always got."""
    row = [times] * len(times)  # a block's time, the same on every stage's device
    stages = list(times)  # one block a stage
    assert pipeline_ms(row, list(range(1, len(times))), m) == sum(stages) + (m - 1) * max(stages)


def test_an_interleaved_pipeline_is_timed_by_its_own_timeline():
    """Eight equal pieces of two blocks, two a stage: the interleaved schedule's tick order, a
    chunk's forward a third of its blocks' time and its backward two thirds; with stage 1 four
    times slower, at least its m micro-batches' work, and less than 1F1B's formula gives the
    same stages."""
    from sdpipe_cli.core.interleaved import interleaved_1f1b
    from sdpipe_cli.core.schedule import Kind, tick_order

    even = speeds({})[0]
    ticks = len(tick_order(interleaved_1f1b(2), S, M, {Kind.B: 2}, chunks=2)[0])
    assert pipeline_ms(even, uniform(BLOCKS, 2 * S), M) == pytest.approx(ticks * 2.0 / 3)
    slow = speeds({(0, 1): 0.25})[0]  # stages of 4, 16, 4 and 4 ms a micro-batch
    got = pipeline_ms(slow, uniform(BLOCKS, 2 * S), M)
    assert M * 16.0 <= got < 28.0 + (M - 1) * 16.0


def test_a_split_backward_is_timed_by_its_schedule_s_timeline_not_1f1b_s():
    """ZB-H1 and interleaved zero bubble: equal stages of 4 ms a micro-batch (F, B and W a
    third each) take ``3 m + S - 1`` and ``3 v m + S - 1`` ticks of a third of a piece's time,
    where 1F1B's formula says ``(m + S - 1)`` stage-times; with stage 1 four times slower, the
    re-plan that gives it fewer blocks is predicted to pay under each schedule's own timeline
    as under 1F1B's, by how much its timeline says."""
    even = speeds({})[0]
    one = pipeline_ms(even, uniform(BLOCKS, S), M)
    assert one == (M + S - 1) * 4.0
    assert pipeline_ms(even, uniform(BLOCKS, S), M, "zb_h1") == pytest.approx((3 * M + S - 1) * 4.0 / 3)
    assert pipeline_ms(even, uniform(BLOCKS, 2 * S), M, "interleaved_zb") == pytest.approx(
        (3 * 2 * M + S - 1) * 2.0 / 3)
    block_ms = speeds({(0, 1): 0.25})
    rates = {}
    for schedule in ("1f1b", "zb_h1"):
        proposal = propose(block_ms, EVEN, EVEN, M, BATCH, pace=ALONE, own=True, samples_left=1e6,
                           restart_s=1.0, state_bytes=1e6, schedule=schedule)
        assert proposal.go and proposal.bounds[0] != EVEN[0], (schedule, proposal.reason)
        assert proposal.rate_now == pytest.approx(sum(BATCH * 1e3 / pipeline_ms(row, EVEN[0], M, schedule)
                                                 for row in block_ms))
        rates[schedule] = proposal.rate_now
    assert rates["zb_h1"] > rates["1f1b"]  # the W fills some of the slow stage's bubbles


def test_interleaved_splits_are_called_for_in_v_times_s_pieces_on_their_stages_devices():
    """Piece k runs on stage k mod S: the pieces of the slowed stage 1 (1 and 5) get fewer
    blocks than the others, and every pipeline's split has 2 S - 1 boundaries."""
    [split, *rest] = called_for(speeds({(p, 1): 0.5 for p in range(P)}), own=False, chunks=2)
    assert len(split) == 2 * S - 1 and all(r == split for r in rest)
    sizes = [b - a for a, b in zip([0, *split], [*split, BLOCKS])]
    assert max(sizes[1], sizes[5]) < min(sizes[k] for k in (2, 3, 6, 7)), sizes


def test_lock_step_replans_a_slow_device_and_doubles_the_pace():
    block_ms = speeds({(2, 1): 0.25})
    proposal = propose(block_ms, EVEN, EVEN, M, BATCH, pace=LOCK_STEP, own=False,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert proposal.go, proposal.reason
    # the slow stage keeps 1 block (4 ms), the others take 5 each: 76 ms -> 19 + 3 x 5 = 34 ms,
    # on every pipeline (one split for all)
    assert proposal.bounds == [[5, 6, 11]] * P
    assert proposal.rate_new == pytest.approx(76 / 34 * proposal.rate_now)
    assert proposal.change() == "[4, 8, 12] -> [5, 6, 11]"


def test_one_split_for_all_is_declined_when_it_slows_the_other_pipelines_more():
    block_ms = speeds({(2, 1): 0.25})
    proposal = propose(block_ms, EVEN, EVEN, M, BATCH, pace=ALONE, own=False,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    # the slow pipeline 76 -> 34 ms, the three others 28 -> 31 ms: the sum gains under 5 %
    assert not proposal.go
    gain = (3 / 31 + 1 / 34) / (3 / 28 + 1 / 76)
    assert proposal.rate_new == pytest.approx(gain * proposal.rate_now) and gain < MIN_GAIN
    assert "own paces" in proposal.reason


def test_pipelines_going_their_own_pace_resplit_only_the_slowed_one():
    block_ms = speeds({(2, 1): 0.25})
    proposal = propose(block_ms, EVEN, EVEN, M, BATCH, pace=ALONE, own=True,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    # the slow pipeline 76 -> 34 ms, the three others keep 28 ms
    assert proposal.go, proposal.reason
    assert proposal.bounds == [EVEN[0], EVEN[0], [5, 6, 11], EVEN[0]]
    gain = (3 / 28 + 1 / 34) / (3 / 28 + 1 / 76)
    assert proposal.rate_new == pytest.approx(gain * proposal.rate_now)
    assert proposal.change() == "pipeline 2: [4, 8, 12] -> [5, 6, 11]"
    assert proposal.record()["proposed"][2] == [5, 6, 11]
    assert as_config(proposal.bounds, EVEN[0]) == (EVEN[0], {2: [5, 6, 11]})
    assert as_config([[5, 6, 11]] * P, EVEN[0]) == ([5, 6, 11], {})


def test_sdpipe_declines_resplitting_one_pipeline_that_its_groups_would_then_wait_for():
    """34 ms against the others' 28 is within 1.5x: sdpipe's rounds would wait for it, and the
    four would go at 34 ms, less than three at 28 and one at 76 ms."""
    proposal = propose(speeds({(2, 1): 0.25}), EVEN, EVEN, M, BATCH, pace=SDPIPE, own=True,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert not proposal.go
    assert proposal.rate_new == pytest.approx(4 / 34 / (3 / 28 + 1 / 76) * proposal.rate_now)
    assert "within 1.5x of the fastest" in proposal.reason


def test_sdpipe_resplits_the_pipelines_when_half_of_them_slowed_on_one_stage():
    block_ms = speeds({(0, 1): 0.25, (2, 1): 0.25})  # two of the four stage-1 devices
    proposal = propose(block_ms, EVEN, EVEN, M, BATCH, pace=SDPIPE, own=True,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    # now: two pipelines at 28 ms together, two at 76 alone; after: all four at 34 ms together
    assert proposal.go, proposal.reason
    assert proposal.bounds == [[5, 6, 11], EVEN[0], [5, 6, 11], EVEN[0]]
    gain = (4 / 34) / (2 / 28 + 2 / 76)
    assert proposal.rate_new == pytest.approx(gain * proposal.rate_now)


def test_pace_bounds_of_the_modes():
    assert pace_bound(True) == math.inf
    # cost_aware (the default) waits only for replicas alike, within AWAIT_PACE_RATIO
    assert pace_bound(False, {"patience": 0.5, "connect_every": 4}) == 1.15
    assert pace_bound(False, {"patience": 0.5, "connect_every": 4, "policy": "classic"}) == 1.5
    assert pace_bound(False, {"patience": 0.5, "connect_every": 1}) == math.inf
    assert pace_bound(False, {"patience": 0.0}) == 1.0 and pace_bound(False) == 1.0


def test_a_given_split_stays_where_the_speeds_do_not_change_the_advice():
    # pipeline 1 was given [2, 8, 12] against the even advice; pipeline 3's device slows
    given = [EVEN[0], [2, 8, 12], EVEN[0], EVEN[0]]
    proposal = propose(speeds({(3, 1): 0.25}), given, EVEN, M, BATCH, pace=ALONE, own=True,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert proposal.bounds[1] == [2, 8, 12] and proposal.bounds[3] == [5, 6, 11]
    alone = propose(speeds({}), given, EVEN, M, BATCH, pace=ALONE, own=True,
                    samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert not alone.go and "was given" in alone.reason


def test_no_replan_when_the_split_is_already_right_or_moving_costs_more():
    even = speeds({})
    same = propose(even, EVEN, EVEN, M, BATCH, LOCK_STEP, False, 100_000, 5.0, 1e6)
    assert not same.go and same.bounds == same.current and "already" in same.reason
    late = propose(speeds({(2, 1): 0.25}), EVEN, EVEN, M, BATCH, LOCK_STEP, False,
                   samples_left=50, restart_s=30.0, state_bytes=1e6)
    assert not late.go and "moving costs" in late.reason and late.gain_s < late.move_s


def test_in_place_moving_costs_only_the_re_split_pipelines_share():
    """One pipeline of four re-split in place stops a quarter of the run, for a start-up and a
    copy of its quarter of the state; the whole run stopping costs the start-up and five disk
    passes of all of it. With every pipeline changed nothing goes on: a stop either way."""
    assert move_cost(8.0, 4e8, 2e8, 1, 4, in_place=True) == pytest.approx(0.25 * (8.0 + 0.5))
    assert move_cost(8.0, 4e8, 2e8, 1, 4, in_place=False) == pytest.approx(8.0 + 10.0)
    assert move_cost(8.0, 4e8, 2e8, 4, 4, in_place=True) == move_cost(8.0, 4e8, 2e8, 4, 4, False)
    late = dict(samples_left=50_000, restart_s=5.0, state_bytes=1e6)
    stop = propose(speeds({(2, 1): 0.25}), EVEN, EVEN, M, BATCH, ALONE, True, **late)
    going = propose(speeds({(2, 1): 0.25}), EVEN, EVEN, M, BATCH, ALONE, True, **late,
                    in_place=True)
    assert going.move_s == pytest.approx(stop.move_s / 4 - 5 * 1e6 / 2e8 / 4 + 1e6 / 16 / 2e8)
    assert going.go and not stop.go  # near the end, only the hand-over in place still pays


block_times = st.lists(st.lists(st.lists(st.floats(0.1, 10.0), min_size=8, max_size=8),
                                min_size=3, max_size=3), min_size=2, max_size=4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(block_times, st.sampled_from([LOCK_STEP, SDPIPE, ALONE]), st.booleans(),
       st.floats(0.0, 1e7))
def test_a_proposal_goes_only_when_it_pays(block_ms, pace, own, samples_left):
    current = [uniform(8, 3)] * len(block_ms)
    proposal = propose(block_ms, current, current, 4, 8, pace, own, samples_left, 2.0, 1e6)
    times = [pipeline_ms(row, current[0], 4) / 1e3 for row in block_ms]
    if pace == LOCK_STEP:  # the run's pace is its slowest pipeline's
        assert proposal.rate_now == pytest.approx(len(block_ms) * 8 / max(times))
    if pace == ALONE:  # every pipeline at its own
        assert proposal.rate_now == pytest.approx(sum(8 / t for t in times))
    if proposal.go:
        assert proposal.bounds != current and proposal.gain_s > proposal.move_s
        assert proposal.rate_new >= MIN_GAIN * proposal.rate_now
    if not own:  # one split for all
        assert all(b == proposal.bounds[0] for b in proposal.bounds)
    else:  # a pipeline's split is its own devices' best, or the one it has
        wanted = called_for(block_ms, own=True)
        assert all(b in (w, c) for b, w, c in zip(proposal.bounds, wanted, current))
