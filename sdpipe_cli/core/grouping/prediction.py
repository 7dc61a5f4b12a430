"""Who an open round waits for, beyond the replicas already there, and how long.

With ``patience > 0`` the policy forecasts each replica's next ready signal
(:mod:`~sdpipe_cli.core.forecast`), so a round also waits for the replicas forecast within
``patience`` x the opener's pace: replicas at the same pace (a homogeneous cluster) meet in full
groups, as all-reduce would, while a replica forecast far later (a straggler) is not waited for.

cost_aware waits less, and only where waiting is cheap: for replicas about as fast as the fastest
one waiting (:data:`AWAIT_PACE_RATIO`), each only a little past its forecast
(:meth:`Prediction.slack`); a fast replica that joins a round opened by a slow one narrows what
the round waits for (:meth:`Prediction.narrow`).

A stage's first round waits for every live replica (:meth:`Prediction.open`), and replicas with
nothing measured yet are forecast from their peers (:mod:`~sdpipe_cli.core.forecast`), so that a
homogeneous cluster is in full rounds from its first iteration.

Replicas that share a machine share its stalls: when the opener of a round (or a replica joining
it) came later than its own forecast by a usual miss, the others are likely as late, and the round
awaits them that much later; when it came early (an evaluation quicker than the last), it awaits
those forecast that much later too (:attr:`StageState.drift`). Without it, the first one there
finds the others overdue past their slack and goes on alone, and each of them after it.
"""

from __future__ import annotations

from sdpipe_cli.core.grouping.connectivity import Connectivity
from sdpipe_cli.core.grouping.state import RunState

# cost_aware: a round waits for a predicted replica only if its speed (its own compute time, a
# moving average: Forecast.speed) is at most this many times the fastest member's present. Equal
# replicas on a shared CPU stay within it (their averages differ by a few percent); a replica much
# slower is a slow one, whose phase drifts from the others', and waiting for it held its peers to
# its pace (a 1.3x replica's peers waited 40-80 ms of their 224 at one time in two rounds, when
# forecasts as noisy as a shared CPU's widened the band to a quarter). Not 1.1: a pipeline's
# measured speed is further from its peers' than its device's ratio says (1.06x devices measured
# 1.08-1.11x in the simulator), so replicas 1.06-1.15x slower fell on either side of 1.1 from one
# round to the next, and each time one fell outside, the round went without it and it spent
# rounds alone: with one pipeline 1.15x slower, mean group 2.43-2.51 and 1.028x all-reduce's loss
# in real runs, against 3.05-3.14 and 0.997x at 1.15 for the same samples/s (three seeds,
# docs/results/mild_straggler_await_ratio.md); simulated, only ratios under 1.25 change.
AWAIT_PACE_RATIO = 1.15
# cost_aware: an opener not alike the stage's fastest replica waits for the replicas forecast
# within this share of its own iteration (see Prediction._behind; half an iteration cost a 1.3x
# replica a tenth of its iterations, and its run's loss no less)
BEHIND_REACH = 0.25
# cost_aware: a round waits for a replica past its forecast SLACK_ERRORS x as long as its forecasts
# usually miss by, within SLACK_FLOOR and LATE_SLACK x the opener's pace (while the miss is not known
# yet, up to the round's patience); later, it is straggling this time and the round goes on without it
LATE_SLACK = 0.2
SLACK_ERRORS = 3.0
SLACK_FLOOR = 0.05
# cost_aware: replicas predicted within this x the opener's pace arrive "with" it (jitter)
JITTER_BAND = 0.25


