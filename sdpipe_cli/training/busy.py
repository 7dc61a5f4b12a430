"""How long a stage computes per iteration: what tells a slow device from a slow neighbour.

A stage's iteration time includes its waits for the stage before it (activations) and after it
(gradients), so a slow device makes its whole pipeline's iterations long. Its compute does not:
:class:`BusyTime` wraps the executor's ``on_action`` hook (called after each forward and backward
with the compute's wall time) and adds that, and the time the hooks it wraps take (an emulated
slow device sleeps there), into a sum the worker reports per iteration as ``busy_s``. The
scheduler's :class:`~sdpipe_cli.core.slowdowns.SlowdownDetector` judges it. Two clock reads per
action; nothing when ``fault.on_slowdown=off``. On CUDA, where nothing inside it needs an action's
kernels done when the action ends (no emulated slowdown, no trace), it takes two CUDA events per
action instead, and reads them when the worker takes the sum at the iteration's end: no action
waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["BusyTime"]


class BusyTime:
    """An ``on_action`` hook that sums compute seconds, calling ``inner`` (if any) inside."""

    def __init__(self, inner: Callable[[Any, float], None] | None = None):
        self.inner = inner
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []  # actions timed on the device, not read yet

    @property
    def times_on_device(self) -> bool:
        """Whether it may take an action as CUDA events (:meth:`timed`): nothing inside it."""
        return self.inner is None

    def __call__(self, action: Any, seconds: float) -> None:
        called = time.perf_counter()
        if self.inner is not None:
            self.inner(action, seconds)
        self.seconds += seconds + (time.perf_counter() - called)

    def timed(self, start: Any, end: Any) -> None:
        """An action's compute between two recorded CUDA events, read by :meth:`take`."""
        self._events.append((start, end))

    def take(self) -> float:
        """The seconds summed since the last call."""
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3  # milliseconds
        self._events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds
