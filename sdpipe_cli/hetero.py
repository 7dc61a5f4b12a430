"""Heterogeneity emulation: make a worker's compute take longer, honestly.

``cluster.slowdown`` gives one factor per pipeline (3.0 = three times slower). Two modes:

* measured (``cluster.compute_ms`` unset): after each forward or backward the worker sleeps
  ``(factor - 1) x`` the time the action took, so its compute takes ``factor x`` the wall time.
  On a busy machine the measured time already includes CPU contention, and the sleep scales it.
* modelled (``cluster.compute_ms`` set): every micro-batch forward costs ``compute_ms x factor``
  and every backward twice that; the real compute runs inside that budget and the worker sleeps
  for the rest. Results then do not depend on how many processes share the cores, as long as the
  real compute fits inside the budget (the worker counts the actions where it did not).
"""

from __future__ import annotations

import time
from typing import Optional

from sdpipe_cli.schedule import Action


class Slowdown:
    """An ``on_action`` hook for :class:`~sdpipe_cli.stage.PipelineStage`."""

    def __init__(self, factor: float = 1.0, compute_ms: Optional[float] = None,
                 sleep=time.sleep):
        self.factor, self.compute_s, self.sleep = factor, (compute_ms or 0) / 1000.0, sleep
        self.overruns = 0  # actions whose real compute exceeded the modelled budget

    @property
    def active(self) -> bool:
        return self.factor != 1.0 or self.compute_s > 0

    def target(self, action: Action, seconds: float) -> float:
        """Wall time the action must take."""
        if self.compute_s > 0:
            return self.compute_s * self.factor * (2.0 if action.kind == "B" else 1.0)
        return seconds * self.factor

    def __call__(self, action: Action, seconds: float) -> None:
        rest = self.target(action, seconds) - seconds
        if rest > 0:
            self.sleep(rest)
        elif self.compute_s > 0 and rest < 0:
            self.overruns += 1
