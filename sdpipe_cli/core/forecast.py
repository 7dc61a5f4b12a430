"""When each replica will next be ready: what the group policy's rounds wait for. Pure: times come in.

A replica's ready signals are spaced by its compute *and* by how long its last round made it wait,
and the wait is the policy's own doing: the same replica that waited 100 ms for a round last time
may wait nothing this time. Predicting the next signal from the spacing of the last ones (as an
average interval) therefore inherits the noise of every past decision. The scheduler knows when it
*released* a replica (emitted the decision it waited for), so the forecast predicts from there:
next ready = release + the replica's compute time, where the compute time is the median of its
last :data:`BUSY_SAMPLES` release-to-ready spans. A random straggle (one iteration 3x slower) is
one outlier in three and moves the median not at all; a lasting change of speed moves it after two.

Two more facts per replica:

* its **pace**, a moving average of the interval between its ready signals: how fast it goes
  overall, waits included. The policy compares paces to tell slow replicas from fast ones;
* its **error**: a moving average of how far its ready signals land from their forecast, over the
  signals that were not straggles (off by less than :data:`OUTLIER` x its compute time). A round
  waits for a late replica about as long as its forecasts usually miss by, no longer.

For the flushed schedules (1F1B, GPipe) every stage of a pipeline waits, within its next
iteration, for the others' data, so the pipeline is released when the last of its stages is; the
policy decides that and calls :meth:`Forecast.release` for each stage then.
"""

from __future__ import annotations

import heapq
from typing import Optional

__all__ = ["Forecast", "BUSY_SAMPLES", "OUTLIER", "PACE_WEIGHT"]

PACE_WEIGHT = 0.3  # weight of the newest interval in a replica's moving-average pace
BUSY_SAMPLES = 3  # release-to-ready spans whose median is a replica's compute time
OUTLIER = 0.5  # a ready signal off its forecast by more than this x compute time was a straggle
ERROR_WEIGHT = 0.3  # weight of the newest miss in a replica's moving-average error

Key = tuple[int, int]  # (stage, pipeline)


class Forecast:
    """Pace, compute time, forecast and error of every replica, and per stage a heap of the
    forecasts so that a round finds the replicas due soon without a pass over all of them."""

    def __init__(self, stages: int):
        self.pace: dict[Key, float] = {}  # moving-average interval between ready signals (s)
        self.arrived: dict[Key, float] = {}  # last ready signal
        self._spans: dict[Key, list[float]] = {}  # the last BUSY_SAMPLES release-to-ready spans
        self._busy: dict[Key, float] = {}  # their median
        self._released: dict[Key, float] = {}
        self._due: dict[Key, float] = {}  # forecast of the next ready signal (None: ready now)
        self._error: dict[Key, float] = {}
        self._heaps: list[list[tuple[float, int]]] = [[] for _ in range(stages)]

    def ready(self, stage: int, pipeline: int, now: float) -> None:
        """The replica reported ready at ``now``: fold it into its pace, compute time and error."""
        key = (stage, pipeline)
        if key in self.arrived:
            interval = now - self.arrived[key]
            self.pace[key] = (interval if key not in self.pace else
                              (1 - PACE_WEIGHT) * self.pace[key] + PACE_WEIGHT * interval)
        self.arrived[key] = now
        due = self._due.pop(key, None)  # its heap entry is stale from now on
        busy = self._busy.get(key)
        if due is not None and busy is not None:
            miss = abs(now - due)
            if miss < OUTLIER * busy:
                error = self._error.get(key)
                self._error[key] = miss if error is None else (
                    (1 - ERROR_WEIGHT) * error + ERROR_WEIGHT * miss)
        start = self._released.pop(key, None)
        if start is not None:
            spans = self._spans.setdefault(key, [])
            spans.append(now - start)
            if len(spans) > BUSY_SAMPLES:
                del spans[0]
            self._busy[key] = sorted(spans)[len(spans) // 2]

    def release(self, stage: int, pipeline: int, now: float) -> None:
        """The replica goes on computing from ``now``: forecast its next ready signal."""
        key = (stage, pipeline)
        self._released[key] = now
        busy = self._busy.get(key)
        if busy is not None:
            self._due[key] = now + busy
            heapq.heappush(self._heaps[stage], (now + busy, pipeline))

    def expected(self, stage: int, pipeline: int) -> Optional[float]:
        """When the replica's next ready signal is forecast (None: it is ready now, or its compute
        time is not known yet)."""
        return self._due.get((stage, pipeline))

    def error(self, stage: int, pipeline: int) -> Optional[float]:
        """How far its forecasts usually miss (None: not known yet)."""
        return self._error.get((stage, pipeline))

    def forget(self, pipeline: int, stages: int) -> None:
        """The pipeline left or restarts: what it did says nothing about what it will do."""
        for s in range(stages):
            key = (s, pipeline)
            for table in (self.pace, self.arrived, self._spans, self._busy, self._released,
                          self._due, self._error):
                table.pop(key, None)

    def due_by(self, stage: int, horizon: float, skip, room: int) -> list[tuple[float, int]]:
        """Up to ``room`` replicas of ``stage`` forecast to be ready by ``horizon``, with their
        forecasts, earliest first, leaving out those for which ``skip(pipeline)`` holds. Reads
        the stage's heap: entries superseded by a ready signal are dropped for good, the others
        are put back."""
        heap, found, kept = self._heaps[stage], [], []
        due, pop = self._due, heapq.heappop
        while heap and heap[0][0] <= horizon and len(found) < room:
            t, q = pop(heap)
            if due.get((stage, q)) != t:
                continue
            kept.append((t, q))
            if not skip(q):
                found.append((t, q))
        for entry in kept:
            heapq.heappush(heap, entry)
        return found
