"""What the parts of the group policy share: the decision they answer with, the run's state that
more than one of them reads, and the read-only view the scheduler gives out.

The parts (:mod:`.rounds`, :mod:`.connectivity`, :mod:`.budget`, :mod:`.membership`,
:mod:`.lineage`) each own their own bookkeeping; what two or more of them must see (who is live,
each stage's waiting replicas and round state, the pending global sync, the clock) lives here, in
one :class:`RunState` passed to each of them explicitly, so that no part reaches into another.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

from sdpipe_cli.core.forecast import Forecast
from sdpipe_cli.core.grouping.disjoint import DisjointSet

# Why a round closed, in its decision and its ``group`` line: every live replica was there
# (``all``); the replicas its forecasts awaited came (``expected``); one of them had not by its
# horizon (``late``); nobody was awaited and its window passed (``window``); ``max_group`` were
# there (``cap``); it was held until it merged another component (``connected``); a global sync
# (``global``), the run's last (``stop``).
Reason = Literal["all", "expected", "late", "window", "cap", "connected", "global", "stop"]
REASONS: tuple[Reason, ...] = get_args(Reason)
# Why a live pipeline is not in a group round: awaited (forecast to come by the horizon) and not
# there; ready but past ``max_group``; at its iteration of the pending global sync; not ready
# and not awaited (still computing: a round does not wait for it).
LeftOut = Literal["late", "capped", "global", "busy"]
LEFT_OUT: tuple[LeftOut, ...] = get_args(LeftOut)
# Why a pipeline is in a group round: it opened the round; the round awaited it (forecast to come
# by the horizon) and it came; it was there when the round closed, not awaited.
Joined = Literal["opened", "expected", "ready"]
JOINED: tuple[Joined, ...] = get_args(Joined)


@dataclass(frozen=True)
class Decision:
    """One round of one stage: ``members`` (pipelines, sorted) average their replicas now."""

    stage: int
    round: int  # per-stage round number, from 1
    members: tuple[int, ...]
    iterations: tuple[int, ...]  # each member's iteration, in ``members`` order
    waited: tuple[float, ...]  # seconds each member waited for the decision
    kind: str = "group"  # "group" or "global"
    stop: bool = False  # the members' pipelines stop after this iteration (end of the run)
    # restarted pipelines this stage's first member heals after this round: (pipeline, the
    # iteration it goes on from)
    heal: tuple[tuple[int, int], ...] = ()
    # every member is known to hold the same weights and optimizer state (the policy's
    # ``twins``): averaging the weights changes nothing, only the gradients need it
    twins: bool = False
    # what each member's weights and gradient count in the round's averages (``sync.stale``;
    # :mod:`.freshness`); empty: every member counts the same
    weight_shares: tuple[float, ...] = ()
    grad_shares: tuple[float, ...] = ()
    reason: Reason | None = None  # why the round closed (:data:`REASONS`); every policy says
    # each live pipeline the round left out, with why (:data:`LEFT_OUT`), by pipeline
    outside: tuple[tuple[int, LeftOut], ...] = ()
    # a group round's members, each with why it is in (:data:`JOINED`), by pipeline
    inside: tuple[tuple[int, Joined], ...] = ()

    def of(self, pipeline: int) -> int:
        """The iteration this decision answers for ``pipeline``."""
        return self.iterations[self.members.index(pipeline)]


def gossip_peer(seed: int, stage: int, step: int, pipeline: int, pipelines: int) -> int | None:
    """AD-PSGD's partner of ``pipeline`` in round ``step`` of ``stage`` (None: the odd one out).

    A random perfect matching that every replica derives from (seed, stage, step) alone, so both
    sides of a pair agree without asking anyone.
    """
    order = list(range(pipelines))
    random.Random(f"{seed}/{stage}/{step}").shuffle(order)
    i = order.index(pipeline)
    mate = i + 1 if i % 2 == 0 else i - 1
    return order[mate] if mate < len(order) else None


@dataclass
class StageState:
    """One stage's open round and connectivity, as events come."""

    links: DisjointSet
    waiting: dict[int, tuple[int, float]] = field(default_factory=dict)  # p -> (iteration, arrival)
    deadline: float | None = None  # when the open round closes without everyone
    window_end: float | None = None  # the opener's window (None: no round open)
    opener: int | None = None  # the replica that opened the round
    horizon: float = 0.0  # with patience: how long the round may wait for ``expect``
    expect: frozenset = frozenset()  # replicas predicted to be ready within the horizon
    slowest_expected: float = 0.0  # cost_aware: the largest pace in ``expect``
    last_due: float = 0.0  # cost_aware: the latest forecast in ``expect``
    # with patience: the latest the round may wait until (opened + patience x the opener's pace;
    # a faster joiner's own, if earlier)
    cap: float = 0.0
    # cost_aware: how late (> 0) or early the round's opener (or a later joiner) came against its
    # own forecast: the others are awaited as late or early (a shared stall, a quicker evaluation)
    drift: float = 0.0
    rounds: int = 0  # rounds since the replicas were last all connected
    updates: int = 0  # replicas' rounds (group members) since then
    round_no: int = 0
    global_pending: bool = False
    connecting: bool = False  # past the window, waiting for the replicas that connect the rest
    hold_until: float | None = None  # cost_aware, connecting: when its anchor turns suspect
    parked: set = field(default_factory=set)  # waiting at their iteration of the pending global sync
    # ``waiting`` less ``parked``: the replicas a group round may take, kept as events come (built
    # per event it would cost a pass over every waiting replica, P^2 in a run)
    free: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def late(self) -> float:
        """How much later than forecast the round awaits the others (a stall they share)."""
        return max(0.0, self.drift)

    @property
    def early(self) -> float:
        """How much earlier than forecast the round looks for the others (a quicker evaluation)."""
        return max(0.0, -self.drift)


