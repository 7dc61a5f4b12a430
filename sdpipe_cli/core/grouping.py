"""Group scheduling policy: who averages weights with whom, and when. Pure: no I/O, injected clock.

Every stage of every pipeline, after its local optimizer step, reports *ready* (stage, pipeline,
iteration) and waits for a :class:`Decision`: the pipelines whose replicas of that stage average
their weights now. Each stage is scheduled on its own. The rules (SDPipe's, PVLDB 2023; see
docs/SYNC.md):

* **Window.** The first ready replica of a stage opens a window of its own adaptive length; the
  group closes when every available replica of the stage is ready, or when the window ends, with
  everyone ready at that moment. A replica's window doubles (up to ``window_max``) when its group
  had fewer than ``min_group`` members and shrinks by 0.9 (down to ``window_min``) otherwise, so
  fast replicas learn to wait a little for each other while stragglers never hold them up.
* **Who waits for whom** (``policy``). The scheduler sees every replica's pace, so it can choose
  who waits. ``cost_aware``: a round waits for a predicted replica only if it is at most
  :data:`AWAIT_PACE_RATIO` x slower than the fastest member present (the opener, or a faster
  replica that joined since), so a straggler waits for fast replicas (a little of a small share
  of the throughput) and never the reverse (a lot of a large share), and past its forecast only
  about as long as its forecasts usually miss (:meth:`GroupScheduler._slack`); a
  stage due to connect (``connect_every`` x live updates since it was last connected, as the
  reference counts) holds a round only if it would merge nothing and its members are outside the
  component of the stage's fastest replica, until a replica of another component arrives. The
  fastest replica is never held, so every held round closes within one of its iterations: no
  token, no stage waiting on another, and a due stage connects within one round of each of its
  replicas. A fastest replica that goes silent (``suspect_after`` past its forecast: a hang) is
  no longer the one held rounds wait for; the next fastest is (:meth:`GroupScheduler._anchor`).
  Global syncs give each pipeline as many iterations as fit before the slowest one's
  next, so that they arrive together. ``classic`` is the rule below, kept for comparison.
* **Connectivity bound** (``classic``). A disjoint set per stage accumulates the groups since the
  stage's replicas were last all connected. When the next round would be the ``connect_every``-th,
  the group does not close at the window's end but waits until it merges every component that is left.
  So within every ``connect_every`` rounds information from each replica reaches every other,
  which bounds how far replicas drift apart. With ``connect_every = 1`` every round waits for all
  replicas: plain all-reduce. For ``connect_every > 1`` only one stage at a time may wait for
  connectivity (a token), as in the reference: two stages waiting on each other's pipelines could
  otherwise deadlock, since a pipeline only moves on when all its stages got their groups.
* **Global sync.** Every ``global_every`` iterations of an average pipeline (P x global_every
  pipeline-iterations in total) each pipeline p is assigned its next iteration k_p, and every stage
  of p averages with all live replicas at k_p: a consistent model for evaluation and checkpoints.
  The run's last round is such a global sync with ``stop`` set, placed so that the run ends after
  ``total_iterations`` pipeline-iterations (or after ``time_limit`` seconds); cost_aware places
  it so that the run ends as early as that budget allows (:meth:`GroupScheduler._last_fits`).
* **Departures.** A pipeline that is gone (:meth:`GroupScheduler.leave`) never blocks a group.
  Its iterations that not every stage finished (no decision yet) no longer count: the budget is
  spent by iterations that were done, and a restarted pipeline redoes them.
* **Rejoining** (``fault.on_pipeline_loss=restart``). Each stage of a restarted pipeline asks to
  rejoin (:meth:`GroupScheduler.rejoin`); the next group round of that stage (not a global sync,
  and none pending) names one member, the first, as its source: after its update, that replica
  sends its weights and optimizer state to the restarted one (``Decision.heal``). A replica healed
  then is a copy of a live one, so it joins its source's component. The pipeline is live again once
  every stage is healed, and goes on from the first iteration it had not finished. While a global
  sync is pending no stage is healed, so a pipeline never becomes live halfway through one.
* **Prediction** (``patience > 0``). The scheduler sees every replica's ready signals and knows
  when it released each one, so it forecasts each replica's next ready signal from its release
  and its compute time (:mod:`~sdpipe_cli.core.forecast`), and knows its pace (a moving average
  of the interval between its rounds). When a round opens, it also waits for the replicas
  forecast within ``patience`` x the opener's own interval: replicas at the same pace (a
  homogeneous cluster) meet in full groups, as all-reduce would, while a replica forecast far
  later (a straggler) is not waited for. The adaptive window still applies (the round waits at
  least that long); ``patience = 0`` is the reference's rule alone.

* **Group cap** (``max_group > 0``). A round closes as soon as that many are ready (a due round
  swaps in a replica of another component, and merging two components is then enough); global
  syncs always include everyone, and so does every round with ``connect_every = 1`` (all-reduce:
  the cap and ``cost_aware`` do not apply there).

Connectivity is measured among the live replicas; rounds of replicas catching up to a pending global
sync (which connects everyone when it closes) do not wait for connectivity.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from sdpipe_cli.core.forecast import Forecast
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, updates_per_iteration


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

    def of(self, pipeline: int) -> int:
        """The iteration this decision answers for ``pipeline``."""
        return self.iterations[self.members.index(pipeline)]


def gossip_peer(seed: int, stage: int, step: int, pipeline: int, pipelines: int) -> Optional[int]:
    """AD-PSGD's partner of ``pipeline`` in round ``step`` of ``stage`` (None: the odd one out).

    A random perfect matching that every replica derives from (seed, stage, step) alone, so both
    sides of a pair agree without asking anyone.
    """
    order = list(range(pipelines))
    random.Random(f"{seed}/{stage}/{step}").shuffle(order)
    i = order.index(pipeline)
    mate = i + 1 if i % 2 == 0 else i - 1
    return order[mate] if mate < len(order) else None


class DisjointSet:
    """Union-find over replicas (pipelines), counting its components as it merges."""

    def __init__(self, items: Iterable[int]):
        self.parent = {i: i for i in items}
        self.count = len(self.parent)

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, items: Iterable[int]) -> None:
        items = [i for i in items if i in self.parent]
        for other in items[1:]:
            a, b = self.find(other), self.find(items[0])
            if a != b:
                self.parent[a] = b
                self.count -= 1

    def components(self) -> int:
        return self.count

    def add(self, item: int, joining: int) -> None:
        """A new element, in the component of ``joining``."""
        self.parent[item] = self.find(joining)

    def copy(self) -> "DisjointSet":
        out = DisjointSet([])
        out.parent, out.count = dict(self.parent), self.count
        return out

    def roots(self, items: Iterable[int]) -> set[int]:
        return {self.find(i) for i in items if i in self.parent}

    def connected_with(self, items: Iterable[int]) -> bool:
        """Whether merging ``items`` as one group would connect everything."""
        return self.count - max(0, len(self.roots(items)) - 1) <= 1


# cost_aware: a round waits for a predicted replica only if its pace is at most this many times the
# opener's (pace noise on a homogeneous cluster stays well within it; a 2x straggler does not)
AWAIT_PACE_RATIO = 1.5
# cost_aware: a round waits for a replica past its forecast SLACK_ERRORS x as long as its forecasts
# usually miss by, within SLACK_FLOOR and LATE_SLACK x the opener's pace (LATE_SLACK while the miss
# is not known yet); later, it is straggling this time and the round goes on without it
LATE_SLACK = 0.2
SLACK_ERRORS = 2.0
SLACK_FLOOR = 0.05
# cost_aware: most iterations a pipeline is given before a global sync (a faster one waits)
MAX_AHEAD = 8
END_CHECKS = 32  # passes over the pipelines, per P iterations, looking for the run's end
# cost_aware: replicas predicted within this x the opener's pace arrive "with" it (jitter)
JITTER_BAND = 0.25
_IS_GLOBAL = operator.itemgetter(0)  # of a round's key in _note
POLICIES = ("cost_aware", "classic")


@dataclass
class _StageState:
    links: DisjointSet
    waiting: dict[int, tuple[int, float]] = field(default_factory=dict)  # p -> (iteration, arrival)
    deadline: Optional[float] = None  # when the open round closes without everyone
    window_end: Optional[float] = None  # the opener's window (None: no round open)
    horizon: float = 0.0  # with patience: how long the round may wait for ``expect``
    expect: frozenset = frozenset()  # replicas predicted to be ready within the horizon
    slowest_expected: float = 0.0  # cost_aware: the largest pace in ``expect``
    last_due: float = 0.0  # cost_aware: the latest forecast in ``expect``
    rounds: int = 0  # rounds since the replicas were last all connected
    updates: int = 0  # replicas' rounds (group members) since then
    round_no: int = 0
    global_pending: bool = False
    connecting: bool = False  # past the window, waiting for the replicas that connect the rest
    hold_until: Optional[float] = None  # cost_aware, connecting: when its anchor turns suspect
    parked: set = field(default_factory=set)  # waiting at their iteration of the pending global sync
    # ``waiting`` less ``parked``: the replicas a group round may take, kept as events come (built
    # per event it would cost a pass over every waiting replica, P^2 in a run)
    free: dict[int, tuple[int, float]] = field(default_factory=dict)


class GroupScheduler:
    """The policy for all stages of a run. Feed it events; it returns the decisions they trigger.

    Times are seconds from ``clock``. The transport calls :meth:`tick` no later than
    :meth:`next_deadline`.
    """

    def __init__(self, pipelines: int, stages: int, *, min_group: int = 2, window: float = 0.01,
                 window_min: float = 0.0005, window_max: float = 0.1, connect_every: int = 8,
                 global_every: int = 0, total_iterations: Optional[int] = None,
                 time_limit: Optional[float] = None, patience: float = 0.0,
                 policy: str = "classic", max_group: int = 0, twins: bool = False,
                 suspect_after: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        if pipelines < 1 or stages < 1 or connect_every < 1 or min_group < 1:
            raise ValueError("pipelines, stages, connect_every and min_group must be >= 1")
        if patience < 0:
            raise ValueError("patience must be >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if max_group < 0 or max_group == 1:
            raise ValueError("max_group must be 0 (no cap) or at least 2")
        if suspect_after is not None and suspect_after <= 0:
            raise ValueError("suspect_after must be positive seconds (or None)")
        self.suspect_after = suspect_after
        # connect_every = 1 is all-reduce: every round waits for everyone, under either policy
        self.patience, self.cost_aware = patience, policy == "cost_aware" and connect_every > 1
        self.max_group = max_group if connect_every > 1 else 0  # all-reduce has no cap
        self.forecast = Forecast(stages)
        self.pace = self.forecast.pace  # (stage, pipeline) -> mean interval between ready signals
        self.P, self.S = pipelines, stages
        self.min_group, self.window_min, self.window_max = min_group, window_min, window_max
        self.connect_every, self.global_every = connect_every, global_every
        self.total_iterations, self.time_limit, self.clock = total_iterations, time_limit, clock
        self.started = clock()
        self.live: set[int] = set(range(pipelines))
        self.window = {(s, p): window for s in range(stages) for p in range(pipelines)}
        self.last_ready = {p: [-1] * stages for p in range(pipelines)}
        self._high = {p: -1 for p in range(pipelines)}  # max(last_ready[p]), kept as events come
        self._done = 0  # sum of _high[p] + 1: iterations_done() without a pass over pipelines
        self._latest: dict[int, float] = {}  # pipeline -> last ready time at its _high iteration
        self.stages = [_StageState(DisjointSet(self.live)) for _ in range(stages)]
        self.global_at: dict[int, int] = {}  # pipeline -> iteration of the pending global sync
        self.final = False  # the pending global sync ends the run
        self.global_closed: set[int] = set()  # stages that closed the pending global sync
        self.global_history: list[dict[int, int]] = []  # every global sync's iteration per pipeline
        self.finished = False
        self.next_global = pipelines * global_every
        self.token: Optional[int] = None  # the stage allowed to wait for connectivity
        self.stop_requested = False
        self._decided = {p: [-1] * stages for p in range(pipelines)}  # last iteration decided
        self._end_checked = -pipelines  # iterations done at the last look for the end
        self.resume_at: dict[int, int] = {}  # left pipeline -> the iteration it would go on from
        self.healing: dict[int, dict[int, Optional[int]]] = {}  # p -> stage -> source (None: waits)
        self.twins = twins
        self._lineage = {p: 0 for p in range(pipelines)}  # equal: the same state (all start alike)
        self._rounds_of: dict[int, dict[int, tuple]] = {p: {} for p in range(pipelines)}
        self._fresh = itertools.count(1)
        self._maybe_declare_global()  # a budget of at most P iterations ends at iteration 0

    # -- events ---------------------------------------------------------------------------------
    def ready(self, stage: int, pipeline: int, iteration: int) -> list[Decision]:
        if self.finished:
            raise ValueError(f"ready from stage {stage} of pipeline {pipeline} after the run ended")
        if pipeline not in self.live:
            raise ValueError(f"pipeline {pipeline} has left")
        expected = self.last_ready[pipeline][stage] + 1
        if iteration != expected:
            raise ValueError(f"stage {stage} of pipeline {pipeline}: ready for iteration "
                             f"{iteration}, expected {expected}")
        self.last_ready[pipeline][stage] = iteration
        now = self.clock()
        if iteration > self._high[pipeline]:
            self._done += iteration - self._high[pipeline]
            self._high[pipeline] = iteration
        if iteration == self._high[pipeline]:
            self._latest[pipeline] = now  # when the pipeline last reached its newest iteration
        self.forecast.ready(stage, pipeline, now)
        st = self.stages[stage]
        st.waiting[pipeline] = (iteration, now)
        if st.global_pending and self.global_at.get(pipeline) == iteration:
            st.parked.add(pipeline)
        else:
            st.free[pipeline] = (iteration, now)
            if st.slowest_expected and st.window_end is not None:  # cost_aware, awaiting someone
                pace = self.pace.get((stage, pipeline))
                if pace is not None and (AWAIT_PACE_RATIO * pace < st.slowest_expected
                                         or now + self.patience * pace < st.last_due):
                    self._narrow(stage, pace, now)
        return self.tick()

    def held(self) -> list[tuple[int, int]]:
        """(stage, pipeline) of every replica that sent its ready signal and waits for its
        decision now: in a round that has not closed, or parked at a pending global sync. Such a
        replica is silent because the policy holds it, not because it hangs."""
        return [(s, p) for s, st in enumerate(self.stages) for p in st.waiting]

    def expected(self, stage: int, pipeline: int) -> Optional[float]:
        """When ``pipeline``'s replica of ``stage`` is forecast to be ready next (None: it is
        waiting now, or its compute time is not known yet); see :mod:`~sdpipe_cli.core.forecast`."""
        return self.forecast.expected(stage, pipeline)

    def tick(self) -> list[Decision]:
        decisions: list[Decision] = []
        while True:
            self._maybe_declare_global()
            new = self._decide()
            decisions += new
            # Only a global sync that just closed, or a healed pipeline that is live again, can
            # change what _maybe_declare_global declares; group rounds cannot.
            if not any(d.kind == "global" or d.heal for d in new):
                return decisions

    def leave(self, pipeline: int) -> list[Decision]:
        """``pipeline`` is gone (failed or finished): forget it everywhere and unblock its peers.
        Its unfinished iterations are given back to the budget (see the module docstring)."""
        self.healing.pop(pipeline, None)
        if pipeline not in self.live:
            return []
        self.live.discard(pipeline)
        self.forecast.forget(pipeline)
        self.resume_at[pipeline] = self._give_back(pipeline)
        self._forget_twins(pipeline)
        target = self.global_at.pop(pipeline, None)
        for st in self.stages:
            st.waiting.pop(pipeline, None)
            st.parked.discard(pipeline)
            st.free.pop(pipeline, None)
            st.links = self._without(st.links, pipeline)
        if target is not None and self.final and not self.global_closed and not self._time_is_up():
            self._hand_over(target - self.resume_at[pipeline] + 1)
        return self.tick()

    def _hand_over(self, owed: int) -> None:
        """The last global sync is declared but no stage closed it, and a pipeline that owed
        ``owed`` of its iterations left: the live pipelines do them, the fastest first, so that
        the run still ends after exactly ``total_iterations``. A replica parked at its old target
        goes on (its ready there becomes an ordinary round)."""
        order = sorted(self.live, key=lambda q: (self.pace.get((0, q), float("inf")), q))
        for i in range(owed if order else 0):
            q = order[i % len(order)]
            self.global_at[q] += 1
            self.global_history[-1][q] = self.global_at[q]
        for st in self.stages:
            st.parked = {q for q in st.parked if st.waiting[q][0] == self.global_at[q]}
            st.free = {q: v for q, v in st.waiting.items() if q not in st.parked}

    def _give_back(self, pipeline: int) -> int:
        """A pipeline left: its iterations count up to the last one every stage finished, and the
        next is where it would go on from."""
        finished = min(self._decided[pipeline])
        if self._high[pipeline] > finished:
            self._done -= self._high[pipeline] - finished
            self._high[pipeline] = finished
        return finished + 1

    def rejoin(self, stage: int, pipeline: int) -> list[Decision]:
        """Stage ``stage`` of ``pipeline``, which left, was restarted and waits for a source to
        heal from (see the module docstring)."""
        if pipeline in self.live:
            raise ValueError(f"pipeline {pipeline} rejoins but never left")
        if pipeline not in self.resume_at:
            raise ValueError(f"pipeline {pipeline} rejoins but was never live")
        self.healing.setdefault(pipeline, {})[stage] = None
        return self.tick()

    def _heal(self, s: int, source: int) -> tuple[tuple[int, int], ...]:
        """The restarted replicas that ``source``, a member of a group round of stage ``s``
        closing now, heals; a pipeline healed at every stage is live again."""
        if self.finished or any(st.global_pending for st in self.stages):
            return ()
        waiting = sorted(p for p, stages in self.healing.items() if stages.get(s, 0) is None)
        healed = tuple((p, self.resume_at[p]) for p in waiting)
        for p in waiting:
            self.healing[p][s] = source
            if len(self.healing[p]) == self.S and None not in self.healing[p].values():
                self._admit(p, self.healing.pop(p))
        return healed

    def _admit(self, pipeline: int, sources: dict[int, int]) -> None:
        """``pipeline`` was healed at every stage: live again, from ``resume_at``, each replica in
        its source's component; its pace is learned anew."""
        k = self.resume_at.pop(pipeline)
        self.live.add(pipeline)
        self._restart_pipeline(pipeline, k)
        for s, st in enumerate(self.stages):
            st.links.add(pipeline, sources[s])
        self.forecast.forget(pipeline)
        self._latest.pop(pipeline, None)

    def resume(self, iterations: dict[int, int]) -> None:
        """Continue from a checkpoint taken right after a global sync, where pipeline p had done
        ``iterations[p]`` iterations: nobody is waiting and every stage is fully connected."""
        self._restart(iterations)
        self._maybe_declare_global()

    def _restart(self, iterations: dict[int, int]) -> None:
        for p, k in iterations.items():
            self._restart_pipeline(p, k)
        self._high = {p: max(last) for p, last in self.last_ready.items()}
        self._done = sum(self._high.values()) + len(self._high)
        done = self.iterations_done()
        self.next_global = self.P * self.global_every
        while self.global_every and self.next_global <= done:
            self.next_global += self.P * self.global_every
        self.global_at, self.final, self.finished, self.global_history = {}, False, False, []
        self._end_checked = -self.P
        self._lineage = {p: 0 for p in self._lineage}  # a checkpoint follows a global sync
        self._rounds_of = {p: {} for p in self._lineage}
        for st in self.stages:
            st.global_pending = False

    def _restart_pipeline(self, pipeline: int, iterations: int) -> None:
        """Pipeline ``pipeline`` has done ``iterations`` iterations, one round each."""
        self.last_ready[pipeline] = [iterations - 1] * self.S
        self._decided[pipeline] = [iterations - 1] * self.S

    def next_deadline(self) -> Optional[float]:
        """When :meth:`tick` must be called at the latest (None: only events can change anything)."""
        times = [st.deadline for st in self.stages
                 if st.waiting and st.deadline is not None and not st.connecting]
        times += [st.hold_until for st in self.stages
                  if st.connecting and st.waiting and st.hold_until is not None]
        if self.time_limit is not None and not self.final and not self._time_is_up():
            times.append(self.started + self.time_limit)  # once past, events take it from there
        return min(times) if times else None

    # -- global syncs and the end of the run -----------------------------------------------------
    def iterations_done(self) -> int:
        """Pipeline-iterations started so far (left pipelines keep what they did)."""
        return self._done

    def request_stop(self) -> list[Decision]:
        """End the run at the next global sync (as if the time limit had passed)."""
        self.stop_requested = True
        return self.tick()

    def _time_is_up(self) -> bool:
        return self.stop_requested or (self.time_limit is not None
                                       and self.clock() - self.started >= self.time_limit)

    def _budget_ends_within(self, iterations: int) -> bool:
        return (self.total_iterations is not None
                and self.iterations_done() + iterations >= self.total_iterations)

    def _ahead(self) -> dict[int, int]:
        """How many more iterations each live pipeline does before the next global sync.

        classic: one each, so a fast pipeline waits for the slowest one's next iteration.
        cost_aware: as many as each fits (from its pace) before the slowest one's next iteration
        is predicted to end, so that they all arrive at about the same time and the fast ones
        train instead of waiting. One each while any pace is unknown.
        """
        ahead = {p: 1 for p in self.live}
        paces = self._paces() if self.cost_aware and ahead else None
        if paces is None:
            return ahead
        return self._fits_by(paces, max(last + pace for last, pace in paces.values()))

    def _paces(self) -> Optional[dict[int, tuple[float, float]]]:
        """Each live pipeline's (when it last reached its newest iteration, pace): its first
        stage's pace (its stages keep one pace over time); None while any is unknown."""
        try:
            return {p: (self._latest[p], self.pace[(0, p)]) for p in self.live}
        except KeyError:
            return None

    @staticmethod
    def _fits_by(paces: dict[int, tuple[float, float]], until: float) -> dict[int, int]:
        """The iterations each pipeline ends by ``until`` at its pace: at least one, at most
        :data:`MAX_AHEAD`."""
        return {p: min(MAX_AHEAD, max(1, int((until - last) / pace + 1e-9)))
                for p, (last, pace) in paces.items()}

    def _ending(self, left: int, done: int) -> bool:
        """Whether the last global sync is due, ``left`` iterations before the budget ends:
        classic, once the live pipelines' next iterations reach it; cost_aware, once it is best
        placed now (:meth:`_last_fits`). That is a pass over the pipelines, made only within
        MAX_AHEAD iterations each of the end, and with many pipelines once per
        ``live // END_CHECKS`` iterations begun (and at each of the last ones): O(1) per event."""
        live = len(self.live)
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
            return self._budget_ends_within(len(self.live))
        slowest = max(paces, key=lambda p: (paces[p][0] + paces[p][1], p))
        until = sum(paces[slowest]) + paces[slowest][1]
        return budget <= sum(self._fits_by(paces, until).values())

    def _fill(self, budget: int) -> dict[int, int]:
        """The last global sync under cost_aware: ``budget`` iterations, at least one each, each
        further one given to the pipeline that would end it soonest (at most :data:`MAX_AHEAD`),
        so that the run ends as early as the budget allows."""
        paces = self._paces()
        if paces is None:
            return self._trim({p: 1 for p in self.live}, budget)
        ahead = {p: 1 for p in self.live}
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

    @staticmethod
    def _trim(ahead: dict[int, int], budget: int) -> dict[int, int]:
        """``ahead`` cut down (the most first) to sum to ``budget``, keeping one each."""
        ahead = dict(ahead)
        while sum(ahead.values()) > budget:
            p = max(ahead, key=lambda q: (ahead[q], q))
            if ahead[p] == 1:
                break
            ahead[p] -= 1
        return ahead

    def _maybe_declare_global(self) -> None:
        if self.finished:
            return
        if self.global_at:
            # One pending global sync at a time. Past the time limit it becomes the last one, but
            # only while no stage has closed it: every stage's round must carry the same stop flag.
            if not self.global_closed and not self.final and self._time_is_up():
                self.final = True
            return
        done = self.iterations_done()
        periodic = bool(self.global_every) and done >= self.next_global
        left = None if self.total_iterations is None else self.total_iterations - done
        ending = left is not None and self._ending(left, done)
        if not (periodic or ending or self._time_is_up()):
            return
        ahead = self._ahead()
        final = self._time_is_up() or ending
        while self.global_every and self.next_global <= done:
            self.next_global += self.P * self.global_every
        if periodic and not final and self._budget_ends_within(sum(ahead.values())
                                                               + len(self.live)):
            periodic = False  # the last global sync comes first; keeps the budget exact
        if not (final or periodic):
            return
        if final and not self._time_is_up() and left is not None:
            ahead = self._fill(left) if self.cost_aware else self._trim(ahead, left)
        self.final = final
        self.global_closed = set()
        self.global_at = {p: self._high[p] + ahead[p] for p in self.live}
        self.global_history.append(dict(self.global_at))
        for st in self.stages:
            st.global_pending = True

    # -- forming groups --------------------------------------------------------------------------
    def _decide(self) -> list[Decision]:
        decisions: list[Decision] = []
        progress = True
        while progress:
            progress = False
            for s in range(self.S):
                decision = self._close_global(s) or self._close_group(s)
                if decision is not None:
                    decisions.append(decision)
                    progress = True
        return decisions

    def _at_global(self, s: int) -> set[int]:
        st = self.stages[s]
        return st.parked if st.global_pending else set()

    def _close_global(self, s: int) -> Optional[Decision]:
        st = self.stages[s]
        arrived = self._at_global(s)
        if not st.global_pending or not self.live or not arrived >= self.live:
            return None
        decision = self._emit(s, sorted(arrived), kind="global", stop=self.final)
        st.links, st.rounds, st.updates, st.global_pending = DisjointSet(self.live), 0, 0, False
        self.global_closed.add(s)
        if self.token == s:
            self.token = None
        if not any(x.global_pending for x in self.stages):
            self.global_at = {}
            self.finished = self.final
        return decision

    def _close_group(self, s: int) -> Optional[Decision]:
        st = self.stages[s]
        at_global = self._at_global(s)
        ready = st.free
        if not ready:
            st.deadline, st.window_end, st.connecting = None, None, False
            if self.token == s:
                self.token = None
            return None
        now = self.clock()
        if st.window_end is None:
            opener = min(ready, key=lambda p: (ready[p][1], p))
            self._open(s, opener, ready[opener][1], ready, at_global)
        full = bool(self.max_group) and len(ready) >= self.max_group
        members = self._pick(s, ready) if full else ready
        # wait for the predicted replicas until they came or the horizon passed
        missing = st.expect.difference(members)
        if missing and at_global:
            missing -= at_global
        st.deadline = max(st.window_end, st.horizon) if missing else st.window_end
        everyone = len(members) == len(self.live) - len(at_global)  # members: live, not at_global
        if not everyone:
            if now < st.deadline and not full:  # a full round does not wait for more
                return None
            # a full round cannot hold everyone: merging two components is progress enough
            st.connecting = (self._must_connect(s) and not st.links.connected_with(members)
                             and not (self.cost_aware and self._may_go_on(s, members))
                             and not (full and len(st.links.roots(members)) > 1))
            if st.connecting:
                return None  # wait for the components that are left
        members = set(members)
        decision = self._emit(s, sorted(members), kind="group", stop=False)
        st.links.union(members)
        st.rounds += 1
        st.updates += len(members)
        if st.links.components() <= 1:
            st.links, st.rounds, st.updates = DisjointSet(self.live), 0, 0
            if self.token == s:
                self.token = None
        for p in members:
            key = (s, p)
            grow = len(members) < self.min_group
            self.window[key] = (min(self.window[key] * 2, self.window_max) if grow
                                else max(self.window[key] * 0.9, self.window_min))
        return decision

    def _open(self, s: int, opener: int, opened: float, ready: dict, parked: set[int]) -> None:
        """A round of stage ``s`` opens: it may close without everyone after the opener's window,
        once the replicas forecast (with ``patience``) to be ready within patience x the
        opener's pace are there, or at that horizon if one of them is late. ``ready`` and
        ``parked`` (at the pending global sync) are the replicas waiting now, two disjoint sets,
        passed apart because their union would be a pass over every parked replica per round.

        cost_aware waits less, and only where waiting is cheap: for replicas about as fast as the
        fastest one waiting (:data:`AWAIT_PACE_RATIO`; see :meth:`_narrow`), each only a little
        past its forecast (:meth:`_slack`; later, it is straggling this time). Replicas forecast
        within :data:`JITTER_BAND` x pace are the round's core; it waits for the later ones only
        if the core is a minority of the live replicas (or exactly half, without the fastest
        one): a lone replica half an iteration out of phase waits for the others and is in phase
        from then on, where the majority waiting for it would keep the phases apart (both sides
        waiting for each other shift together).
        """
        st = self.stages[s]
        st.window_end = opened + self.window[(s, opener)]
        st.horizon, st.expect, st.slowest_expected = st.window_end, frozenset(), 0.0
        pace = self.pace.get((s, opener))
        if not self.patience or pace is None:
            return
        st.horizon = opened + self.patience * pace
        present = len(ready) + len(parked)
        room = self.max_group - present if self.max_group else len(self.live)
        if not self.cost_aware:
            found = self._predicted(s, st.horizon, ready, parked, float("inf"), room)
            st.expect = frozenset(q for _, q in found)
            return
        quickest = min([pace] + [self.pace[(s, q)] for q in ready if (s, q) in self.pace])
        awaited = self._predicted(s, st.horizon, ready, parked, AWAIT_PACE_RATIO * quickest, room)
        band = opened + JITTER_BAND * pace
        core = [(t, q) for t, q in awaited if t <= band]  # earliest first, so a prefix
        half = 2 * (present + len(core)) - len(self.live)  # > 0: a majority; 0: exactly half
        if half > 0 or (half == 0 and self._fastest_among(s, ready, parked, core)):
            awaited = core
        st.expect = frozenset(q for _, q in awaited)
        if awaited:
            late, st.last_due = [q for _, q in awaited], awaited[-1][0]
            st.horizon = min(st.horizon, st.last_due + self._slack(s, late, pace))
            st.slowest_expected = max(self.pace[(s, q)] for q in late)

    def _slack(self, s: int, replicas: list[int], pace: float) -> float:
        """How long past their forecasts a round waits for ``replicas`` of stage ``s``:
        :data:`SLACK_ERRORS` x the largest of their usual misses, within :data:`SLACK_FLOOR` and
        :data:`LATE_SLACK` x ``pace`` (the round's fastest member's); :data:`LATE_SLACK` x pace
        while a miss is not known. Precise forecasts (a steady GPU cluster) make late replicas
        stragglers within a few milliseconds; noisy ones (shared CPUs) earn more patience."""
        error = self.forecast.worst_error(s, replicas)
        if error is None:
            return LATE_SLACK * pace
        return min(LATE_SLACK * pace, max(SLACK_FLOOR * pace, SLACK_ERRORS * error))

    def _narrow(self, s: int, joined: float, now: float) -> None:
        """cost_aware: a replica of pace ``joined`` joined the open round of stage ``s`` at
        ``now``, faster than the round's wait allows: some replica it waits for is slower than
        :data:`AWAIT_PACE_RATIO` x ``joined``, or its horizon is later than the joiner's own
        would be (``now`` + patience x ``joined``).

        A round opened by a slow replica waits for the faster ones it predicted, which is cheap:
        the slow one waits. Once a fast one is in, waiting for another slow one, or for a fast
        one's *next* iteration (inside the slow opener's long horizon), would hold the fast one,
        the costly way round; so the round keeps only the replicas its fastest member would have
        waited for had it opened the round, each only :meth:`_slack` (at that member's pace) past
        its forecast. (A round's members at its opening bound its pace the same way, in
        :meth:`_open`.) Equal replicas are all within the ratio: their rounds are unchanged."""
        st, due, paces = self.stages[s], self.forecast.expected, self.pace
        bound, horizon, inf = AWAIT_PACE_RATIO * joined, now + self.patience * joined, float("inf")
        keep, late, latest = [], [], 0.0
        for q in st.expect:
            if q in st.waiting:
                keep.append(q)
                continue
            t = due(s, q)
            if paces.get((s, q), inf) <= bound and (t is None or t <= horizon):
                keep.append(q)
                if t is not None:
                    late.append(q)
                    latest = max(latest, t)
        st.expect = frozenset(keep)
        st.slowest_expected = max((paces[(s, q)] for q in late), default=0.0)
        st.last_due = latest
        if late:
            st.horizon = min(st.horizon, latest + self._slack(s, late, joined))

    def _fastest_among(self, s: int, ready: dict, parked: set[int], core) -> bool:
        """Whether the fastest replica of stage ``s`` is waiting now or among ``core``."""
        fastest = self.fastest(s)
        return fastest in ready or fastest in parked or any(q == fastest for _, q in core)

    def _predicted(self, s: int, horizon: float, ready: dict, parked: set[int], slowest: float,
                   room: int) -> list[tuple[float, int]]:
        """Up to ``room`` replicas of stage ``s`` with their predicted ready times, earliest
        first, that are neither ``ready`` nor ``parked`` and are predicted to be ready by
        ``horizon``, with a pace of at most ``slowest``. Reads the stage's sorted forecasts
        without a pass over every replica."""
        return self.forecast.due_by(s, horizon, room, slowest, (ready, parked))

    def _must_connect(self, s: int) -> bool:
        """Whether this round of stage ``s`` is due to connect all replicas (and may wait for it)."""
        st = self.stages[s]
        if self.cost_aware:
            # counted in updates, as the reference does; no token (see _may_go_on)
            return not st.global_pending and st.updates >= self.connect_every * len(self.live)
        if st.rounds + 1 < self.connect_every:
            return False
        if self.connect_every == 1:
            return True  # every round is a full round: iteration-aligned, no token needed
        if st.global_pending:
            return False  # the pending global sync connects everyone when it closes
        if self.token is None:
            self.token = s
        return self.token == s

    def _pick(self, s: int, ready: dict[int, tuple[int, float]]) -> set[int]:
        """A full round's members: the ``max_group`` earliest, but with one replica of another
        component in place of the last when they are all of one component (so that a round due
        to connect still merges)."""
        order = sorted(ready, key=lambda p: (ready[p][1], p))
        members = order[:self.max_group]
        links = self.stages[s].links
        if len(links.roots(members)) == 1:
            root = links.find(members[0])
            other = next((p for p in order[self.max_group:] if links.find(p) != root), None)
            if other is not None:
                members[-1] = other
        return set(members)

    def fastest(self, s: int) -> int:
        """The live replica of stage ``s`` with the shortest pace (unknown paces last, then by
        number)."""
        return min(self.live, key=lambda q: (self.pace.get((s, q), float("inf")), q))

    def _anchor(self, s: int) -> int:
        """cost_aware: the replica whose component a held round of stage ``s`` waits for, the
        stage's fastest (see :meth:`_may_go_on`), unless it is overdue by more than
        ``suspect_after`` (a hang or a long stall): then the fastest of the others. Every held
        round waits on the fastest replica's next arrival; while that one is silent, the others'
        rounds would wait with it, and be as silent as a hang themselves."""
        fastest = self.fastest(s)
        if self.suspect_after is None or not self._suspect(s, fastest):
            return fastest
        others = [q for q in self.live if not self._suspect(s, q)]
        return min(others, key=lambda q: (self.pace.get((s, q), float("inf")), q),
                   default=fastest)

    def _suspect(self, s: int, q: int) -> bool:
        due = self.forecast.expected(s, q)
        return due is not None and self.clock() >= due + self.suspect_after  # as hold_until

    def _may_go_on(self, s: int, members: set[int]) -> bool:
        """cost_aware: whether a round that is due to connect but does not may close anyway.

        It may if it merges two components (progress), or if its members are the fastest
        replica's component: those are the replicas whose waiting would cost the most, and the
        others come to them. A held round thus waits only for the next arrival from another
        component, and the fastest replica's is never held, so it arrives at every stage each
        iteration: every held round closes within one of its iterations, without a token, and no
        two stages can wait on each other.
        """
        st = self.stages[s]
        roots = st.links.roots(members)
        if len(roots) > 1:
            return True
        anchor = self._anchor(s)
        due = self.forecast.expected(s, anchor) if self.suspect_after is not None else None
        st.hold_until = due + self.suspect_after if due is not None else None
        return st.links.find(anchor) in roots

    def _emit(self, s: int, members: list[int], kind: str, stop: bool) -> Decision:
        st = self.stages[s]
        now = self.clock()
        st.round_no += 1
        heal = self._heal(s, members[0]) if kind == "group" and self.healing else ()
        twins = (self.twins and kind == "group" and len(members) > 1
                 and len({self._lineage[p] for p in members}) == 1)
        decision = Decision(stage=s, round=st.round_no, members=tuple(members),
                            iterations=tuple(st.waiting[p][0] for p in members),
                            waited=tuple(now - st.waiting[p][1] for p in members),
                            kind=kind, stop=stop, heal=heal, twins=twins)
        if self.twins:
            self._note(decision)
        for p in members:
            self._decided[p][s] = st.waiting[p][0]
            self._release(s, p, st.waiting[p][0], now)
            del st.waiting[p]
            st.parked.discard(p)
            st.free.pop(p, None)
        st.deadline, st.window_end, st.connecting = None, None, False
        return decision

    def _release(self, s: int, p: int, iteration: int, now: float) -> None:
        """Stage ``s`` of pipeline ``p`` got its decision for ``iteration``. In the flushed
        schedules each stage's next iteration waits for data from the others, so the pipeline
        goes on (and its forecasts start) when the last of its stages got its decision."""
        if min(self._decided[p]) >= iteration:
            for x in range(self.S):
                self.forecast.release(x, p, now)

    # -- twins (sync.average=weights_grads) -----------------------------------------------------
    def _note(self, d: Decision) -> None:
        """Fold round ``d`` into its members' lineage; equal lineages mean the same state.

        With weights_grads a round gives its members the same weights and gradients, and each
        member's step depends only on those, its optimizer state and the learning rate its
        decision carries, except for clipping, whose norm sums over the pipeline's stages. So two
        pipelines that held the same state and took an iteration in the same round at *every*
        stage hold the same state again (any iteration numbers: AdamW's step count is averaged
        at global syncs too). An iteration whose rounds were all global syncs leaves every
        replica alike whatever came before. Replicas start alike (seeded), and a resume starts
        from a global sync. The flushed schedules make every stage of a pipeline finish an
        iteration before any stage of it signals the next, so its lineage is folded before its
        next round is decided."""
        stage, S, rounds_of, lineage = d.stage, self.S, self._rounds_of, self._lineage
        key = (d.kind == "global", stage, d.round)  # (is it global, the round's own number)
        for p in d.members:
            rounds = rounds_of[p]
            rounds[stage] = key
            if len(rounds) == S:
                keys = tuple(map(rounds.__getitem__, range(S)))
                lineage[p] = hash(keys if all(map(_IS_GLOBAL, keys)) else (lineage[p], keys))
                rounds.clear()

    def _forget_twins(self, gone: int) -> None:
        """A pipeline left: a round it was in may have failed, leaving its other members on
        their own state, so nobody counts as anybody's twin until the next global sync."""
        for p in self._lineage:
            self._lineage[p] = hash(("own", p, next(self._fresh)))
        self._rounds_of[gone] = {}

    def _without(self, links: DisjointSet, gone: int) -> DisjointSet:
        """The same connectivity among the remaining replicas."""
        rebuilt = DisjointSet(self.live)
        groups: dict[int, list[int]] = {}
        for p in self.live:
            groups.setdefault(links.find(p), []).append(p)
        for members in groups.values():
            rebuilt.union(members)
        return rebuilt


