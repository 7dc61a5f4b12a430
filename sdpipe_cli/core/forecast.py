"""When each replica will next be ready: what the group policy's rounds wait for. Pure: times come in.

A replica's ready signals are spaced by its compute *and* by how long its last round made it wait,
and the wait is the policy's own doing: the same replica that waited 100 ms for a round last time
may wait nothing this time. Predicting the next signal from the spacing of the last ones (as an
average interval) therefore inherits the noise of every past decision. The scheduler knows when it
*released* a replica (emitted the decision it waited for), so the forecast predicts from there:
next ready = release + the replica's compute time, where the compute time is the median of its
last :data:`BUSY_SAMPLES` release-to-ready spans. A random straggle (one iteration 3x slower) is
one outlier in three and moves the median not at all; a lasting change of speed moves it after two.

A **known pause** is not a straggle: the workers evaluate after every ``train.eval_every``-th
iteration, and the scheduler knows when. A release followed by one is forecast as compute plus the
replica's last measured pause, and the span, which holds the pause, leaves the compute time, the
pace and the error alone; its miss feeds a pause error of its own. Without this, every replica that
evaluates is overdue by its forecast, and the first one back from an evaluation goes on alone, so
that equal replicas scatter and take several rounds to meet again.

A replica that has measured nothing yet (its compute time at the start of the run, its pause at its
first evaluation) is forecast from its **stage's peers**: the last compute time measured at that
stage, plus how much later than that peer's its own first ready signal came (the workers start
together, so a replica three times slower came two of the peer's iterations later; a replica that
came back after a restart did not start with them, and is forecast like its peers), and the last
pause measured there. Equal replicas start together and evaluate at the same iterations, so the
first one back tells when the others will be. Without it, the first rounds and the first evaluation
scatter equal replicas for several rounds.

Two more facts per replica:

* its **pace**, a moving average of the interval between its ready signals: how fast it goes
  overall, waits included. The policy compares paces to tell slow replicas from fast ones;
* its **error**: a moving average of how far its ready signals land from their forecast, over the
  signals that were not straggles (off by less than :data:`OUTLIER` x its compute time). A round
  waits for a late replica about as long as its forecasts usually miss by, no longer; and the
  signed miss of its last ready signal (:meth:`Forecast.missed`), since replicas sharing a machine
  share its stalls: one late by a usual miss tells that the others are likely as late.

For the flushed schedules (1F1B, GPipe) every stage of a pipeline waits, within its next
iteration, for the others' data, so the pipeline is released when the last of its stages is; the
policy decides that and calls :meth:`Forecast.release` for each stage then.
"""

from __future__ import annotations

from bisect import bisect_left, insort

__all__ = ["Forecast", "BUSY_SAMPLES", "OUTLIER", "PACE_WEIGHT", "PAUSE_WEIGHT"]

PACE_WEIGHT = 0.3  # weight of the newest interval in a replica's moving-average pace
BUSY_SAMPLES = 3  # release-to-ready spans whose median is a replica's compute time
OUTLIER = 0.5  # a ready signal off its forecast by more than this x compute time was a straggle
ERROR_WEIGHT = 0.3  # weight of the newest miss in a replica's moving-average error
PAUSE_WEIGHT = 0.5  # weight of the newest known pause in a replica's moving-average pause
SPEED_WEIGHT = 0.1  # weight of the newest span in a replica's moving-average speed

Key = tuple[int, int]  # (stage, pipeline)


class _Replica:
    """What the forecast knows of one replica (a slotted record: one lookup per ready signal)."""

    __slots__ = ("arrived", "released", "spans", "busy", "due", "error", "pausing", "pause",
                 "pause_error", "ahead", "prior", "first", "missed", "speed")

    def __init__(self) -> None:
        self.arrived: float | None = None  # last ready signal
        self.released: float | None = None  # last release, until its next ready signal
        self.spans: list[float] = []  # the last BUSY_SAMPLES release-to-ready spans
        self.busy: float | None = None  # their median
        self.due: float | None = None  # forecast of the next ready signal (None: ready now)
        self.error: float | None = None
        self.pausing = False  # the last release is followed by a known pause
        self.pause: float | None = None  # moving average of its known pauses (s)
        self.pause_error: float | None = None  # ... and of how far their forecasts missed
        self.ahead: float | None = None  # the pause in the current forecast (own or a peer's)
        self.prior = False  # the current forecast is a peer's measurement, not the replica's own
        self.first: float | None = None  # its first ready signal, if it came at the start
        self.missed = 0.0  # its last ready signal less its forecast, if a usual miss (else 0)
        self.speed: float | None = None  # moving average of its spans (SPEED_WEIGHT)