class RunState:
    """The run's state that several parts read and write: who is live, each replica's progress,
    the stages' rounds, the pending global sync and the clock."""

    def __init__(self, pipelines: int, stages: int, *, global_every: int,
                 total_iterations: int | None, time_limit: float | None,
                 evaluate_every: int = 0, clock: Callable[[], float] = time.monotonic):
        self.P, self.S = pipelines, stages
        self.evaluate_every = evaluate_every  # the workers' train.eval_every (0: none known)
        self.global_every, self.total_iterations = global_every, total_iterations
        self.time_limit, self.clock = time_limit, clock
        self.forecast = Forecast(stages)
        self.pace = self.forecast.pace  # (stage, pipeline) -> mean interval between ready signals
        self.started = clock()
        self.stop_requested = False
        self.live: set[int] = set(range(pipelines))
        self.last_ready = {p: [-1] * stages for p in range(pipelines)}
        self.decided = {p: [-1] * stages for p in range(pipelines)}  # last iteration decided
        self.stages = [StageState(DisjointSet(self.live)) for _ in range(stages)]
        self.global_at: dict[int, int] = {}  # pipeline -> iteration of the pending global sync
        self.final = False  # the pending global sync ends the run
        self.global_closed: set[int] = set()  # stages that closed the pending global sync
        self.global_history: list[dict[int, int]] = []  # every global sync's iteration per pipeline
        self.finished = False
        self.next_global = pipelines * global_every

    def pauses_after(self, iteration: int) -> bool:
        """Whether the workers evaluate between 0-based ``iteration`` and the next: a known
        pause, not a straggle (:mod:`~sdpipe_cli.core.forecast`). An evaluation after every
        iteration is part of every iteration's compute, not a pause."""
        return self.evaluate_every > 1 and (iteration + 1) % self.evaluate_every == 0

    def time_is_up(self) -> bool:
        return self.stop_requested or (self.time_limit is not None
                                       and self.clock() - self.started >= self.time_limit)

    def pending(self) -> bool:
        """Whether a global sync is declared and some stage has not closed it yet."""
        return any(st.global_pending for st in self.stages)


class StageView(NamedTuple):
    """One stage's round state in a :class:`Snapshot` (a tuple: cheap to take per event)."""

    connecting: bool  # a round due to connect, held past its window for another component
    global_pending: bool  # the pending global sync has not closed at this stage
    rounds: int  # group rounds since the stage's replicas were last all connected
    updates: int  # their members, counted (cost_aware's measure of "due")
    components: int  # components of the live replicas since then
    deadline: float | None  # when the open round closes without everyone (None: none open)
    fastest: int | None  # the live replica with the shortest pace (None: nobody live)
    waiting: dict[int, tuple[int, float]]  # replica -> (iteration, arrival), decision pending
    parked: frozenset[int]  # of those, the ones at their iteration of the pending global sync
    free: dict[int, tuple[int, float]]  # ``waiting`` less ``parked``: what a group round may take


class Snapshot(NamedTuple):
    """A copy of the policy's state between events, for tests, traces and tools: changing it
    changes nothing in the policy."""

    token: int | None  # classic: the stage allowed to wait for connectivity
    live: frozenset[int]
    stages: tuple[StageView, ...]
    global_at: dict[int, int]  # pipeline -> its iteration of the pending global sync
    final: bool  # the pending global sync ends the run
    finished: bool
    next_global: int  # iterations done at which the next periodic global sync is due
    last_ready: dict[int, tuple[int, ...]]  # pipeline -> each stage's last ready iteration
    begun: dict[int, int] | None  # asynchronous: iterations begun per pipeline (else None)
