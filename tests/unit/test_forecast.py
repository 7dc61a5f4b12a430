"""The forecast of replicas' ready signals (``sdpipe_cli/core/forecast.py``): pure, times given."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.forecast import BUSY_SAMPLES, OUTLIER, Forecast


def _cycle(f: Forecast, start: float, busy: float, wait: float, stage: int = 0, pipeline: int = 0
           ) -> float:
    """One iteration of one replica: released at ``start``, ready after ``busy``, waits ``wait``."""
    f.release(stage, pipeline, start)
    f.ready(stage, pipeline, start + busy)
    return start + busy + wait


def test_the_forecast_is_release_plus_compute_whatever_the_waits():
    """Waits of 0 to 90 ms between 100 ms iterations: the interval pace swings with them, the
    forecast does not (it counts from the release)."""
    f, t = Forecast(1), 0.0
    f.ready(0, 0, t)
    for wait in (0.09, 0.0, 0.05, 0.0, 0.09):
        t = _cycle(f, t, 0.1, wait)
    assert f.expected(0, 0) is None  # ready now: no forecast until it goes on
    f.release(0, 0, 7.0)
    assert f.expected(0, 0) == pytest.approx(7.1)
    assert f.pace[(0, 0)] > 0.11  # waits included


def test_one_straggle_in_three_does_not_move_the_forecast_and_a_lasting_change_does():
    f, t = Forecast(1), 0.0
    for busy in (0.1, 0.1, 0.3):
        t = _cycle(f, t, busy, 0.0)
    f.release(0, 0, t)
    assert f.expected(0, 0) == pytest.approx(t + 0.1)
    for busy in (0.3, 0.3):  # two more: it is slower now
        t = _cycle(f, t, busy, 0.0)
    f.release(0, 0, t)
    assert f.expected(0, 0) == pytest.approx(t + 0.3)


def test_the_error_follows_usual_misses_and_ignores_straggles():
    f, t = Forecast(1), 0.0
    for busy in (0.100, 0.100, 0.100, 0.102, 0.098, 0.102, 0.098):
        t = _cycle(f, t, busy, 0.0)
    usual = f.error(0, 0)
    assert 0.0 < usual <= 0.004 + 1e-12  # the spread of the spans, not of a straggle
    t = _cycle(f, t, 0.100 * (1 + 2 * OUTLIER), 0.0)  # a straggle: not a miss of the forecast
    assert f.error(0, 0) == pytest.approx(usual)


def test_missed_is_the_signed_usual_miss_of_the_last_ready_signal():
    """How late (or early) the last ready signal came against the replica's own forecast: what a
    round reads to await the others as late; a straggle, or a peer's forecast, says nothing."""
    f, t = Forecast(1), 0.0
    for _ in range(3):
        t = _cycle(f, t, 0.1, 0.0)
    assert f.missed(0, 0) == pytest.approx(0.0)
    t = _cycle(f, t, 0.13, 0.0)  # 30 ms late: a usual miss (< OUTLIER x 100 ms)
    assert f.missed(0, 0) == pytest.approx(0.03)
    t = _cycle(f, t, 0.08, 0.0)  # 20 ms early (the compute time is the median: 100 ms)
    assert f.missed(0, 0) == pytest.approx(-0.02)
    t = _cycle(f, t, 0.1 * (1 + 2 * OUTLIER), 0.0)  # a straggle
    assert f.missed(0, 0) == 0.0
    f.release(0, 0, t, pause=True)  # a known pause, not measured yet: not forecast
    f.ready(0, 0, t + 0.4)
    assert f.missed(0, 0) == 0.0
    f.release(0, 0, t + 0.4, pause=True)  # forecast 0.13 + 0.27 (the median span now 0.13)
    f.ready(0, 0, t + 0.7)
    assert f.missed(0, 0) == pytest.approx(-0.1)
    g = Forecast(1)  # a peer's forecast
    for p in range(2):
        g.ready(0, p, 0.0)
        g.release(0, p, 0.0)
    g.ready(0, 0, 0.1)
    g.ready(0, 1, 0.12)
    assert g.missed(0, 1) == 0.0 and Forecast(1).missed(0, 0) == 0.0


def test_forget_drops_everything_known_of_a_pipeline():
    f, t = Forecast(2), 0.0
    for _ in range(3):
        for s in range(2):
            _cycle(f, t, 0.1, 0.0, stage=s, pipeline=1)
        t += 0.1
    for s in range(2):
        f.release(s, 1, t)
    assert f.due_by(0, t + 1, 9) == [(pytest.approx(t + 0.1), 1)]
    f.forget(1)
    assert f.expected(0, 1) is None and f.error(0, 1) is None and (0, 1) not in f.pace
    assert f.due_by(0, t + 1, 9) == []
    f.release(0, 1, t)  # starts afresh: forecast like a peer, from the stage's last measurement
    assert f.expected(0, 1) == pytest.approx(t + 0.1) and f.error(0, 1) is None
    assert Forecast(1).due_by(0, t + 1, 9) == []  # nothing measured, nothing forecast