class Forecast:
    """Pace, compute time, forecast and error of every replica, and per stage its current
    forecasts in order, so that a round finds the replicas due soon without a pass over all of
    them. (A sorted list rather than a heap: a round reads the first few dozen in order, which a
    list gives without popping and pushing them back, and a ready signal removes its replica's
    entry at once, so none is ever stale.)"""

    def __init__(self, stages: int):
        self.pace: dict[Key, float] = {}  # moving-average interval between ready signals (s)
        self._replicas: list[dict[int, _Replica]] = [{} for _ in range(stages)]
        self._due: list[list[tuple[float, int]]] = [[] for _ in range(stages)]  # sorted
        # per stage: the last compute time measured there with its replica's first ready signal,
        # and the last pause (a peer's forecast), and the replicas released without a forecast
        # because neither was known yet
        self._busy: list[tuple[float, float | None] | None] = [None] * stages
        self._pause: list[float | None] = [None] * stages
        self._unknown: list[set[int]] = [set() for _ in range(stages)]
        self._restarted: set[int] = set()  # pipelines forgotten: they did not start with the rest

    def ready(self, stage: int, pipeline: int, now: float) -> None:
        """The replica reported ready at ``now``: fold it into its pace, compute time and error.
        (Called once per replica and round: the policy's hot path.)"""
        r = self._replicas[stage].get(pipeline)
        if r is None:
            r = self._replicas[stage][pipeline] = _Replica()
        paused = r.pausing  # set with ``released`` by release(), cleared with it by _paused()
        if r.arrived is not None and not paused:
            key, interval = (stage, pipeline), now - r.arrived
            pace = self.pace.get(key)
            self.pace[key] = interval if pace is None else pace + PACE_WEIGHT * (interval - pace)
        if r.first is None and pipeline not in self._restarted:
            r.first = now
        r.arrived = now
        if r.released is None:  # never released, so never forecast either
            return
        due, busy, r.due, r.missed = r.due, r.busy, None, 0.0
        if due is not None:
            self._drop(stage, due, pipeline)
            if r.prior:  # a peer's measurement missed, not this replica's forecast
                due, r.prior = None, False
            elif busy is not None and abs(now - due) < OUTLIER * (busy + (r.ahead or 0.0)):
                r.missed = now - due
        else:
            self._unknown[stage].discard(pipeline)
        if paused:
            self._paused(stage, r, now, due)
            return
        if due is not None:
            miss = abs(now - due)
            if busy is not None and miss < OUTLIER * busy:
                r.error = miss if r.error is None else r.error + ERROR_WEIGHT * (miss - r.error)
        spans = r.spans
        spans.append(now - r.released)
        r.released = None
        if len(spans) > BUSY_SAMPLES:
            del spans[0]
        r.busy = sorted(spans)[len(spans) // 2]
        span = spans[-1]
        if r.speed is None:
            r.speed = r.busy
        elif span < (1 + OUTLIER) * r.busy:  # a straggle is no change of speed
            r.speed += SPEED_WEIGHT * (span - r.speed)
        known, self._busy[stage] = self._busy[stage], (r.busy, r.first)
        if known is None:
            self._from_peers(stage)

    def _paused(self, stage: int, r: _Replica, now: float, due: float | None) -> None:
        """A ready signal after a known pause: learn the pause, not the compute time."""
        r.pausing, r.ahead = False, None
        if r.busy is not None and r.released is not None:
            pause = max(0.0, now - r.released - r.busy)
            r.pause = pause if r.pause is None else r.pause + PAUSE_WEIGHT * (pause - r.pause)
            known, self._pause[stage] = self._pause[stage], pause
            if known is None:
                self._from_peers(stage)
        if due is not None:
            miss = abs(now - due)
            r.pause_error = (miss if r.pause_error is None
                             else r.pause_error + ERROR_WEIGHT * (miss - r.pause_error))
        r.released = None

    def release(self, stage: int, pipeline: int, now: float, pause: bool = False) -> None:
        """The replica goes on computing from ``now``: forecast its next ready signal. ``pause``:
        a known pause (an evaluation) comes first. From its own measurements, else its stage's
        (:meth:`_forecast`)."""
        r = self._replicas[stage].get(pipeline)
        if r is None:
            r = self._replicas[stage][pipeline] = _Replica()
        r.released, r.pausing = now, pause
        if r.due is not None:
            self._drop(stage, r.due, pipeline)
            r.due = None
        self._forecast(stage, pipeline, r)

    def _forecast(self, stage: int, pipeline: int, r: _Replica) -> None:
        """Forecast the released replica from its own measurements, else its stage's last ones
        (:attr:`prior`); with neither, leave it among the stage's unknown ones."""
        busy, pause, r.ahead = r.busy, r.pause if r.pausing else 0.0, None
        prior = busy is None or pause is None
        known = self._busy[stage]
        if busy is None and known is not None:
            busy, first = known
            if first is not None and r.first is not None:
                busy = max(0.0, busy + r.first - first)
        if pause is None:
            pause = self._pause[stage]
        if busy is None or pause is None or r.released is None:
            self._unknown[stage].add(pipeline)
            return
        self._unknown[stage].discard(pipeline)
        r.due, r.ahead, r.prior = r.released + busy + pause, pause if r.pausing else None, prior
        insort(self._due[stage], (r.due, pipeline))

    def _from_peers(self, stage: int) -> None:
        """A compute time or pause was measured at ``stage`` for the first time: forecast the
        replicas released without one. (Once per stage and kind in a run, so one pass each.)"""
        replicas = self._replicas[stage]
        for q in list(self._unknown[stage]):  # released, not forecast: none has a ``due``
            self._forecast(stage, q, replicas[q])

    def _drop(self, stage: int, due: float, pipeline: int) -> None:
        """Remove the replica's forecast ``due`` from the stage's sorted list."""
        entries = self._due[stage]
        del entries[bisect_left(entries, (due, pipeline))]

    def expected(self, stage: int, pipeline: int) -> float | None:
        """When the replica's next ready signal is forecast (None: it is ready now, or neither it
        nor a peer at its stage has measured what the forecast needs yet)."""
        r = self._replicas[stage].get(pipeline)
        return None if r is None else r.due

    def compute(self, stage: int, pipeline: int) -> float | None:
        """Its compute time, the median of its last release-to-ready spans (None: none
        measured yet). The pace holds the waits for its rounds, so replicas that wait for each
        other share one pace whatever their speeds; the compute time stays each one's own, and
        the policy tells slow replicas from fast ones by it (:meth:`speed`)."""
        r = self._replicas[stage].get(pipeline)
        return None if r is None else r.busy

    def speed(self, stage: int, pipeline: int) -> float | None:
        """Seconds per iteration of its own: a moving average of its compute spans
        (:data:`SPEED_WEIGHT`: on a shared CPU one span varies by a tenth, the median of three
        by nearly as much, and comparing those told equal replicas apart), else its pace
        (None: neither known yet). Smaller is faster."""
        r = self._replicas[stage].get(pipeline)
        if r is not None and r.speed is not None:
            return r.speed
        return self.pace.get((stage, pipeline))

    def error(self, stage: int, pipeline: int) -> float | None:
        """How far its forecasts usually miss (None: not known yet)."""
        r = self._replicas[stage].get(pipeline)
        return None if r is None else r.error

    def missed(self, stage: int, pipeline: int) -> float:
        """How much later (> 0) or earlier (< 0) than its own forecast the replica's last ready
        signal came, if by a usual miss rather than a straggle (0: not known, or a straggle)."""
        r = self._replicas[stage].get(pipeline)
        return 0.0 if r is None else r.missed

    def worst_error(self, stage: int, pipelines: list[int]) -> float | None:
        """The largest usual miss among ``pipelines``' replicas of ``stage``, of their pause
        forecasts for those before a known pause (None: one of them is not known yet). One call per
        round rather than one per replica: the policy's hot path."""
        replicas, worst = self._replicas[stage], 0.0
        for q in pipelines:
            r = replicas.get(q)
            error = None if r is None else r.pause_error if r.pausing else r.error
            if error is None:
                return None
            if error > worst:
                worst = error
        return worst

    def longest_pause(self, stage: int, pipelines: list[int]) -> float:
        """The longest known pause ahead of ``pipelines``' replicas of ``stage`` (0: none)."""
        replicas = self._replicas[stage]
        return max((r.ahead for q in pipelines if (r := replicas.get(q)) is not None
                    and r.ahead is not None), default=0.0)

    def forget(self, pipeline: int) -> None:
        """The pipeline left or restarts: what it did says nothing about what it will do (until
        it measures its own, it is forecast from its peers)."""
        self._restarted.add(pipeline)
        for s in range(len(self._replicas)):
            self.pace.pop((s, pipeline), None)
            self._unknown[s].discard(pipeline)
            r = self._replicas[s].pop(pipeline, None)
            if r is not None and r.due is not None:
                self._drop(s, r.due, pipeline)

    def due_by(self, stage: int, horizon: float, room: int, slowest: float = float("inf"),
               exclude: tuple = ()) -> list[tuple[float, int]]:
        """Up to ``room`` replicas of ``stage`` forecast to be ready by ``horizon``, with their
        forecasts, earliest first, leaving out those slower than ``slowest`` (:meth:`speed`) and
        those in any of the containers ``exclude``. A replica whose speed is not known yet passes
        the bound: it is forecast from its peers, like one of them."""
        found: list[tuple[float, int]] = []
        if room <= 0:
            return found
        for entry in self._due[stage]:
            t, q = entry
            if t > horizon:
                break
            if slowest != float("inf") and (self.speed(stage, q) or 0.0) > slowest:
                continue
            for c in exclude:
                if q in c:
                    break
            else:
                found.append(entry)
                if len(found) >= room:
                    break
        return found
