"""The run's budget: when global syncs fall, and where the run ends. Two planners, chosen when
the scheduler is built, because the schedules differ in where a consistent model exists.

* :class:`FlushedPlanner` (1F1B, GPipe): every iteration ends drained, so the policy may place a
  global sync at any pipeline's any iteration. It declares one every ``global_every``
  iterations of an average pipeline, giving each pipeline as many iterations as fit before the
  slowest one's next (cost_aware), and places the last one so that the run ends after exactly
  ``total_iterations`` pipeline-iterations, as early as that budget allows.
* ``AsyncPlanner`` (asynchronous 1F1B; :mod:`sdpipe_cli.core.grouping.async_budget`): a pipeline
  with micro-batches in flight has no single model to average, evaluate or save, so a global
  sync must come at a drained point, which only the pipeline's first stage can still choose, at
  the start of each iteration (``AsyncPlanner.begin``). A declared global sync gets each
  pipeline's target lazily, there.

Both also say when a replica is *released* (its forecast starts), and what a lost pipeline keeps
of the budget, since both depend on the schedule too.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from sdpipe_cli.core.grouping.state import RunState

# cost_aware: most iterations a pipeline is given before a global sync (a faster one waits)
MAX_AHEAD = 8
END_CHECKS = 32  # passes over the pipelines, per P iterations, looking for the run's end


class Planner(Protocol):
    """What the scheduler and its parts ask of a planner (:class:`FlushedPlanner` or
    ``AsyncPlanner``), chosen when the scheduler is built."""

    rounds_per_iteration: int

    def iterations_done(self) -> int: ...
    def begun(self) -> dict[int, int] | None: ...
    def readied(self, pipeline: int, iteration: int, now: float) -> None: ...
    def release(self, s: int, p: int, iteration: int, now: float) -> None: ...
    def begin(self, pipeline: int, iteration: int) -> bool: ...
    def give_back(self, pipeline: int, recorded: int | None = None) -> int: ...
    def hand_over(self, owed: int) -> None: ...
    def restart_pipeline(self, pipeline: int, iterations: int) -> None: ...
    def admitted(self, pipeline: int) -> None: ...
    def restart(self, iterations: dict[int, int]) -> None: ...
    def resumed(self) -> None: ...
    def declare(self) -> None: ...


class FlushedPlanner:
    """Global syncs and the end of the run for the flushed schedules: a round per iteration."""

    rounds_per_iteration = 1

    def __init__(self, run: RunState, *, cost_aware: bool):
        P = run.P
        self.run, self.cost_aware = run, cost_aware
        self._high = {p: -1 for p in range(P)}  # max(last_ready[p]), kept as events come
        self._done = 0  # sum of _high[p] + 1: iterations_done() without a pass over pipelines
        self._latest: dict[int, float] = {}  # pipeline -> last ready time at its _high iteration
        self._end_checked = -P  # iterations done at the last look for the end

    # -- progress --------------------------------------------------------------------------------
    def iterations_done(self) -> int:
        """Pipeline-iterations started so far (left pipelines keep what they did)."""
        return self._done

    def begun(self) -> dict[int, int] | None:
        return None  # a round per iteration: nothing is begun apart from its rounds

    def readied(self, pipeline: int, iteration: int, now: float) -> None:
        """A stage of ``pipeline`` is ready for ``iteration`` at ``now``."""
        if iteration > self._high[pipeline]:
            self._done += iteration - self._high[pipeline]
            self._high[pipeline] = iteration
        if iteration == self._high[pipeline]:
            self._latest[pipeline] = now  # when the pipeline last reached its newest iteration

    def release(self, s: int, p: int, iteration: int, now: float) -> None:
        """Stage ``s`` of pipeline ``p`` got its decision for ``iteration``. In the flushed
        schedules each stage's next iteration waits for data from the others, so the pipeline
        goes on (and its forecasts start) when the last of its stages got its decision, after
        an evaluation if one is due there."""
        run = self.run
        if min(run.decided[p]) >= iteration:
            pause = run.pauses_after(iteration)
            for x in range(run.S):
                run.forecast.release(x, p, now, pause)

    def begin(self, pipeline: int, iteration: int) -> bool:
        raise ValueError("begin() is for the asynchronous schedules (AsyncGroupScheduler)")

    # -- departures, rejoining, resuming ---------------------------------------------------------
    def give_back(self, pipeline: int, recorded: int | None = None) -> int:
        """A pipeline left: its iterations count up to the last one every stage finished, and the
        next is where it would go on from. ``recorded``: at most this many count, those its record
        covers (its last stage's reports); an iteration whose rounds were decided but which was
        stopped before its report is not counted, and is done again."""
        finished = min(self.run.decided[pipeline])
        if recorded is not None:
            finished = min(finished, recorded - 1)
        if self._high[pipeline] > finished:
            self._done -= self._high[pipeline] - finished
            self._high[pipeline] = finished
        return finished + 1

    def hand_over(self, owed: int) -> None:
        """The last global sync is declared but no stage closed it, and a pipeline that owed
        ``owed`` of its iterations left: the live pipelines do them, the fastest first, so that
        the run still ends after exactly ``total_iterations``. A replica parked at its old target
        goes on (its ready there becomes an ordinary round)."""
        run = self.run
        order = sorted(run.live, key=lambda q: (run.pace.get((0, q), float("inf")), q))
        for i in range(owed if order else 0):
            q = order[i % len(order)]
            run.global_at[q] += 1
            run.global_history[-1][q] = run.global_at[q]
        for st in run.stages:
            st.parked = {q for q in st.parked if st.waiting[q][0] == run.global_at[q]}
            st.free = {q: v for q, v in st.waiting.items() if q not in st.parked}

    def restart_pipeline(self, pipeline: int, iterations: int) -> None:
        """Pipeline ``pipeline`` has done ``iterations`` iterations, one round each."""
        self.run.last_ready[pipeline] = [iterations - 1] * self.run.S
        self.run.decided[pipeline] = [iterations - 1] * self.run.S

    def admitted(self, pipeline: int) -> None:
        """A healed pipeline is live again; its pace is learned anew."""
        self._latest.pop(pipeline, None)

    def restart(self, iterations: dict[int, int]) -> None:
        """Continue from a checkpoint taken right after a global sync (see ``resume``)."""
        for p, k in iterations.items():
            self.restart_pipeline(p, k)
        self._high = {p: max(last) for p, last in self.run.last_ready.items()}
        self._done = sum(self._high.values()) + len(self._high)
        no_global_pending(self.run, self.iterations_done())
        self._end_checked = -self.run.P

    def resumed(self) -> None:
        self.declare()  # a budget that ends within the pipelines' next iterations

    # -- declaring global syncs ------------------------------------------------------------------
    def budget_ends_within(self, iterations: int) -> bool:
        total = self.run.total_iterations
        return total is not None and self.iterations_done() + iterations >= total

    def _ahead(self) -> dict[int, int]:
        """How many more iterations each live pipeline does before the next global sync.

        classic: one each, so a fast pipeline waits for the slowest one's next iteration.
        cost_aware: as many as each fits (from its pace) before the slowest one's next iteration
        is predicted to end, so that they all arrive at about the same time and the fast ones
        train instead of waiting. One each while any pace is unknown.
        """
        ahead = {p: 1 for p in self.run.live}
        paces = self._paces() if self.cost_aware and ahead else None
        if paces is None:
            return ahead
        return _fits_by(paces, max(last + pace for last, pace in paces.values()))

    def _paces(self) -> dict[int, tuple[float, float]] | None:
        """Each live pipeline's (when it last reached its newest iteration, pace): its first
        stage's pace (its stages keep one pace over time); None while any is unknown."""
        try:
            return {p: (self._latest[p], self.run.pace[(0, p)]) for p in self.run.live}
        except KeyError:
            return None

    def _ending(self, left: int, done: int) -> bool:
        """Whether the last global sync is due, ``left`` iterations before the budget ends:
        classic, once the live pipelines' next iterations reach it; cost_aware, once it is best
        placed now (:meth:`_last_fits`). That is a pass over the pipelines, made only within
        MAX_AHEAD iterations each of the end, and with many pipelines once per
        ``live // END_CHECKS`` iterations begun (and at each of the last ones): O(1) per event."""
        live = len(self.run.live)
        if not self.cost_aware:
            return left <= live
        every = live // END_CHECKS
        if left > MAX_AHEAD * live or (every > 1 and done - self._end_checked < every
                                       and left > live + every):
            return False
        self._end_checked = done
        return self._last_fits(left)

    def _last_fits(self, budget: int) -> bool:
        """cost_aware: whether the remaining ``budget`` is best placed now, in the last global
        sync: it fits, at least one iteration each and at most :data:`MAX_AHEAD`, before the
        slowest pipeline would end the iteration after its next one.

        Waiting longer cannot end the run sooner. Once the slowest pipeline starts that
        iteration, the run cannot end before it does; and whatever the fast pipelines could not
        fill by then, they would wait for. Declared now, :meth:`_fill` lets a slower pipeline
        wait for them instead (cheap: it holds a small share of the throughput). Declaring
        only when the budget fits before the slowest one's *next* iteration ends would make
        the fast ones wait for up to one of its iterations at the end of every run.
        """
        paces = self._paces()
        if paces is None:
            return self.budget_ends_within(len(self.run.live))
        slowest = max(paces, key=lambda p: (paces[p][0] + paces[p][1], p))
        until = sum(paces[slowest]) + paces[slowest][1]
        return budget <= sum(_fits_by(paces, until).values())

    def _fill(self, budget: int) -> dict[int, int]:
        """The last global sync under cost_aware: ``budget`` iterations, at least one each, each
        further one given to the pipeline that would end it soonest (at most :data:`MAX_AHEAD`),
        so that the run ends as early as the budget allows."""
        paces = self._paces()
        if paces is None:
            return _trim({p: 1 for p in self.run.live}, budget)
        ahead = {p: 1 for p in self.run.live}
        ends = [(last + 2 * pace, p) for p, (last, pace) in paces.items()]
        heapq.heapify(ends)
        for _ in range(budget - len(ahead)):
            if not ends:
                break
            _, p = heapq.heappop(ends)
            ahead[p] += 1
            if ahead[p] < MAX_AHEAD:
                last, pace = paces[p]
                heapq.heappush(ends, (last + (ahead[p] + 1) * pace, p))
        return ahead

    def declare(self) -> None:
        """Declare the next global sync if it is due (at most one pending at a time)."""
        run = self.run
        if run.finished:
            return
        if run.global_at:
            # One pending global sync at a time. Past the time limit it becomes the last one, but
            # only while no stage has closed it: every stage's round must carry the same stop flag.
            if not run.global_closed and not run.final and run.time_is_up():
                run.final = True
            return
        done = self.iterations_done()
        periodic = bool(run.global_every) and done >= run.next_global
        left = None if run.total_iterations is None else run.total_iterations - done
        ending = left is not None and self._ending(left, done)
        if not (periodic or ending or run.time_is_up()):
            return
        ahead = self._ahead()
        final = run.time_is_up() or ending
        while run.global_every and run.next_global <= done:
            run.next_global += run.P * run.global_every
        if periodic and not final and self.budget_ends_within(sum(ahead.values())
                                                              + len(run.live)):
            periodic = False  # the last global sync comes first; keeps the budget exact
        if not (final or periodic):
            return
        if final and not run.time_is_up() and left is not None:
            ahead = self._fill(left) if self.cost_aware else _trim(ahead, left)
        run.final = final
        run.global_closed = set()
        run.global_at = {p: self._high[p] + ahead[p] for p in run.live}
        run.global_history.append(dict(run.global_at))
        for st in run.stages:
            st.global_pending = True


def _fits_by(paces: dict[int, tuple[float, float]], until: float) -> dict[int, int]:
    """The iterations each pipeline ends by ``until`` at its pace: at least one, at most
    :data:`MAX_AHEAD`."""
    return {p: min(MAX_AHEAD, max(1, int((until - last) / pace + 1e-9)))
            for p, (last, pace) in paces.items()}


def _trim(ahead: dict[int, int], budget: int) -> dict[int, int]:
    """``ahead`` cut down (the most first) to sum to ``budget``, keeping one each."""
    ahead = dict(ahead)
    while sum(ahead.values()) > budget:
        p = max(ahead, key=lambda q: (ahead[q], q))
        if ahead[p] == 1:
            break
        ahead[p] -= 1
    return ahead


def no_global_pending(run: RunState, done: int) -> None:
    """After a resume from a checkpoint (taken at a global sync), with ``done`` iterations done:
    nothing pending, the next periodic global sync after ``done``."""
    run.next_global = run.P * run.global_every
    while run.global_every and run.next_global <= done:
        run.next_global += run.P * run.global_every
    run.global_at, run.final, run.finished, run.global_history = {}, False, False, []
    for st in run.stages:
        st.global_pending = False
