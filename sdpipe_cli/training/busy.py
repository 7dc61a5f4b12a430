"""How long a stage computes per iteration: what tells a slow device from a slow neighbour.

A stage's iteration time includes its waits for the stage before it (activations) and after it
(gradients), so a slow device makes its whole pipeline's iterations long. Its compute does not:
:class:`BusyTime` wraps the executor's ``on_action`` hook (called after each forward and backward
with the compute's wall time) and adds that, and the time the hooks it wraps take (an emulated
slow device sleeps there), into a sum the worker reports per iteration as ``busy_s``. The
scheduler's :class:`~sdpipe_cli.core.slowdowns.SlowdownDetector` judges it. Two clock reads per
action; nothing when ``fault.on_slowdown=off``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

__all__ = ["BusyTime"]


class BusyTime:
    """An ``on_action`` hook that sums compute seconds, calling ``inner`` (if any) inside."""

    def __init__(self, inner: Optional[Callable[[Any, float], None]] = None):
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, action: Any, seconds: float) -> None:
        called = time.perf_counter()
        if self.inner is not None:
            self.inner(action, seconds)
        self.seconds += seconds + (time.perf_counter() - called)

    def take(self) -> float:
        """The seconds summed since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
