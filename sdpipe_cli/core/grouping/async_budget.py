"""The run's budget under asynchronous 1F1B (``pipeline.schedule=async_1f1b``): a round per update.

Each stage of each pipeline updates its weights after every micro-batch's backward, and reports
ready after each of its updates, numbered consecutively: ``rounds_per_iteration`` rounds per
iteration (m). Groups, windows and connectivity work exactly as for the flushed schedules, so
``connect_every`` counts updates, as the reference's bound does.

What changes is where global syncs (and the end of the run) may fall. A pipeline with
micro-batches in flight has no single model to average, evaluate or save, so a global sync must
come at a drained point: an iteration boundary where all stages of the pipeline have finished
every micro-batch forwarded before it. Only the pipeline's first stage can still move that point,
because it decides at the start of each iteration (:meth:`AsyncPlanner.begin`) whether that
iteration ends the pipeline's current segment; the later stages learn it from the control message
before their own forwards of that iteration. So a declared global sync gets each pipeline's
target lazily: at the pipeline's next ``begin``, that iteration becomes its last, and every
stage's round after its last update of that iteration is the global round (no stage can have
reported that update earlier: it needs the iteration's forwards, which come after the
``begin``). The decision of that round carries ``stop`` at the end of the run.

The budget counts iterations begun by the first stages. A global sync declared while some
pipeline is in ``begin`` makes that iteration its last, and every other pipeline does one more
iteration (until its next ``begin``), so the run ends after exactly ``total_iterations`` when the
last global sync is declared with ``live - 1`` of them to spare. ``global_history`` keeps, as for
the flushed schedules, the last iteration of each pipeline before each global sync.
"""

from __future__ import annotations

from sdpipe_cli.core.grouping.budget import no_global_pending
from sdpipe_cli.core.grouping.state import RunState


class AsyncPlanner:
    """Global syncs and the end of the run at drained points; the budget counts iterations begun."""

    def __init__(self, run: RunState, *, rounds_per_iteration: int):
        if rounds_per_iteration < 1:
            raise ValueError("rounds_per_iteration must be >= 1")
        self.run, self.rounds_per_iteration = run, rounds_per_iteration
        self._begun = {p: 0 for p in range(run.P)}  # iterations begun by each first stage
        self._begun_total = 0

    # -- progress --------------------------------------------------------------------------------
    def iterations_done(self) -> int:
        """Pipeline-iterations begun so far (left pipelines keep what they did)."""
        return self._begun_total

    def begun(self) -> dict[int, int] | None:
        """Iterations begun by each pipeline's first stage (a copy)."""
        return dict(self._begun)

    def readied(self, pipeline: int, iteration: int, now: float) -> None:
        """Nothing to count: the budget grows in :meth:`begin` alone."""

    def release(self, s: int, p: int, iteration: int, now: float) -> None:
        """A round per update: a stage goes on with its next micro-batches once its own round
        is decided, without waiting for the pipeline's other stages to be."""
        self.run.forecast.release(s, p, now)

    def begin(self, pipeline: int, iteration: int) -> bool:
        """The first stage of ``pipeline`` is about to start ``iteration``: whether that iteration
        ends its segment (a global sync after it)."""
        run = self.run
        if run.finished:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration} after the run ended")
        if pipeline not in run.live:
            raise ValueError(f"pipeline {pipeline} has left")
        if iteration != self._begun[pipeline]:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration}, "
                             f"expected {self._begun[pipeline]}")
        if pipeline in run.global_at:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration} before the global "
                             "sync it drained for")
        self._begun[pipeline] = iteration + 1
        self._begun_total += 1
        if not run.pending():
            live = len(run.live)
            done = self.iterations_done()
            final = run.time_is_up() or self.budget_ends_within(live - 1)
            periodic = bool(run.global_every) and done >= run.next_global
            while run.global_every and run.next_global <= done:
                run.next_global += run.P * run.global_every
            if periodic and not final and self.budget_ends_within(2 * live - 2):
                periodic = False  # the other pipelines' next iterations would pass the budget
            if final or periodic:
                self._declare(final)
        if run.pending():
            run.global_at[pipeline] = (iteration + 1) * self.rounds_per_iteration - 1
            run.global_history[-1][pipeline] = iteration
            return True
        return False

    # -- departures, rejoining, resuming ---------------------------------------------------------
    def give_back(self, pipeline: int, recorded: int | None = None) -> int:
        """The budget counts iterations begun: a pipeline that left keeps those every stage
        finished (all their rounds decided) and, given ``recorded``, its last stage reported;
        it would go on from the next one."""
        finished = (min(self.run.decided[pipeline]) + 1) // self.rounds_per_iteration
        if recorded is not None:
            finished = min(finished, recorded)
        self._begun_total -= self._begun[pipeline] - finished
        self._begun[pipeline] = finished
        return finished

    def hand_over(self, owed: int) -> None:
        """Targets are set at each pipeline's next begin(), so a pending global sync owes nothing
        to hand over; a pipeline lost while one is pending takes the iterations it had begun."""

    def restart_pipeline(self, pipeline: int, iterations: int) -> None:
        """Pipeline ``pipeline`` has done ``iterations`` iterations (drained: every stage made all
        its updates)."""
        self._begun_total += iterations - self._begun[pipeline]
        self._begun[pipeline] = iterations
        self.run.last_ready[pipeline] = [iterations * self.rounds_per_iteration - 1] * self.run.S
        self.run.decided[pipeline] = list(self.run.last_ready[pipeline])

    def admitted(self, pipeline: int) -> None:
        """A healed pipeline is live again: it begins where :meth:`restart_pipeline` put it."""

    def restart(self, iterations: dict[int, int]) -> None:
        """Continue from a checkpoint taken at a global sync (see ``resume``)."""
        for p, k in iterations.items():
            self.restart_pipeline(p, k)
        no_global_pending(self.run, self.iterations_done())

    def resumed(self) -> None:
        """Nothing to declare: the budget is checked in begin(), the only place where it grows."""

    # -- declaring global syncs ------------------------------------------------------------------
    def budget_ends_within(self, iterations: int) -> bool:
        total = self.run.total_iterations
        return total is not None and self.iterations_done() + iterations >= total

    def declare(self) -> None:
        # The budget is checked in begin(), the only place where it grows; here only the clock
        # and a stop request can call for the last global sync.
        run = self.run
        if run.finished:
            return
        if run.pending():
            if not run.global_closed and not run.final and run.time_is_up():
                run.final = True
            return
        if run.time_is_up():
            self._declare(final=True)

    def _declare(self, final: bool) -> None:
        """A global sync is due; pipelines get their targets at their next begin()."""
        run = self.run
        run.final = final
        run.global_closed = set()
        run.global_at = {}
        run.global_history.append({})
        for st in run.stages:
            st.global_pending = True
