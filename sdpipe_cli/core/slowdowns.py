"""Which device slowed down during a run: a pure decision over each worker's compute time.

sdpipe's groups let a slow *pipeline* fall behind without anyone waiting for it, but a slow
*device* inside a pipeline makes its whole pipeline run at that stage's pace, and the split
chosen at the start is wrong from then on. Each worker reports, per iteration, the seconds its
own forwards and backwards took (``busy_s``: compute, an emulated slowdown included, never the
waits for its neighbours), so a slow stage shows in its own time alone: its neighbours wait
longer, but do not compute longer.

A device is judged against two references, so that neither a device slow from the start nor a
machine that slows everyone down is taken for a straggler:

* **its own start**: ``baseline`` is the median of its first ``window`` iterations after
  ``warmup`` (a device slow from the start, ``cluster.slowdown``, is the plan, not a slowdown);
* **its peers**: the same stage in the other pipelines, whose own slowdowns (current over
  baseline) are shared by a cause that slows every replica of the stage (a busy host, a longer
  input); the device's slowdown is divided by their median when that is above 1.

``current`` is the median of the last ``window`` iterations, so one slow iteration is never a
straggler: it takes more than half a window of slow ones. A device whose score (its slowdown,
relative to its peers') stays at ``threshold`` or above for ``window // 2 + 1`` of its reports in
a row becomes a straggler: its peers report on their own time, and a slowdown they share shows
in their reports a moment later. It recovers once the score stays below halfway between 1 and
the threshold as long (hysteresis: no flapping at the edge). From the first slow iteration to
the verdict: ``2 x (window // 2 + 1) - 1`` iterations of the device.

A device an earlier leg of the run found slower (``carried``: ``fault.slowed``, after a re-plan)
starts the leg as a straggler, its baseline taken as its slow speed over that factor: it is
named again only by a further slowdown, and it *recovers* when it is back near its speed before
the slowdown, which is what re-planning back needs.

A slowdown must also matter: the compute it adds (the device's median now less its start) must
be at least :data:`MATTERS` of the device's iteration time (its median ``step_s``, waits
included). A device of a few milliseconds of compute in a pipeline that takes fifty per
iteration is not a straggler even if a busy host doubles it; on a shared CPU that happens all
the time. A straggler stops mattering below half of that (hysteresis again): a device that
adds about that share, as one re-split in place to hold less of the model may, would otherwise
be named and recovered every few iterations as its neighbours' times wander.

No I/O and no clock: the scheduler feeds it the workers' step reports and writes what it says.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Change", "MATTERS", "SlowdownDetector", "carried_of", "slowed_key"]

MATTERS = 0.1  # the least share of its iteration a slowdown must add to the device's compute


def slowed_key(pipeline: int, stage: int) -> str:
    """How ``fault.slowed`` names a device: ``p<pipeline>s<stage>``."""
    return f"p{pipeline}s{stage}"


def carried_of(slowed: Any, pipelines: int, stages: int) -> dict[tuple[int, int], float]:
    """``fault.slowed`` by (pipeline, stage): how much slower earlier legs found each device."""
    return {(p, s): float(slowed.get(slowed_key(p, s), 1.0))
            for p in range(pipelines) for s in range(stages)}


@dataclass(frozen=True)
class Change:
    """A device that became a straggler (``kind="straggler"``) or recovered (``"recovered"``)."""

    kind: str
    pipeline: int
    stage: int
    iteration: int
    slower: float  # current compute time over baseline, relative to the peers'
    busy_s: float  # current (median) compute seconds per iteration
    baseline_s: float


@dataclass
class _Device:
    recent: deque
    seen: int = 0
    baseline: float | None = None
    first: list = field(default_factory=list)
    straggling: bool = False
    against: int = 0  # reports in a row that say the opposite of ``straggling``
    slowdown: float | None = None  # median of ``recent`` over ``baseline``, kept up to date
    steps: deque = field(default_factory=deque)  # its last iterations' times (step_s)
    carried: float = 1.0  # how much slower an earlier leg found it (its baseline's factor)

    def add(self, busy_s: float) -> None:
        self.recent.append(busy_s)
        self.update()

    def update(self) -> None:
        if self.baseline is not None and self.baseline > 0:
            self.slowdown = statistics.median(self.recent) / self.baseline


class SlowdownDetector:
    """Stragglers among ``pipelines`` x ``stages`` devices (see the module's docstring)."""

    def __init__(self, pipelines: int, stages: int, threshold: float = 1.5, window: int = 5,
                 warmup: int = 3, carried: dict[tuple[int, int], float] | None = None):
        if threshold <= 1.0:
            raise ValueError(f"threshold must be above 1, got {threshold}")
        if window < 1 or warmup < 0:
            raise ValueError(f"window must be >= 1 and warmup >= 0, got {window}, {warmup}")
        self.threshold, self.window, self.warmup = threshold, window, warmup
        self.recover_below = 1.0 + (threshold - 1.0) / 2
        self.confirm = window // 2 + 1
        self.pipelines, self.stages = pipelines, stages
        self.carried = {k: float(f) for k, f in (carried or {}).items() if f > 1.0}
        self.devices: dict[tuple[int, int], _Device] = {}
        self._reset_all()

    def _reset_all(self) -> None:
        for p in range(self.pipelines):
            self.reset(p)

    def reset(self, pipeline: int) -> None:
        """Forget a pipeline's devices (a restarted pipeline: new processes, maybe elsewhere)."""
        for s in range(self.stages):
            carried = self.carried.get((pipeline, s), 1.0)
            self.devices[(pipeline, s)] = _Device(deque(maxlen=self.window),
                                                  steps=deque(maxlen=self.window),
                                                  straggling=carried > 1.0, carried=carried)

    def stragglers(self) -> list[tuple[int, int]]:
        """The (pipeline, stage) of every device that is a straggler now."""
        return sorted(k for k, d in self.devices.items() if d.straggling)

    def observe(self, pipeline: int, stage: int, iteration: int, busy_s: float,
                step_s: float | None = None) -> list[Change]:
        """Fold in one iteration's compute time of a device (and the iteration's whole time,
        ``step_s``, if known); what changed because of it."""
        device = self.devices[(pipeline, stage)]
        device.seen += 1
        if device.seen <= self.warmup or busy_s < 0:
            return []
        device.add(busy_s)
        if step_s is not None:
            device.steps.append(step_s)
        if device.baseline is None:
            device.first.append(busy_s)
            if len(device.first) == self.window:
                device.baseline = statistics.median(device.first) / device.carried
                device.update()
            return []
        score = self.score(pipeline, stage)
        if score is None:
            return []
        # the share of its iteration the slowdown adds, against MATTERS (half, to stay named)
        added = (1.0 if not device.steps else (statistics.median(device.recent) - device.baseline)
                 / max(statistics.median(device.steps), 1e-12) / MATTERS)
        turned = (score < self.recover_below or added < 0.5 if device.straggling
                  else score >= self.threshold and added >= 1.0)
        device.against = device.against + 1 if turned else 0
        if device.against < self.confirm:
            return []
        device.straggling, device.against = not device.straggling, 0
        return [Change("straggler" if device.straggling else "recovered", pipeline, stage,
                       iteration, round(score, 4), round(statistics.median(device.recent), 6),
                       round(device.baseline, 6))]

    def own_slowdown(self, pipeline: int, stage: int) -> float | None:
        """The device's compute now over its own start, not relative to its peers (None: no
        baseline yet): what a re-plan needs, where a slowdown its peers share is still one."""
        return self.devices[(pipeline, stage)].slowdown

    def score(self, pipeline: int, stage: int) -> float | None:
        """The device's slowdown over its own start, relative to its peers' (None: no baseline
        yet)."""
        own = self.devices[(pipeline, stage)].slowdown
        if own is None:
            return None
        # the peers' slowdowns since the leg began: a cause they share (a slowdown an earlier
        # leg found on one of them is that device's own)
        others = (self.devices[(p, stage)] for p in range(self.pipelines) if p != pipeline)
        peers = [d.slowdown / d.carried for d in others if d.slowdown is not None]
        shared = statistics.median(peers) if peers else 1.0
        return own / max(shared, 1.0)
