"""The group policy's front: :class:`GroupScheduler` takes the transport's events, hands them to
its parts and returns the decisions they trigger. It holds no rule of its own; see the package
docstring for the rules and the modules beside this one for where each lives."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from sdpipe_cli.core.cadence import time_left
from sdpipe_cli.core.grouping.async_budget import AsyncPlanner
from sdpipe_cli.core.grouping.budget import FlushedPlanner, Planner
from sdpipe_cli.core.grouping.connectivity import Connectivity
from sdpipe_cli.core.grouping.freshness import Freshness
from sdpipe_cli.core.grouping.lineage import Lineage
from sdpipe_cli.core.grouping.membership import Membership
from sdpipe_cli.core.grouping.prediction import Prediction
from sdpipe_cli.core.grouping.rounds import RoundFormer
from sdpipe_cli.core.grouping.state import Decision, RunState, Snapshot, StageView
from sdpipe_cli.core.meetings import average_of, meetings_of
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, updates_per_iteration

POLICIES = ("cost_aware", "classic")


class GroupScheduler:
    """The policy for all stages of a run. Feed it events; it returns the decisions they trigger.

    ``segments``: the units groups form over, each on its own (:mod:`~sdpipe_cli.core.segments`:
    a pipeline's stages, or finer pieces where pipelines are split differently); the policy's
    ``stage`` arguments, decisions and state name a segment by its index (so do a ``group``
    line's ``stage`` and the workers' sync units). Times are seconds from ``clock``. The
    transport calls :meth:`tick` no later than :meth:`next_deadline`. ``evaluate_every``: the
    workers evaluate after every multiple of this many of their iterations
    (``train.eval_every``), a pause the forecast expects. ``rounds_per_iteration`` (asynchronous
    schedules only: a round per update) picks the
    :class:`~sdpipe_cli.core.grouping.async_budget.AsyncPlanner`, whose global syncs fall at
    drained points (:meth:`begin`); without it, the flushed schedules' planner.
    """

    def __init__(self, pipelines: int, segments: int, *, min_group: int = 2, window: float = 0.01,
                 window_min: float = 0.0005, window_max: float = 0.1, connect_every: int = 8,
                 global_every: int = 0, total_iterations: int | None = None,
                 time_limit: float | None = None, patience: float = 0.0,
                 policy: str = "classic", max_group: int = 0, twins: bool = False,
                 stale: str = "average", samples: Sequence[int] = (),
                 suspect_after: float | None = None, evaluate_every: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 rounds_per_iteration: int | None = None):
        if rounds_per_iteration is not None and rounds_per_iteration < 1:
            raise ValueError("rounds_per_iteration must be >= 1")
        if pipelines < 1 or segments < 1 or connect_every < 1 or min_group < 1:
            raise ValueError("pipelines, segments, connect_every and min_group must be >= 1")
        if patience < 0:
            raise ValueError("patience must be >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if max_group < 0 or max_group == 1:
            raise ValueError("max_group must be 0 (no cap) or at least 2")
        if suspect_after is not None and suspect_after <= 0:
            raise ValueError("suspect_after must be positive seconds (or None)")
        if evaluate_every < 0:
            raise ValueError("evaluate_every must be >= 0")
        # connect_every = 1 is all-reduce: every round waits for everyone, under either policy
        cost_aware = policy == "cost_aware" and connect_every > 1
        max_group = max_group if connect_every > 1 else 0  # all-reduce has no cap
        run = RunState(pipelines, segments, global_every=global_every,
                       total_iterations=total_iterations, time_limit=time_limit,
                       evaluate_every=evaluate_every, clock=clock)
        self._run = run
        self._links = Connectivity(run, connect_every=connect_every, cost_aware=cost_aware,
                                   max_group=max_group, suspect_after=suspect_after)
        self._planner: Planner = (
            FlushedPlanner(run, cost_aware=cost_aware) if rounds_per_iteration is None
            else AsyncPlanner(run, rounds_per_iteration=rounds_per_iteration))
        self._lineage = Lineage(pipelines, segments, enabled=twins)
        self._freshness = Freshness(pipelines, segments, stale, samples)
        self._members = Membership(run, self._planner, self._links, self._lineage)
        prediction = Prediction(run, self._links, patience=patience, cost_aware=cost_aware,
                                max_group=max_group)
        self._rounds = RoundFormer(
            run, links=self._links, prediction=prediction, planner=self._planner,
            membership=self._members, lineage=self._lineage, freshness=self._freshness,
            window=window, min_group=min_group,
            window_min=window_min, window_max=window_max, max_group=max_group,
            cost_aware=cost_aware)
        self._planner.declare()  # a budget of at most P iterations ends at iteration 0

    def retarget(self, total_iterations: int) -> None:
        """The budget counted again in iterations of another length (meetings that follow the
        wire change their number of steps); kept once the run's last global sync is declared,
        which every stage must close alike."""
        if not self._run.final:
            self._run.total_iterations = max(total_iterations, 0)

    # -- events ---------------------------------------------------------------------------------
    def ready(self, stage: int, pipeline: int, iteration: int) -> list[Decision]:
        """Stage ``stage`` of ``pipeline`` finished its step for ``iteration`` and waits."""
        run = self._run
        if run.finished:
            raise ValueError(f"ready from stage {stage} of pipeline {pipeline} after the run ended")
        if pipeline not in run.live:
            raise ValueError(f"pipeline {pipeline} has left")
        expected = run.last_ready[pipeline][stage] + 1
        if iteration != expected:
            raise ValueError(f"stage {stage} of pipeline {pipeline}: ready for iteration "
                             f"{iteration}, expected {expected}")
        run.last_ready[pipeline][stage] = iteration
        now = run.clock()
        self._planner.readied(pipeline, iteration, now)
        run.forecast.ready(stage, pipeline, now)
        self._rounds.arrived(stage, pipeline, iteration, now)
        return self.tick()

    def tick(self) -> list[Decision]:
        """Whatever the clock (or an earlier event) decides now."""
        decisions: list[Decision] = []
        while True:
            self._planner.declare()
            new = self._rounds.decide()
            decisions += new
            # Only a global sync that just closed, or a healed pipeline that is live again, can
            # change what the planner declares; group rounds cannot.
            if not any(d.kind == "global" or d.heal for d in new):
                return decisions

    def begin(self, pipeline: int, iteration: int) -> tuple[bool, list[Decision]]:
        """Asynchronous schedules: the first stage of ``pipeline`` is about to start
        ``iteration``: whether that iteration ends its segment (a global sync after it), and the
        decisions this triggers."""
        last = self._planner.begin(pipeline, iteration)
        return last, self.tick()

    def leave(self, pipeline: int, recorded: int | None = None) -> list[Decision]:
        """``pipeline`` is gone (failed or finished): forget it everywhere and unblock its peers.
        Its unfinished iterations are given back to the budget (see the package docstring);
        ``recorded``: the iterations its last stage reported, when known. A round decided just
        before the pipeline was stopped is not an iteration done until it is reported."""
        return self.tick() if self._members.leave(pipeline, recorded) else []

    def rejoin(self, stage: int, pipeline: int) -> list[Decision]:
        """Stage ``stage`` of ``pipeline``, which left, was restarted and waits for a source to
        heal from (see the package docstring)."""
        self._members.rejoin(stage, pipeline)
        return self.tick()

    def resume(self, iterations: dict[int, int]) -> None:
        """Continue from a checkpoint taken right after a global sync, where pipeline p had done
        ``iterations[p]`` iterations: nobody is waiting and every stage is fully connected."""
        self._planner.restart(iterations)
        self._lineage.reset()  # a checkpoint follows a global sync
        self._freshness.reset(self._planner.iterations_done())
        self._planner.resumed()

    def request_stop(self) -> list[Decision]:
        """End the run at the next global sync (as if the time limit had passed)."""
        self._run.stop_requested = True
        return self.tick()

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must be called at the latest (None: only events can change anything)."""
        run = self._run
        times = self._rounds.deadlines()
        if run.time_limit is not None and not run.final and not run.time_is_up():
            times.append(run.started + run.time_limit)  # once past, events take it from there
        return min(times) if times else None

    # -- what the transport and tools read --------------------------------------------------------
    def iterations_done(self) -> int:
        """Pipeline-iterations started (flushed) or begun (asynchronous) so far; left pipelines
        keep what they finished."""
        return self._planner.iterations_done()

    def final_at(self, pipeline: int) -> int | None:
        """``pipeline``'s iteration of the run's last global sync, once its budget declared it
        (None before, for a pipeline not in it, and where the time limit or a stop ends the
        run: its budget then does not)."""
        run = self._run
        return run.global_at.get(pipeline) if run.final and not run.time_is_up() else None

    def pending(self) -> bool:
        """Whether a global sync is declared and some stage has not closed it yet."""
        return self._run.pending()

    def held(self) -> list[tuple[int, int]]:
        """(stage, pipeline) of every replica that sent its ready signal and waits for its
        decision now: in a round that has not closed, or parked at a pending global sync. Such a
        replica is silent because the policy holds it, not because it hangs."""
        return [(s, p) for s, st in enumerate(self._run.stages) for p in st.waiting]

    def expected(self, stage: int, pipeline: int) -> float | None:
        """When ``pipeline``'s replica of ``stage`` is forecast to be ready next (None: it is
        waiting now, or its compute time is not known yet); see :mod:`~sdpipe_cli.core.forecast`."""
        return self._run.forecast.expected(stage, pipeline)

    def pace(self, stage: int, pipeline: int) -> float | None:
        """The replica's mean interval between ready signals (None: not known yet)."""
        return self._run.pace.get((stage, pipeline))

    def window(self, stage: int, pipeline: int) -> float:
        """The replica's adaptive window: how long a round it opens waits at least."""
        return self._rounds.window[(stage, pipeline)]

    @property
    def evaluate_every(self) -> int:
        """The workers' evaluation period the forecast expects pauses at (0: none)."""
        return self._run.evaluate_every

    @property
    def rounds_per_iteration(self) -> int:
        """Rounds per iteration and stage: 1, or asynchronous 1F1B's updates per iteration."""
        return self._planner.rounds_per_iteration

    def fastest(self, s: int) -> int:
        """The live replica of stage ``s`` of the shortest iteration of its own (unknown ones
        last, then by number)."""
        return self._links.fastest(s)

    def tolerance(self) -> float:
        """How many times slower than the fastest pipeline a pipeline may be and still be waited
        for, as the policy stands now (:meth:`.prediction.Prediction.tolerance`): the pace model
        a re-plan predicts with."""
        return self._rounds.prediction.tolerance()

    @property
    def live(self) -> frozenset[int]:
        """The pipelines taking part now (not left, or healed since)."""
        return frozenset(self._run.live)

    @property
    def finished(self) -> bool:
        """The run's last global sync closed at every stage."""
        return self._run.finished

    @property
    def stop_requested(self) -> bool:
        return self._run.stop_requested

    @property
    def resume_at(self) -> Mapping[int, int]:
        """Left pipeline -> the iteration it would go on from (read-only)."""
        return MappingProxyType(self._members.resume_at)

    @property
    def global_history(self) -> list[dict[int, int]]:
        """Every global sync's last iteration per pipeline, oldest first (do not modify)."""
        return self._run.global_history

    def snapshot(self) -> Snapshot:
        """A copy of the state between events, for tests and tools."""
        run, links = self._run, self._links
        fastest = links.fastest if run.live else (lambda s: None)
        stages = tuple(  # positional: this is taken per event by the property tests
            StageView(st.connecting, st.global_pending, st.rounds, st.updates,
                      st.links.components(), st.deadline, fastest(s), dict(st.waiting),
                      frozenset(st.parked), dict(st.free))
            for s, st in enumerate(run.stages))
        return Snapshot(links.token, frozenset(run.live), stages, dict(run.global_at), run.final,
                        run.finished, run.next_global,
                        {p: tuple(k) for p, k in run.last_ready.items()},
                        self._planner.begun())


class AsyncGroupScheduler(GroupScheduler):
    """The policy for asynchronous 1F1B (``pipeline.schedule=async_1f1b``): a round per update,
    ``rounds_per_iteration`` of them per iteration, and global syncs at drained points
    (:mod:`~sdpipe_cli.core.grouping.async_budget` says why and how). Only the planner differs."""

    def __init__(self, pipelines: int, segments: int, *, rounds_per_iteration: int = 1, **kwargs):
        super().__init__(pipelines, segments, rounds_per_iteration=rounds_per_iteration, **kwargs)


def make_policy(cfg: Any, plan: RunPlan, clock: Callable[[], float] = time.monotonic,
                evaluations: bool = True, units: int | None = None,
                spent: float = 0.0) -> GroupScheduler:
    """The policy of a run config with ``sync=sdpipe`` and its plan (the grid, the budget): the
    scheduler process and the simulator (:mod:`sdpipe_cli.core.simulation`) build it here, so
    both run the same one. ``evaluations``: whether the workers pause to evaluate every
    ``train.eval_every`` iterations (the flushed schedules; the simulator models no pauses).
    ``units``: what groups form over, the plan's segments unless given (the simulator models
    rounds per stage). ``spent``: seconds of ``train.time_limit`` earlier legs of the command used.

    With meetings every H > 1 iterations (``sync.every``), the policy's iteration is a meeting:
    its budget, global-sync period (at least 1 / ``sync.wire_share`` meetings) and evaluation
    period are the run's in meetings (:class:`~sdpipe_cli.core.meetings.Meetings`), and an
    evaluation is a pause it expects only
    where every evaluation falls on a meeting; a round waits for its forecast members at most
    ``sync.wire_share`` of a meeting (:meth:`~sdpipe_cli.core.meetings.Meetings.patience`)."""
    y, p = cfg.sync, cfg.pipeline
    meet, share = meetings_of(y), y.wire_share
    evaluate = cfg.train.eval_every if evaluations else 0
    evaluate = meet.period(evaluate) if evaluate % meet.every == 0 else 0
    policy: type[GroupScheduler] = GroupScheduler
    extra: dict[str, int] = {"evaluate_every": evaluate}
    if p.schedule in ASYNC_SCHEDULES:  # a round per update, drained global syncs
        rounds = updates_per_iteration(p.schedule, p.microbatches, p.weight_versions)
        policy, extra = AsyncGroupScheduler, {"rounds_per_iteration": rounds}
    return policy(
        plan.pipelines, units or plan.segments.count, **extra, min_group=y.min_group,
        window=y.window_ms / 1e3, window_min=y.window_min_ms / 1e3, window_max=y.window_max_ms / 1e3,
        connect_every=y.connect_every, global_every=meet.global_period(y.global_every, share),
        patience=meet.patience(y.patience, share), policy=y.policy, max_group=y.max_group,
        suspect_after=y.group_timeout,
        twins=average_of(y) == "weights_grads" and policy is GroupScheduler, stale=y.stale,
        samples=plan.microbatches,
        total_iterations=meet.meetings(plan.budget),
        time_limit=time_left(cfg.train.time_limit, spent), clock=clock)
