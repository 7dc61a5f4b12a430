"""A small discrete-event simulation that drives :class:`sdpipe_cli.core.grouping.GroupScheduler`
the way the real system does, and records everything the property tests need.

Model (see the package ``sdpipe_cli/core/grouping/`` and docs/SYNC.md):

* P pipelines of S stages. Pipeline p runs iteration k for ``durations[p][k % len]`` seconds;
  its stages then finish in order S-1, S-2, ..., 0, ``gaps[p]`` seconds apart, and each one
  reports ``ready(s, p, k)`` and blocks until it gets its decision.
* Pipeline p starts iteration k+1 when every one of its stages got its decision for k, unless a
  decision for it had ``stop=True`` (then it ends after k), or it reached the simulation's own
  ``max_iterations`` cutoff (then it finishes and calls ``leave(p)``, as a finished pipeline would).
* ``leave_at[p] = t``: pipeline p fails at time t: ``leave(p)``, its pending readies are dropped.
* ``rejoin_at[p] = t`` (after its ``leave_at``): pipeline p was restarted; every stage calls
  ``rejoin(s, p)`` at t and waits for a decision that heals it; once every stage is healed, p goes
  on from the iteration the heal names. If the run ends first, p ends unhealed.
* Events are processed in time order: the next arrival (or leave) versus ``next_deadline()``;
  ``tick()`` is called at the deadline, never at a time earlier than now. Arrivals at exactly the
  deadline are processed before the tick (they are "ready at that moment").

Any inconsistency (a decision for a stage that is not waiting, a wrong iteration, a ValueError,
a deadline that a tick does not clear, a deadlock, no progress) raises :class:`SimError`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from sdpipe_cli.core.grouping import Decision, GroupScheduler, Snapshot


class SimError(AssertionError):
    pass


def snap(sched: GroupScheduler) -> Snapshot:
    """The scheduler's read-only state between events (token, stages, live, global sync)."""
    return sched.snapshot()


@dataclass
class Event:
    """One call into the policy, with the state around it and what it returned."""

    index: int
    time: float
    kind: str  # "ready", "tick", "leave"
    args: tuple
    before: Snapshot
    after: Snapshot
    decisions: list[Decision]


@dataclass
class Result:
    P: int
    S: int
    sched: GroupScheduler
    events: list[Event]
    # every decision, in order, with the index of the event that produced it
    decisions: list[tuple[int, Decision]]
    completed: dict[int, int]  # pipeline -> iterations it completed (got all S decisions for)
    stopped: dict[int, int]  # pipeline -> iteration after which it stopped on a stop decision
    left: dict[int, float]  # pipeline -> time it left (failure or cutoff)
    failed: set[int]  # pipelines that left by failure (leave_at)
    healed: dict[int, list[tuple[int, Decision]]]  # pipeline -> (event index, healing decision)
    unhealed: set[int]  # rejoined pipelines the end of the run found still healing
    readies: list[tuple[float, int, int, int]]  # (time, stage, pipeline, iteration)
    end_time: float

    def by_stage(self, s: int) -> list[tuple[int, Decision]]:
        return [(i, d) for i, d in self.decisions if d.stage == s]

    def replay_log(self) -> list[tuple[float, str, tuple]]:
        return [(e.time, e.kind, e.args) for e in self.events]


