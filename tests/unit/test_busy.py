"""A stage's compute time per iteration (``busy_s``): summed from the executor's hook, and on
CUDA from events read at the iteration's end, so that a default run's actions never wait for the
device (``torch.cuda.synchronize`` after each one held every forward and backward)."""

from __future__ import annotations

import pytest

from sdpipe_cli.hetero.emulation import EmulatedSlowdown
from sdpipe_cli.pipeline.executor import device_timed
from sdpipe_cli.training.busy import BusyTime


class FakeEvent:
    """A recorded CUDA event, as far as BusyTime reads one."""

    def __init__(self, at_ms: float):
        self.at_ms, self.synchronized = at_ms, False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_seconds_and_device_events_sum_until_taken():
    busy = BusyTime()
    busy("F0", 0.25)
    start, end = FakeEvent(10.0), FakeEvent(510.0)
    busy.timed(start, end)  # not read while the iteration goes on
    assert not end.synchronized
    assert busy.take() == pytest.approx(0.75, abs=1e-3) and end.synchronized
    assert busy.take() == 0.0  # read once


def test_only_a_default_runs_hook_is_timed_on_the_device():
    alone, around_a_slowdown = BusyTime(), BusyTime(EmulatedSlowdown(2.0))
    assert device_timed("cuda", alone)  # fault.on_slowdown=warn, nothing emulated
    assert not device_timed("cuda", around_a_slowdown)  # sleeps once its kernels are done
    assert not device_timed("cpu", alone)  # the wall clock is the compute on a CPU
    assert not device_timed("cuda", lambda action, seconds: None)  # a trace's hook
    assert not device_timed("cuda", None)