def test_a_replica_with_nothing_measured_is_forecast_from_its_peers():
    """Three replicas start together; the third's first ready signal comes 0.2 s after the
    first's. Released together, nobody is forecast until one measures its compute time (0.1 s);
    then the others are, from it, the third 0.2 s later; the miss of such a forecast is the
    peer's, not the replica's own error."""
    f = Forecast(1)
    for p, first in enumerate((1.0, 1.01, 1.2)):
        f.ready(0, p, first)
    for p in range(3):
        f.release(0, p, 1.3)
    assert f.due_by(0, 9.0, 9) == []
    f.ready(0, 0, 1.4)  # measured: 0.1
    assert f.due_by(0, 9.0, 9) == [(pytest.approx(1.41), 1), (pytest.approx(1.6), 2)]
    f.ready(0, 1, 1.45)  # 40 ms after the peer's forecast
    assert f.error(0, 1) is None
    f.release(0, 1, 1.5)
    assert f.expected(0, 1) == pytest.approx(1.65)  # its own measurement from now on


def test_a_first_pause_is_forecast_from_the_first_peer_back():
    """Two replicas released before their first evaluation: neither forecast; the first back
    measures 0.3 s of pause, and the other is forecast with it, a pause the round's slack
    grows with."""
    f, t = Forecast(1), 0.0
    for p in range(2):
        f.ready(0, p, t)
    for _ in range(3):
        for p in range(2):
            _cycle(f, t, 0.1, 0.0, pipeline=p)
        t += 0.1
    for p in range(2):
        f.release(0, p, t, pause=True)
    assert f.due_by(0, t + 9, 9) == []
    f.ready(0, 0, t + 0.4)
    assert f.expected(0, 1) == pytest.approx(t + 0.4)
    assert f.longest_pause(0, [1]) == pytest.approx(0.3)
    f.ready(0, 1, t + 0.45)
    f.release(0, 1, t + 0.45, pause=True)
    assert f.expected(0, 1) == pytest.approx(t + 0.45 + 0.1 + 0.35)  # its own pause now
    assert f.worst_error(0, [1]) is None  # the peer's miss taught it nothing of its own


@settings(max_examples=60, deadline=None)
@given(busy=st.lists(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=8), min_size=1, max_size=6),
       horizon=st.floats(0.0, 2.0), room=st.integers(1, 6), skip=st.sets(st.integers(0, 5)),
       slowest=st.floats(0.0, 1.2))
def test_due_by_finds_exactly_the_current_forecasts_by_the_horizon(busy, horizon, room, skip,
                                                                   slowest):
    """Replicas with several past iterations (so superseded forecasts abound), then released at
    0: due_by returns the ``room`` earliest current forecasts up to ``horizon`` that are neither
    excluded nor slower than ``slowest`` (their compute time: a pace of 10 s each, waits
    included, would exclude every one), earliest first, and can answer again the same way."""
    f = Forecast(1)
    for p, spans in enumerate(busy):
        t = -100.0
        for b in spans:
            f.release(0, p, t)
            f.ready(0, p, t + b)
            t += 10.0
        f.release(0, p, 0.0)
    want = sorted((f.expected(0, p), p) for p in range(len(busy))
                  if p not in skip and f.expected(0, p) <= horizon
                  and f.speed(0, p) <= slowest)[:room]
    for _ in range(2):
        assert f.due_by(0, horizon, room, slowest, (skip,)) == want
    assert len(busy[0]) < BUSY_SAMPLES or f.expected(0, 0) == pytest.approx(
        sorted(busy[0][-BUSY_SAMPLES:])[BUSY_SAMPLES // 2])


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["ready", "release", "forget"]), st.integers(0, 4),
                              st.floats(0.001, 0.5)), max_size=60))
def test_due_by_holds_one_current_forecast_per_replica_whatever_the_order_of_events(ops):
    """Ready signals, releases (twice in a row too, as a restart does) and forgotten pipelines in
    any order: the table answers with exactly the replicas forecast now, each once."""
    f, t = Forecast(1), 0.0
    for op, p, dt in ops:
        t += dt
        if op == "ready":
            f.ready(0, p, t)
        elif op == "release":
            f.release(0, p, t)
        else:
            f.forget(p)
    current = sorted((f.expected(0, p), p) for p in range(5) if f.expected(0, p) is not None)
    assert f.due_by(0, float("inf"), 10) == current


def test_a_known_pause_is_forecast_once_measured_and_leaves_compute_and_pace_alone():
    """An evaluation of 0.3 s after some iterations of 0.1 s: the first is not forecast (nobody
    waits on a guess), the next one is, and neither moves the compute time, the pace or the
    usual error."""
    f, t = Forecast(1), 0.0
    f.ready(0, 0, t)
    for _ in range(4):
        t = _cycle(f, t, 0.1, 0.0)
    pace, error = f.pace[(0, 0)], f.error(0, 0)
    f.release(0, 0, t, pause=True)
    assert f.expected(0, 0) is None
    f.ready(0, 0, t + 0.4)
    t += 0.4
    assert (f.pace[(0, 0)], f.error(0, 0)) == (pace, error)
    f.release(0, 0, t)
    assert f.expected(0, 0) == pytest.approx(t + 0.1)  # the pause did not enter the compute time
    f.ready(0, 0, t + 0.1)
    t += 0.1
    f.release(0, 0, t, pause=True)
    assert f.expected(0, 0) == pytest.approx(t + 0.4)
    assert f.longest_pause(0, [0]) == pytest.approx(0.3)
    f.ready(0, 0, t + 0.45)  # 50 ms late: the pause's error, not the usual one
    assert f.error(0, 0) == error
    f.release(0, 0, t + 0.45, pause=True)
    assert f.worst_error(0, [0]) == pytest.approx(0.05)
    assert f.longest_pause(0, [0]) == pytest.approx(0.325)  # the moving average of 0.3 and 0.35
    f.release(0, 0, t + 0.45)
    assert f.longest_pause(0, [0]) == 0.0  # no pause ahead