class AsyncGroupScheduler(GroupScheduler):
    """The policy for asynchronous 1F1B (``pipeline.schedule=async_1f1b``): a round per update.

    Each stage of each pipeline updates its weights after every micro-batch's backward, and
    reports ready after each of its updates, numbered consecutively: ``rounds_per_iteration``
    rounds per iteration (m). Groups, windows and connectivity work exactly as in the base class,
    whose ``connect_every`` therefore counts updates, as the reference's bound does.

    What changes is where global syncs (and the end of the run) may fall. A pipeline with
    micro-batches in flight has no single model to average, evaluate or save, so a global sync
    must come at a drained point: an iteration boundary where all stages of the pipeline have
    finished every micro-batch forwarded before it. Only the pipeline's first stage can still
    move that point, because it decides at the start of each iteration (:meth:`begin`) whether
    that iteration ends the pipeline's current segment; the later stages learn it from the
    control message before their own forwards of that iteration. So a declared global sync gets
    each pipeline's target lazily: at the pipeline's next :meth:`begin`, that iteration becomes
    its last, and every stage's round after its last update of that iteration is the global round
    (no stage can have reported that update earlier: it needs the iteration's forwards, which come
    after the :meth:`begin`). The decision of that round carries ``stop`` at the end of the run.

    The budget counts iterations begun by the first stages. A global sync declared while some
    pipeline is in :meth:`begin` makes that iteration its last, and every other pipeline does one
    more iteration (until its next :meth:`begin`), so the run ends after exactly
    ``total_iterations`` when the last global sync is declared with ``live - 1`` of them to spare.
    :attr:`global_history` keeps, like the base class, the last iteration of each pipeline before
    each global sync.
    """

    def __init__(self, pipelines: int, stages: int, *, rounds_per_iteration: int = 1, **kwargs):
        if rounds_per_iteration < 1:
            raise ValueError("rounds_per_iteration must be >= 1")
        self.rounds_per_iteration = rounds_per_iteration
        self.begun = {p: 0 for p in range(pipelines)}  # iterations begun by each first stage
        self._begun_total = 0
        super().__init__(pipelines, stages, **kwargs)

    def iterations_done(self) -> int:
        """Pipeline-iterations begun so far (left pipelines keep what they did)."""
        return self._begun_total

    def pending(self) -> bool:
        """Whether a global sync is declared and some stage has not closed it yet."""
        return any(st.global_pending for st in self.stages)

    def begin(self, pipeline: int, iteration: int) -> tuple[bool, list[Decision]]:
        """The first stage of ``pipeline`` is about to start ``iteration``: whether that iteration
        ends its segment (a global sync after it), and the decisions this triggers."""
        if self.finished:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration} after the run ended")
        if pipeline not in self.live:
            raise ValueError(f"pipeline {pipeline} has left")
        if iteration != self.begun[pipeline]:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration}, "
                             f"expected {self.begun[pipeline]}")
        if pipeline in self.global_at:
            raise ValueError(f"pipeline {pipeline} begins iteration {iteration} before the global "
                             "sync it drained for")
        self.begun[pipeline] = iteration + 1
        self._begun_total += 1
        if not self.pending():
            live = len(self.live)
            done = self.iterations_done()
            final = self._time_is_up() or self._budget_ends_within(live - 1)
            periodic = bool(self.global_every) and done >= self.next_global
            while self.global_every and self.next_global <= done:
                self.next_global += self.P * self.global_every
            if periodic and not final and self._budget_ends_within(2 * live - 2):
                periodic = False  # the other pipelines' next iterations would pass the budget
            if final or periodic:
                self._declare(final)
        last = False
        if self.pending():
            self.global_at[pipeline] = (iteration + 1) * self.rounds_per_iteration - 1
            self.global_history[-1][pipeline] = iteration
            last = True
        return last, self.tick()

    def resume(self, iterations: dict[int, int]) -> None:
        """Continue from a checkpoint taken at a global sync, where pipeline p had done
        ``iterations[p]`` iterations (drained: every stage made all its updates)."""
        self._restart(iterations)

    def _restart_pipeline(self, pipeline: int, iterations: int) -> None:
        self._begun_total += iterations - self.begun[pipeline]
        self.begun[pipeline] = iterations
        self.last_ready[pipeline] = [iterations * self.rounds_per_iteration - 1] * self.S
        self._decided[pipeline] = list(self.last_ready[pipeline])

    def _give_back(self, pipeline: int) -> int:
        """The budget counts iterations begun: a pipeline that left keeps those every stage
        finished (all their rounds decided); it would go on from the next one."""
        finished = (min(self._decided[pipeline]) + 1) // self.rounds_per_iteration
        self._begun_total -= self.begun[pipeline] - finished
        self.begun[pipeline] = finished
        return finished

    def _release(self, s: int, p: int, iteration: int, now: float) -> None:
        """A round per update: a stage goes on with its next micro-batches once its own round
        is decided, without waiting for the pipeline's other stages to be."""
        self.forecast.release(s, p, now)

    def _hand_over(self, owed: int) -> None:
        """Targets are set at each pipeline's next begin(), so a pending global sync owes nothing
        to hand over; a pipeline lost while one is pending takes the iterations it had begun."""

    def _maybe_declare_global(self) -> None:
        # The budget is checked in begin(), the only place where it grows; here only the clock
        # and a stop request can call for the last global sync.
        if self.finished:
            return
        if self.pending():
            if not self.global_closed and not self.final and self._time_is_up():
                self.final = True
            return
        if self._time_is_up():
            self._declare(final=True)

    def _declare(self, final: bool) -> None:
        """A global sync is due; pipelines get their targets at their next begin()."""
        self.final = final
        self.global_closed = set()
        self.global_at = {}
        self.global_history.append({})
        for st in self.stages:
            st.global_pending = True


def make_policy(cfg: Any, clock: Callable[[], float] = time.monotonic) -> GroupScheduler:
    """The policy of a run config with ``sync=sdpipe``: the scheduler process and the simulator
    (:mod:`sdpipe_cli.core.simulation`) build it here, so both run the same one."""
    y, p = cfg.sync, cfg.pipeline
    policy, extra = GroupScheduler, {}
    if p.schedule in ASYNC_SCHEDULES:  # a round per update, drained global syncs
        rounds = updates_per_iteration(p.schedule, p.microbatches, p.weight_versions)
        policy, extra = AsyncGroupScheduler, {"rounds_per_iteration": rounds}
    return policy(
        cfg.cluster.pipelines, p.stages, **extra, min_group=y.min_group,
        window=y.window_ms / 1e3, window_min=y.window_min_ms / 1e3, window_max=y.window_max_ms / 1e3,
        connect_every=y.connect_every, global_every=y.global_every, patience=y.patience,
        policy=y.policy, max_group=y.max_group, suspect_after=y.group_timeout,
        twins=y.average == "weights_grads" and policy is GroupScheduler,
        total_iterations=cfg.cluster.pipelines * cfg.train.steps,
        time_limit=cfg.train.time_limit, clock=clock)