class Prediction:
    """Sets an open round's ``expect``, ``horizon``, ``slowest_expected`` and ``last_due``."""

    def __init__(self, run: RunState, links: Connectivity, *, patience: float, cost_aware: bool,
                 max_group: int):
        self.run, self.links = run, links
        self.patience, self.cost_aware, self.max_group = patience, cost_aware, max_group

    def joined(self, stage: int, pipeline: int, now: float) -> None:
        """A replica joined the open round of ``stage`` at ``now`` (not parked at a global sync):
        under cost_aware one it awaited that came later than its forecast (by a usual miss)
        makes it await the others as late, within its ``cap``, and a faster one than the round
        waits for narrows it."""
        st = self.run.stages[stage]
        if st.slowest_expected and st.window_end is not None:  # cost_aware, awaiting someone
            missed = self.run.forecast.missed(stage, pipeline)
            if pipeline in st.expect and missed > st.drift:
                # a late joiner: the replicas still awaited are likely as late
                later = max(0.0, missed) - st.late
                st.drift = missed
                st.horizon = min(st.cap, st.horizon + later)
            pace = self.run.forecast.speed(stage, pipeline)
            due = st.last_due - st.early
            if pace is not None and (AWAIT_PACE_RATIO * pace < st.slowest_expected
                                     or now + self.patience * pace < due):
                self.narrow(stage, pace, now)

    def open(self, s: int, opener: int, opened: float, ready: dict, parked: set[int]) -> None:
        """A round of stage ``s`` opens (its ``window_end`` set): it may close without everyone
        after the opener's window, once the replicas forecast (with ``patience``) to be ready
        within patience x the opener's pace are there (as much later as the opener came early,
        see below), or at that horizon (``cap``) if one of them is late.
        ``ready`` and ``parked`` (at the pending global sync) are the replicas waiting now, two
        disjoint sets, passed apart because their union would be a pass over every parked
        replica per round.

        cost_aware waits less, and only where waiting is cheap: for replicas about as fast as the
        fastest one waiting (:data:`AWAIT_PACE_RATIO`; see :meth:`narrow`), each only a little
        past its forecast (:meth:`slack`; later, it is straggling this time). Replicas forecast
        within :data:`JITTER_BAND` x pace are the round's core; it waits for the later ones only
        if the core is a minority of the live replicas (or exactly half, without the fastest
        one): a lone replica half an iteration out of phase waits for the others and is in phase
        from then on, where the majority waiting for it would keep the phases apart (both sides
        waiting for each other shift together).

        A stage's first round waits for every live replica (:meth:`_first`). The others are
        awaited as late (or early) as the opener came against its own forecast (``drift``, from
        :meth:`Forecast.missed`), and as late as a later joiner came (:meth:`joined`).
        """
        run = self.run
        st = run.stages[s]
        window_end = st.window_end
        assert window_end is not None  # the round opened its window first
        st.horizon, st.expect, st.slowest_expected = window_end, frozenset(), 0.0
        st.cap, st.drift = window_end, 0.0
        if not self.patience:
            return
        if st.round_no == 0:
            self._first(s, opened, ready, parked)
            return
        pace = run.pace.get((s, opener))
        if pace is None:
            return
        st.horizon = st.cap = opened + self.patience * pace
        present = len(ready) + len(parked)
        room = self.max_group - present if self.max_group else len(run.live)
        if not self.cost_aware:
            found = self._predicted(s, st.horizon, ready, parked, float("inf"), room)
            st.expect = frozenset(q for _, q in found)
            return
        forecast = run.forecast
        st.drift = forecast.missed(s, opener)
        own = forecast.speed(s, opener) or pace
        quickest = min([own] + [x for q in ready if (x := forecast.speed(s, q)) is not None])
        awaited = self._predicted(s, st.horizon + st.early, ready, parked,
                                  AWAIT_PACE_RATIO * quickest, room)
        band = self.band(s, [opener] + [q for _, q in awaited], own)
        # every live replica is forecast: the window's blind wait for one that is not need not
        # be longer than the forecasts are imprecise (a replica left alone, whose window grew,
        # waited for nobody up to window_max at each of its rounds)
        if band > 0:  # (nothing measured takes time: the window stays)
            st.window_end = min(window_end, opened + band)
        behind = self._behind(s, own, band)
        reach = BEHIND_REACH * own if behind else band
        core = [(t, q) for t, q in awaited if t <= opened + reach + st.early]  # a prefix
        half = 2 * (present + len(core)) - len(run.live)  # > 0: a majority; 0: exactly half
        if behind or half > 0 or (half == 0 and self._fastest_among(s, ready, parked, core)):
            awaited = core
        st.expect = frozenset(q for _, q in awaited)
        if awaited:
            late, st.last_due = [q for _, q in awaited], awaited[-1][0]
            # an evaluation ahead lengthens the iteration that patience is a share of
            st.cap += self.patience * run.forecast.longest_pause(s, late)
            st.horizon = min(st.cap, st.last_due + st.late + self.slack(s, late, pace))
            st.slowest_expected = max(forecast.speed(s, q) or own for q in late)

    def _first(self, s: int, opened: float, ready: dict, parked: set[int]) -> None:
        """The first round of stage ``s`` waits for every live replica, as all-reduce's first
        step would, for at most patience x the time the run took to get here: nothing is known
        of anyone's pace yet, equal replicas started together and come within moments (taken
        apart, they would go on out of phase for rounds), and a slow one costs the others once
        (a dead one is removed by supervision). Only with patience; a round of ``max_group``
        replicas still closes at once."""
        run, st = self.run, self.run.stages[s]
        st.expect = frozenset(q for q in run.live if q not in ready and q not in parked)
        st.horizon = opened + self.patience * max(0.0, opened - run.started)

    def slack(self, s: int, replicas: list[int], pace: float) -> float:
        """How long past their forecasts a round waits for ``replicas`` of stage ``s``:
        :data:`SLACK_ERRORS` x the largest of their usual misses, within :data:`SLACK_FLOOR` and
        :data:`LATE_SLACK` x ``pace`` (the round's fastest member's); patience (at least
        :data:`LATE_SLACK`) x the span while a miss is not known (forecasts from peers, at the
        start and at a first evaluation: as at a stage's first round, nothing tells a late
        replica from a straggler, and the round's patience bounds the cost). Precise forecasts
        (a steady GPU cluster) make late replicas stragglers within a few milliseconds; noisy
        ones (shared CPUs) earn more patience.
        Before a known pause (an evaluation) the bounds grow with the pause, whose length varies
        in proportion to it."""
        forecast = self.run.forecast
        span = pace + forecast.longest_pause(s, replicas)
        error = forecast.worst_error(s, replicas)
        if error is None:
            return max(self.patience, LATE_SLACK) * span
        return min(LATE_SLACK * span, max(SLACK_FLOOR * pace, SLACK_ERRORS * error))

    def narrow(self, s: int, joined: float, now: float) -> None:
        """cost_aware: a replica of pace ``joined`` joined the open round of stage ``s`` at
        ``now``, faster than the round's wait allows: some replica it waits for is slower than
        :data:`AWAIT_PACE_RATIO` x ``joined``, or its horizon is later than the joiner's own
        would be (``now`` + patience x ``joined``).

        A round opened by a slow replica waits for the faster ones it predicted, which is cheap:
        the slow one waits. Once a fast one is in, waiting for another slow one, or for a fast
        one's *next* iteration (inside the slow opener's long horizon), would hold the fast one,
        the costly way round; so the round keeps only the replicas its fastest member would have
        waited for had it opened the round, each only :meth:`slack` (at that member's pace) past
        its forecast. (A round's members at its opening bound its pace the same way, in
        :meth:`open`.) Equal replicas are all within the ratio: their rounds are unchanged."""
        st, due, speed = self.run.stages[s], self.run.forecast.expected, self.run.forecast.speed
        bound, horizon = AWAIT_PACE_RATIO * joined, now + self.patience * joined
        keep, late, latest = [], [], 0.0
        for q in st.expect:
            if q in st.waiting:
                keep.append(q)
                continue
            t = due(s, q)
            if (speed(s, q) or joined) <= bound and (t is None or t - st.early <= horizon):
                keep.append(q)
                if t is not None:
                    late.append(q)
                    latest = max(latest, t)
        st.expect, st.cap = frozenset(keep), min(st.cap, horizon)
        st.slowest_expected = max((speed(s, q) or joined for q in late), default=0.0)
        st.last_due = latest
        if late:
            st.horizon = min(st.horizon, latest + st.late + self.slack(s, late, joined))

    def band(self, s: int, replicas: list[int], own: float) -> float:
        """How far apart (seconds) the ready signals of equal replicas of stage ``s`` fall, by
        the precision of their forecasts: :data:`SLACK_ERRORS` x the largest usual miss of
        ``replicas`` (the opener, then the ones forecast), within :data:`SLACK_FLOOR` x the
        opener's iteration ``own`` and :data:`JITTER_BAND` x that iteration and any known pause
        ahead (JITTER_BAND while a miss is not known; an evaluation's length varies more than an
        iteration's). A round waits for the replicas forecast within it whatever their phase,
        and that is all it costs its members: a replica 1.3x slower is forecast 0.3 of an
        iteration after a fast opener, outside where forecasts hold to a few percent, so the
        fast ones go on (waiting for it would make them run at its pace, as all-reduce's do),
        where a fixed quarter of an iteration waited for every replica up to 1.25x slower."""
        forecast = self.run.forecast
        span = own + forecast.longest_pause(s, replicas)
        error = forecast.worst_error(s, replicas)
        if error is None:
            return JITTER_BAND * span
        return min(JITTER_BAND * span, max(SLACK_FLOOR * own, SLACK_ERRORS * error))

    def tolerance(self) -> float:
        """How many times slower than the stage's fastest replica a replica may be and still be
        waited for, the widest over the stages: 1 + patience without cost_aware (a round waits for
        whoever is forecast within patience x the opener's pace); under it, replicas alike
        (:data:`AWAIT_PACE_RATIO`) within the fastest replica's :meth:`band` of its iteration
        (:data:`JITTER_BAND` while nothing is measured). Slower replicas go at their own pace."""
        if not self.cost_aware:
            return 1.0 + self.patience
        widest = 0.0
        for s in range(self.run.S):
            fastest = self.links.fastest(s)
            own = self.run.forecast.speed(s, fastest)
            widest = max(widest, JITTER_BAND if not own else self.band(s, [fastest], own) / own)
        return min(AWAIT_PACE_RATIO, 1.0 + widest)

    def _behind(self, s: int, own: float, band: float) -> bool:
        """Whether an opener of iteration ``own`` is slower than the stage's fastest live
        replica by more than :data:`AWAIT_PACE_RATIO` (or than ``band``, where that is
        narrower): then it does not wait to fall in phase with the others
        (a replica of their speed out of phase does, once, and is in phase from then on): its
        phase moves on from theirs every iteration, and it would wait at every round, up to
        one of their iterations each time (a 1.3x replica lost a quarter of its speed so).
        It waits for the replicas forecast within :data:`BEHIND_REACH` of its own iteration:
        the faster the others, the more of its rounds that finds them in (a third at 1.3x, all
        at 4x), at a cost of at most that share of its time, and of about 1 % of the run's
        samples/s whatever the ratio; and the rounds due to connect the stage hold it until
        it has met another component."""
        fastest = self.run.forecast.speed(s, self.links.fastest(s))
        return fastest is not None and own > min(AWAIT_PACE_RATIO * fastest, fastest + band)

    def _fastest_among(self, s: int, ready: dict, parked: set[int], core) -> bool:
        """Whether the fastest replica of stage ``s`` is waiting now or among ``core``."""
        fastest = self.links.fastest(s)
        return fastest in ready or fastest in parked or any(q == fastest for _, q in core)

    def _predicted(self, s: int, horizon: float, ready: dict, parked: set[int], slowest: float,
                   room: int) -> list[tuple[float, int]]:
        """Up to ``room`` replicas of stage ``s`` with their predicted ready times, earliest
        first, that are neither ``ready`` nor ``parked`` and are predicted to be ready by
        ``horizon``, with a pace of at most ``slowest``. Reads the stage's sorted forecasts
        without a pass over every replica."""
        return self.run.forecast.due_by(s, horizon, room, slowest, (ready, parked))
