"""fp16's loss-scale policy: shrink and skip on overflow, grow after a run of good steps."""

from __future__ import annotations

from hypothesis import given, strategies as st

from sdpipe_cli.core.loss_scale import LossScale


def test_overflow_halves_and_skips_good_steps_grow():
    s = LossScale(value=1024.0, growth_interval=3)
    assert s.update(False) is False and s.value == 512.0 and s.skipped == 1
    assert [s.update(True) for _ in range(3)] == [True] * 3
    assert s.value == 1024.0 and s.good_steps == 0
    s.update(True)
    s.update(False)  # an overflow restarts the count of good steps
    assert s.value == 512.0 and s.good_steps == 0


@given(st.lists(st.booleans(), max_size=200))
def test_the_scale_stays_within_bounds_and_every_overflow_is_a_skip(verdicts):
    s = LossScale(value=2.0 ** 8, growth_interval=5, minimum=1.0)
    steps = [s.update(v) for v in verdicts]
    assert steps == verdicts
    assert s.skipped == verdicts.count(False)
    assert s.value >= 1.0
    assert s.value <= 2.0 ** 8 * 2 ** (len(verdicts) // 5)


def test_an_overflow_at_the_smallest_scale_is_exhausted_not_one_more_skip():
    """Halving from 4 to 1 are skips; an overflow at 1 means the gradient itself is not finite,
    which the worker then treats as fp32 does (stop, or skip up to train.max_skipped)."""
    s = LossScale(value=4.0, minimum=1.0)
    assert [(s.update(False), s.exhausted) for _ in range(2)] == [(False, False)] * 2
    assert s.value == 1.0
    assert s.update(False) is False and s.exhausted and s.value == 1.0
    assert s.update(True) is True and not s.exhausted


@given(st.lists(st.booleans(), max_size=100), st.integers(0, 6))
def test_exhausted_is_an_overflow_at_the_floor(verdicts, halvings):
    s = LossScale(value=2.0 ** halvings, growth_interval=4, minimum=1.0)
    for finite in verdicts:
        before = s.value
        s.update(finite)
        assert s.exhausted == (not finite and before == 1.0)
