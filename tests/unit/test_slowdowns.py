"""The slowdown detector: a device that slows mid-run is named within a few iterations; a device
slow from the start, a single slow iteration or a slowdown every replica shares is not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.slowdowns import SlowdownDetector


def feed(detector, busy, iterations, start=0):
    """``busy(p, s, k)`` seconds for every device at iterations start..start+iterations-1;
    every change, in order."""
    changes = []
    for k in range(start, start + iterations):
        for p in range(detector.pipelines):
            for s in range(detector.stages):
                changes += detector.observe(p, s, k, busy(p, s, k))
    return changes


speeds = st.lists(st.floats(0.05, 20.0), min_size=2, max_size=6)


@settings(max_examples=60, deadline=None)
@given(speeds, st.integers(1, 4), st.floats(1.1, 4.0), st.integers(1, 9))
def test_devices_slow_from_the_start_are_the_plan(base, stages, threshold, window):
    detector = SlowdownDetector(len(base), stages, threshold, window)
    assert feed(detector, lambda p, s, k: base[p] * (1 + s), 60) == []


@settings(max_examples=60, deadline=None)
@given(speeds, st.integers(1, 3), st.floats(1.1, 3.0), st.integers(1, 9), st.data())
def test_a_device_that_slows_down_is_named_after_a_known_delay(base, stages, threshold,
                                                                window, data):
    P = len(base)
    slow_p, slow_s = data.draw(st.integers(0, P - 1)), data.draw(st.integers(0, stages - 1))
    factor = data.draw(st.floats(threshold * 1.01, 8.0))
    at = 3 + window + data.draw(st.integers(0, 10))
    detector = SlowdownDetector(P, stages, threshold, window, warmup=3)

    def busy(p, s, k):
        return base[p] * (factor if (p, s) == (slow_p, slow_s) and k >= at else 1.0)

    changes = feed(detector, busy, at + window + 5)
    assert [(c.kind, c.pipeline, c.stage) for c in changes] == [("straggler", slow_p, slow_s)]
    confirm = window // 2 + 1
    assert at + confirm - 1 <= changes[0].iteration <= at + 2 * confirm - 2  # the documented delay
    assert changes[0].slower == pytest.approx(factor, abs=1e-4)
    assert detector.stragglers() == [(slow_p, slow_s)]
    # and back to its speed: recovered, once more than half the window is fast again
    back = feed(detector, lambda p, s, k: base[p], window + 4, start=at + window + 5)
    assert [(c.kind, c.pipeline, c.stage) for c in back] == [("recovered", slow_p, slow_s)]
    assert detector.stragglers() == []


@settings(max_examples=40, deadline=None)
@given(speeds, st.integers(3, 9), st.data())
def test_one_slow_iteration_is_not_a_straggler(base, window, data):
    detector = SlowdownDetector(len(base), 2, 1.5, window)
    spike = data.draw(st.integers(10, 40))
    assert feed(detector, lambda p, s, k: base[p] * (50.0 if k == spike and p == 0 else 1.0),
                60) == []


def test_a_slowdown_every_replica_of_the_stage_shares_is_not_a_straggler():
    detector = SlowdownDetector(4, 2, 1.5, 5)
    # stage 1 of every pipeline slows 3x at iteration 20 (a longer input, a busy host)
    assert feed(detector, lambda p, s, k: 0.01 * (3.0 if s == 1 and k >= 20 else 1.0), 40) == []


def test_a_restarted_pipeline_starts_from_a_new_baseline():
    detector = SlowdownDetector(2, 1, 1.5, 3, warmup=0)
    feed(detector, lambda p, s, k: 1.0, 10)
    detector.reset(1)
    # its new processes run on a device twice as slow: that is their start, not a slowdown
    assert feed(detector, lambda p, s, k: 2.0 if p == 1 else 1.0, 10, start=10) == []


@pytest.mark.parametrize("kwargs", [dict(threshold=1.0), dict(threshold=0.5), dict(window=0),
                                    dict(warmup=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SlowdownDetector(2, 2, **kwargs)


def test_a_slowdown_too_small_to_slow_its_pipeline_is_not_named():
    detector = SlowdownDetector(2, 1, 1.5, 5)
    # 2 ms of compute in 50 ms iterations, doubled by a busy host: 2 ms more is 4 % of them
    changes = []
    for k in range(40):
        for p in (0, 1):
            busy = 0.004 if p == 0 and k >= 15 else 0.002
            changes += detector.observe(p, 0, k, busy, step_s=0.05)
    assert changes == []
    # the same doubling where compute is most of the iteration is named
    for k in range(40, 60):
        changes += detector.observe(0, 0, k, 0.08, step_s=0.1)
        changes += detector.observe(1, 0, k, 0.002, step_s=0.1)
    assert [(c.kind, c.pipeline) for c in changes] == [("straggler", 0)]


def test_a_device_an_earlier_leg_found_slow_recovers_when_back_to_its_speed():
    """Pipeline 0's stage 1 was found 4x slower before a re-plan (``fault.slowed``): it starts
    this leg a straggler, is not named again while it stays so, and recovers when it computes
    at a quarter of its start; its peers do not take its slowdown for a shared cause."""
    detector = SlowdownDetector(3, 2, 1.5, 5, carried={(0, 1): 4.0})
    assert detector.stragglers() == [(0, 1)]
    slow = feed(detector, lambda p, s, k: 0.4 if (p, s) == (0, 1) else 0.1, 20)
    assert slow == [] and detector.own_slowdown(0, 1) == pytest.approx(4.0)
    # its peer, pipeline 1's stage 1, slows 2x: named against peers of slowdown 1, not 4
    named = feed(detector, lambda p, s, k: {(0, 1): 0.4, (1, 1): 0.2}.get((p, s), 0.1), 10,
                 start=20)
    assert [(c.kind, c.pipeline, c.stage) for c in named] == [("straggler", 1, 1)]
    back = feed(detector, lambda p, s, k: 0.2 if (p, s) == (1, 1) else 0.1, 10, start=30)
    assert [(c.kind, c.pipeline, c.stage) for c in back] == [("recovered", 0, 1)]
    assert back[0].iteration <= 30 + 2 * (5 // 2 + 1) - 1
    assert detector.own_slowdown(0, 1) == pytest.approx(1.0)


def test_a_straggler_whose_added_share_wanders_about_the_edge_stays_one():
    """Named once its slowdown adds :data:`MATTERS` of the iteration; while what it adds wanders
    about that share (its iteration time does) it stays named, and it recovers only below half
    of it."""
    detector = SlowdownDetector(2, 1, 1.5, 5)
    changes = []
    for k in range(120):
        slow = k >= 15
        # 10 ms of compute, 30 ms once slow: 20 ms more over iterations of 180 or 220 ms by turns
        step_s = 0.18 if (k // 6) % 2 else 0.22
        changes += detector.observe(0, 0, k, 0.03 if slow else 0.01, step_s=step_s)
        changes += detector.observe(1, 0, k, 0.01, step_s=step_s)
    assert [(c.kind, c.pipeline) for c in changes] == [("straggler", 0)]
    for k in range(120, 140):  # its iterations grow to 0.5 s: 20 ms is 4 % of them
        changes += detector.observe(0, 0, k, 0.03, step_s=0.5)
        changes += detector.observe(1, 0, k, 0.01, step_s=0.5)
    assert [c.kind for c in changes] == ["straggler", "recovered"]
