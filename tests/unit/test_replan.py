"""The re-plan decision (:mod:`sdpipe_cli.core.replan`): the split the measured speeds call for,
the run's pace before and after under the sync mode's rule, and whether moving pays."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpipe_cli.core.partition import uniform
from sdpipe_cli.core.replan import MIN_GAIN, pipeline_ms, propose, run_rate

P, S, BLOCKS, M, BATCH = 4, 4, 16, 4, 16


def speeds(slow: dict[tuple[int, int], float]) -> list[list[list[float]]]:
    """1 ms per block everywhere, except the (pipeline, stage) devices in ``slow``, whose
    speed is the given fraction."""
    return [[[1.0 / slow.get((p, s), 1.0)] * BLOCKS for s in range(S)] for p in range(P)]


def test_a_pipeline_takes_m_plus_s_minus_1_of_its_slowest_stage():
    row = speeds({(0, 1): 0.25})[0]
    assert pipeline_ms(row, uniform(BLOCKS, S), M) == (M + S - 1) * 16.0


def test_lock_step_replans_a_slow_device_and_doubles_the_pace():
    block_ms = speeds({(2, 1): 0.25})
    proposal = propose(block_ms, uniform(BLOCKS, S), M, BATCH, lock_step=True,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert proposal.go, proposal.reason
    stage1 = proposal.bounds[1] - proposal.bounds[0]
    assert stage1 < BLOCKS // S  # the slow device's stage gives blocks away
    # the bottleneck goes from 4 blocks at 4 ms (16 ms) to 5 blocks at 1 ms, the slow stage 1
    assert proposal.bounds == [5, 6, 11] or proposal.bounds[1] - proposal.bounds[0] == 1
    assert proposal.rate_new == pytest.approx(16 / 5 * proposal.rate_now)


def test_sdpipe_declines_a_split_that_slows_the_other_pipelines_more():
    block_ms = speeds({(2, 1): 0.25})
    proposal = propose(block_ms, uniform(BLOCKS, S), M, BATCH, lock_step=False,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    assert not proposal.go
    assert proposal.rate_new < proposal.rate_now
    assert "sum of the pipelines'" in proposal.reason


def test_sdpipe_replans_when_half_of_the_pipelines_slowed_on_one_stage():
    block_ms = speeds({(0, 1): 0.25, (2, 1): 0.25})  # two of the four stage-1 devices
    proposal = propose(block_ms, uniform(BLOCKS, S), M, BATCH, lock_step=False,
                       samples_left=100_000, restart_s=5.0, state_bytes=1e6)
    # now: two pipelines at 16 ms a micro-batch, two at 4; after: all four at 5
    assert proposal.go
    assert proposal.rate_new == pytest.approx(proposal.rate_now * (4 / 5) / (2 / 16 + 2 / 4))


def test_no_replan_when_the_split_is_already_right_or_moving_costs_more():
    even = speeds({})
    same = propose(even, uniform(BLOCKS, S), M, BATCH, True, 100_000, 5.0, 1e6)
    assert not same.go and same.bounds == same.current and "already" in same.reason
    late = propose(speeds({(2, 1): 0.25}), uniform(BLOCKS, S), M, BATCH, True,
                   samples_left=50, restart_s=30.0, state_bytes=1e6)
    assert not late.go and "moving costs" in late.reason and late.gain_s < late.move_s


block_times = st.lists(st.lists(st.lists(st.floats(0.1, 10.0), min_size=8, max_size=8),
                                min_size=3, max_size=3), min_size=2, max_size=4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(block_times, st.booleans(), st.floats(0.0, 1e7))
def test_a_proposal_never_predicts_worse_for_lock_step_and_goes_only_when_it_pays(
        block_ms, lock_step, samples_left):
    current = uniform(8, 3)
    proposal = propose(block_ms, current, 4, 8, lock_step, samples_left, 2.0, 1e6)
    if lock_step:  # the partitioner minimises the slowest pipeline's bottleneck
        assert proposal.rate_new >= proposal.rate_now * (1 - 1e-9)
    assert proposal.rate_now == pytest.approx(run_rate(block_ms, current, 4, 8, lock_step))
    if proposal.go:
        assert proposal.bounds != current and proposal.gain_s > proposal.move_s
        assert proposal.rate_new >= MIN_GAIN * proposal.rate_now