@dataclass
class Sim:
    P: int
    S: int
    durations: list[list[float]]  # per pipeline, per iteration (cycled)
    gaps: list[float]  # per pipeline: time between stage s+1 and stage s finishing
    sched_kwargs: dict = field(default_factory=dict)
    max_iterations: int | None = None  # sim-side cutoff (pipelines then leave)
    leave_at: dict[int, float] = field(default_factory=dict)
    rejoin_at: dict[int, float] = field(default_factory=dict)
    max_steps: int = 200_000
    start_time: float = 0.0

    def run(self) -> Result:
        P, S = self.P, self.S
        now = [self.start_time]
        sched = GroupScheduler(P, S, clock=lambda: now[0], **self.sched_kwargs)
        heap: list = []  # (time, order, seq, kind, pipeline, payload); order: 0 leave, 1 ready
        seq = [0]

        def push(t: float, order: int, kind: str, payload: tuple) -> None:
            seq[0] += 1
            p = payload[1] if kind == "ready" else payload[0]
            heapq.heappush(heap, (t, order, seq[0], kind, p, payload))

        cur = {p: 0 for p in range(P)}  # the iteration each pipeline is in
        got: dict[int, set[int]] = {p: set() for p in range(P)}
        stop_flag = {p: False for p in range(P)}
        pending: dict[tuple[int, int], int] = {}  # (stage, pipeline) -> iteration waiting
        state = {p: "running" for p in range(P)}
        completed = {p: 0 for p in range(P)}
        stopped: dict[int, int] = {}
        left: dict[int, float] = {}
        failed: set[int] = set()
        events: list[Event] = []
        decisions: list[tuple[int, Decision]] = []
        healed: dict[int, list[tuple[int, Decision]]] = {}
        healing: dict[int, set[int]] = {}  # pipeline -> stages healed since it rejoined
        unhealed: set[int] = set()
        died: dict[int, int] = {}  # pipeline -> the last event sequence number before it failed
        readies: list[tuple[float, int, int, int]] = []

        def start_iteration(p: int, k: int, t0: float) -> None:
            d = self.durations[p][k % len(self.durations[p])]
            for i in range(S):
                push(t0 + d + i * self.gaps[p], 1, "ready", (S - 1 - i, p, k))

        def call(kind: str, args: tuple) -> None:
            before = snap(sched)
            try:
                if kind == "ready":
                    out = sched.ready(*args)
                elif kind == "tick":
                    out = sched.tick()
                elif kind == "rejoin":
                    out = sched.rejoin(*args)
                else:
                    out = sched.leave(*args)
            except ValueError as exc:
                raise SimError(f"t={now[0]}: {kind}{args} raised {exc!r}") from exc
            after = snap(sched)
            for s_, st_ in enumerate(after.stages):  # the free set is kept as events come
                parked = st_.parked if st_.global_pending else set()
                if st_.free != {q: v for q, v in st_.waiting.items() if q not in parked}:
                    raise SimError(f"t={now[0]}: stage {s_}: free {sorted(st_.free)} is not "
                                   f"waiting {sorted(st_.waiting)} less parked {sorted(parked)}")
            ev = Event(len(events), now[0], kind, args, before, after, list(out))
            events.append(ev)
            for d in out:
                decisions.append((ev.index, d))
            for d in out:
                deliver(d)
                for p, k in d.heal:
                    heal(ev.index, d, p, k)

        def heal(index: int, d: Decision, p: int, k: int) -> None:
            if state[p] != "healing":
                raise SimError(f"decision {d} heals pipeline {p}, which is {state[p]}")
            if d.stage in healing[p]:
                raise SimError(f"decision {d} heals stage {d.stage} of pipeline {p} twice")
            healed.setdefault(p, []).append((index, d))
            healing[p].add(d.stage)
            if len(healing[p]) == S:  # every stage has its state: the pipeline trains on
                state[p], cur[p], got[p] = "running", k, set()
                start_iteration(p, k, now[0])

        def deliver(d: Decision) -> None:
            for p, k in zip(d.members, d.iterations):
                if state[p] == "left":
                    raise SimError(f"decision {d} names pipeline {p}, which left")
                key = (d.stage, p)
                if pending.get(key) != k:
                    raise SimError(f"decision {d}: stage {d.stage} of pipeline {p} is waiting "
                                   f"for iteration {pending.get(key)}, not {k}")
                del pending[key]
                got[p].add(d.stage)
                stop_flag[p] = stop_flag[p] or d.stop
                if len(got[p]) == S:
                    finish_iteration(p)

        def finish_iteration(p: int) -> None:
            k = cur[p]
            completed[p] = k + 1
            got[p] = set()
            if stop_flag[p]:
                state[p] = "stopped"
                stopped[p] = k
            elif self.max_iterations is not None and k + 1 >= self.max_iterations:
                state[p] = "left"
                left[p] = now[0]
                call("leave", (p,))
            else:
                cur[p] = k + 1
                start_iteration(p, k + 1, now[0])

        for p in range(P):
            start_iteration(p, 0, now[0])
        for p, t in self.leave_at.items():
            push(t, 0, "leave", (p,))
        for p, t in self.rejoin_at.items():
            push(t, 0, "rejoin", (p,))

        steps = 0
        while True:
            steps += 1
            if steps > self.max_steps:
                raise SimError(f"no end after {self.max_steps} steps (t={now[0]})")
            if sched.finished:
                for p in [p for p, v in state.items() if v == "healing"]:
                    state[p] = "left"  # the run ended before it was healed
                    unhealed.add(p)
            if all(v != "running" for v in state.values()) and not any(
                    kind == "rejoin" for _, _, _, kind, _, _ in heap):
                break
            # drop events of pipelines that are gone
            while heap and ((state[heap[0][4]] != "running" and heap[0][3] != "rejoin")
                            or (heap[0][3] == "ready" and heap[0][2] <= died.get(heap[0][4], 0))):
                heapq.heappop(heap)  # (a ready of a failed pipeline's lost incarnation too)
            ta = heap[0][0] if heap else None
            td = sched.next_deadline()
            if ta is None and td is None:
                waiting = {k: v for k, v in pending.items()}
                raise SimError(f"deadlock at t={now[0]}: replicas {waiting} wait with no "
                               f"deadline and no arrival pending; states {state}")
            if ta is not None and (td is None or ta <= td):
                t, _, _, kind, _, payload = heapq.heappop(heap)
                now[0] = max(now[0], t)
                if kind == "rejoin":
                    p = payload[0]
                    if sched.finished:
                        unhealed.add(p)
                        continue
                    state[p], healing[p] = "healing", set()
                    for s in range(S):
                        call("rejoin", (s, p))
                elif kind == "leave":
                    p = payload[0]
                    died[p] = seq[0]
                    state[p] = "left"
                    left[p] = now[0]
                    failed.add(p)
                    for key in [key for key in pending if key[1] == p]:
                        del pending[key]
                    call("leave", (p,))
                else:
                    s, p, k = payload
                    pending[(s, p)] = k
                    readies.append((now[0], s, p, k))
                    call("ready", payload)
            else:
                now[0] = max(now[0], td)
                n_before = len(decisions)
                call("tick", ())
                nd = sched.next_deadline()
                if len(decisions) == n_before and nd is not None and nd <= now[0]:
                    raise SimError(f"tick at t={now[0]} left deadline {nd} in the past without "
                                   f"deciding anything")

        if pending:
            raise SimError(f"run ended with readies never answered: {pending}")
        return Result(P, S, sched, events, decisions, completed, stopped, left, failed,
                      healed, unhealed, readies, now[0])


def replay(P: int, S: int, sched_kwargs: dict, log: list[tuple[float, str, tuple]],
           start_time: float = 0.0) -> list[list[Decision]]:
    """Feed a recorded event log (same times) to a fresh scheduler; the decisions of each event."""
    now = [start_time]
    sched = GroupScheduler(P, S, clock=lambda: now[0], **sched_kwargs)
    out = []
    for t, kind, args in log:
        now[0] = t
        out.append(list(getattr(sched, kind)(*args)))
    return out
