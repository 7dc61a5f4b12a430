"""The group policy under asynchronous 1F1B (``AsyncGroupScheduler``): a round per update, global
syncs and the end of the run at drained points, the budget exact.

A discrete-event simulation runs P pipelines of S stages on the schedule's own rule
(:func:`sdpipe_cli.core.schedule.async_next`): each action takes the pipeline's tick time (a backward
twice that) once its inputs exist; the first stage calls ``begin`` before the first forward of
every iteration, and that iteration ends the segment when the answer says so; after every backward
a stage reports ready and blocks until its decision. Checked, for random speeds and settings:

1. every ready gets exactly one decision, and nothing deadlocks;
2. a global decision holds every live pipeline, each at its last update before a drain: the
   pipeline's stages have nothing in flight and drain right there;
3. the run ends with a ``stop`` global on every stage, after exactly P x steps iterations begun
   (no time limit), or, with a time limit, on a stop global all the same;
4. ``connect_every = 1`` makes every group round hold every pipeline at the same update.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sdpipe_cli.core.grouping import AsyncGroupScheduler, Decision
from sdpipe_cli.core.schedule import async_next

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Pipe:
    tick: float
    segment: int = 0  # first iteration of the current segment
    begun: int = 0  # iterations of the segment begun by the first stage
    end: int | None = None  # the segment's length in micro-batches, once known
    f: list = field(default_factory=list)  # per stage: forwards done in the segment
    b: list = field(default_factory=list)  # per stage: backwards done in the segment
    busy: list = field(default_factory=list)  # per stage: an action or a decision is pending
    f_done: set = field(default_factory=set)  # (stage, batch id) forwards finished
    b_done: set = field(default_factory=set)
    stopped: bool = False
    finished: bool = False
    drains: list = field(default_factory=list)  # iterations at which the pipeline drained


class AsyncSim:  # noqa: D101
    def __init__(self, P, S, m, ticks, **policy):
        self.P, self.S, self.m = P, S, m
        self.args = (P, S, m, ticks, policy)
        self.now = 0.0
        self.total_iterations = policy.get("total_iterations")
        self.policy = AsyncGroupScheduler(P, S, rounds_per_iteration=m, clock=lambda: self.now,
                                          **policy)
        self.pipes = [Pipe(t, f=[0] * S, b=[0] * S, busy=[False] * S) for t in ticks]
        self.heap: list = []
        self.seq = 0
        self.readies: list[tuple[int, int, int]] = []
        self.decisions: list[Decision] = []
        self.answered: dict[tuple[int, int, int], Decision] = {}
        self.under_global: dict[int, bool] = {}

    def with_policy(self, **changes) -> AsyncSim:
        """The same simulation, not run yet, with some policy settings changed."""
        P, S, m, ticks, policy = self.args
        return AsyncSim(P, S, m, ticks, **{**policy, **changes})

    def push(self, at, what):
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, what))

    def run(self, limit=200_000):
        for p in range(self.P):
            self.advance(p)
        for _ in range(limit):
            if all(pipe.finished for pipe in self.pipes):
                return self
            deadline = self.policy.next_deadline()
            if self.heap and (deadline is None or self.heap[0][0] <= deadline):
                self.now, _, what = heapq.heappop(self.heap)
                if what[0] == "advance":
                    self.advance(what[1])
                else:
                    self.finish_action(*what)
            elif deadline is not None:
                self.now = max(self.now, deadline)
                self.decide(self.call(self.policy.tick))
            else:
                raise AssertionError(f"deadlock at {self.now}: {self.pipes}")
        raise AssertionError("no end")

    def advance(self, p):
        """Start every action of pipeline p whose inputs exist; handle drains."""
        pipe, S, m = self.pipes[p], self.S, self.m
        progressed = True
        while progressed and not pipe.finished:
            progressed = False
            nexts = [async_next(S, s, pipe.f[s], pipe.b[s], pipe.end) for s in range(S)]
            if all(a is None for a in nexts) and not any(pipe.busy):
                k = pipe.segment + pipe.begun
                pipe.drains.append(k)
                if pipe.stopped:
                    pipe.finished = True
                    return
                pipe.segment, pipe.begun, pipe.end = k, 0, None
                pipe.f, pipe.b = [0] * S, [0] * S
                progressed = True
                continue
            for s, action in enumerate(nexts):
                if action is None or pipe.busy[s]:
                    continue
                j = pipe.segment * m + action.microbatch
                if action.kind == "F":
                    if s == 0 and action.microbatch == pipe.begun * m:
                        last, decisions = self.call(self.policy.begin, p, pipe.segment + pipe.begun)
                        pipe.begun += 1
                        if last:
                            pipe.end = pipe.begun * m
                        self.decide(decisions)
                    if s > 0 and (s - 1, j) not in pipe.f_done:
                        continue
                    pipe.busy[s] = True
                    self.push(self.now + pipe.tick, (p, s, "F", j))
                else:
                    if s < S - 1 and (s + 1, j) not in pipe.b_done:
                        continue
                    pipe.busy[s] = True
                    self.push(self.now + 2 * pipe.tick, (p, s, "B", j))
                progressed = True

    def finish_action(self, p, s, kind, j):
        pipe = self.pipes[p]
        if kind == "F":
            pipe.f[s] += 1
            pipe.f_done.add((s, j))
            pipe.busy[s] = False
        else:
            pipe.b[s] += 1
            pipe.b_done.add((s, j))
            self.readies.append((s, p, j))
            self.decide(self.call(self.policy.ready, s, p, j))  # busy until the decision
        self.advance(p)

    def call(self, method, *args):
        """A policy call; its decisions are marked with whether a global sync was pending."""
        before = self.policy.pending()
        result = method(*args)
        decisions = result[1] if isinstance(result, tuple) else result
        for d in decisions:
            self.under_global[id(d)] = before or self.policy.pending()
        return result

    def decide(self, decisions):
        for d in decisions:
            self.decisions.append(d)
            for p, j in zip(d.members, d.iterations):
                key = (d.stage, p, j)
                assert key not in self.answered, d
                self.answered[key] = d
                pipe = self.pipes[p]
                assert pipe.busy[d.stage]
                pipe.busy[d.stage] = False
                pipe.stopped |= d.stop
        for p in sorted({p for d in decisions for p in d.members}):
            self.push(self.now, ("advance", p))  # not now: advance() may be the caller


@st.composite
def sims(draw, time_limit=False, policy=st.just("classic")):
    P, S, m = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ticks = [draw(st.sampled_from([0.001, 0.002, 0.003, 0.006])) for _ in range(P)]
    kwargs = dict(min_group=2, window=draw(st.sampled_from([0.0005, 0.002, 0.01])),
                  window_min=0.0001, window_max=0.02, connect_every=draw(st.integers(1, 6)),
                  global_every=draw(st.sampled_from([0, 1, 2, 5])),
                  total_iterations=None if time_limit else P * draw(st.integers(1, 8)),
                  policy=draw(policy), patience=draw(st.sampled_from([0.0, 0.5])),
                  max_group=draw(st.sampled_from([0, 2])))
    if time_limit:
        kwargs["time_limit"] = draw(st.sampled_from([0.0, 0.01, 0.05]))
    return AsyncSim(P, S, m, ticks, **kwargs)


def check(sim: AsyncSim) -> None:
    P, S, m = sim.P, sim.S, sim.m
    assert sorted(sim.answered) == sorted(sim.readies)  # 1: one decision per ready
    globals_ = [d for d in sim.decisions if d.kind == "global"]
    for d in globals_:  # 2: everyone, at a drained point
        assert d.members == tuple(range(P)), d
        for p, j in zip(d.members, d.iterations):
            assert (j + 1) % m == 0 and (j + 1) // m in sim.pipes[p].drains, (d, sim.pipes[p].drains)
    per_stage = [[d for d in globals_ if d.stage == s] for s in range(S)]
    assert len({len(g) for g in per_stage}) == 1  # every stage took part in every global sync
    for s in range(S):  # the same targets on every stage
        assert [d.iterations for d in per_stage[s]] == [d.iterations for d in per_stage[0]]
    last = [max((d for d in sim.decisions if d.stage == s), key=lambda d: d.round) for s in range(S)]
    assert all(d.stop and d.kind == "global" for d in last), last  # 3
    assert all(pipe.finished for pipe in sim.pipes)
    # Every update of every stage got its round: consecutive ids up to the final drain.
    for p, pipe in enumerate(sim.pipes):
        for s in range(S):
            ids = sorted(j for (st_, q, j) in sim.readies if st_ == s and q == p)
            assert ids == list(range(pipe.drains[-1] * m))


@SETTINGS
@given(sims(policy=st.sampled_from(["classic", "cost_aware"])))
def test_async_policy_random_runs(sim):
    sim.run()
    check(sim)
    assert sum(sim.policy.snapshot().begun.values()) == sim.total_iterations  # exact budget
    assert sum(pipe.drains[-1] for pipe in sim.pipes) == sim.total_iterations


@SETTINGS
@given(sims(time_limit=True, policy=st.sampled_from(["classic", "cost_aware"])))
def test_async_policy_time_limit_ends_on_a_drained_global(sim):
    sim.run()
    check(sim)


@SETTINGS
@given(sims())
def test_async_policy_connect_every_one_is_allreduce(sim):
    """Every group round holds every pipeline, except the catch-up rounds of pipelines not yet at
    their target while a global sync is pending (the base class's rule). Those also let one
    pipeline make more updates than another before a global sync, so unlike the flushed policy
    the members of a later round need not be at the same update."""
    # with a cap below P no round holds everyone
    sim = sim.with_policy(connect_every=1, max_group=0)
    sim.run()
    check(sim)
    for d in sim.decisions:
        if d.kind == "group" and not sim.under_global[id(d)]:
            assert d.members == tuple(range(sim.P)), d


def test_async_policy_by_hand():
    """P = 2, S = 1, m = 2, 3 steps each: the global target is set at each pipeline's next begin."""
    now = [0.0]
    pol = AsyncGroupScheduler(2, 1, rounds_per_iteration=2, window=0.01, window_min=0.001,
                              window_max=0.01, global_every=1, total_iterations=6,
                              clock=lambda: now[0])
    last, ds = pol.begin(0, 0)
    assert not last and ds == []
    assert pol.ready(0, 0, 0) == []  # waits for pipeline 1 within the window
    last, _ = pol.begin(1, 0)  # 2 iterations begun: the periodic global sync is declared here
    assert last and pol.snapshot().global_at == {1: 1} and pol.global_history == [{1: 0}]
    (d,) = pol.ready(0, 1, 0)  # the round at update 0 closes with both
    assert d.members == (0, 1) and d.iterations == (0, 0) and d.kind == "group"
    assert pol.ready(0, 0, 1) == []  # pipeline 0 was not told yet: update 1 is a group round
    last, _ = pol.begin(0, 1)  # ... it is now: iteration 1 ends its segment
    assert last and pol.snapshot().global_at == {1: 1, 0: 3}
    now[0] = 0.02
    (d,) = pol.tick()  # pipeline 0's update 1 alone, after the window
    assert d.members == (0,) and d.kind == "group"
    assert pol.ready(0, 1, 1) == []  # pipeline 1 waits at its target for pipeline 0
    pol.ready(0, 0, 2)
    (d,) = pol.ready(0, 0, 3)
    assert d.kind == "global" and d.members == (0, 1) and d.iterations == (3, 1) and not d.stop
    assert pol.global_history == [{1: 0, 0: 1}]
    last, _ = pol.begin(1, 1)  # 4 begun: a periodic global now would let the others pass 6
    assert not last and not pol.pending()
    last, _ = pol.begin(0, 2)  # 5 begun, and pipeline 1's next makes 6: the last global sync
    assert last and pol.snapshot().final
    last, _ = pol.begin(1, 2)
    assert last and sum(pol.snapshot().begun.values()) == 6
    with pytest.raises(ValueError, match="before the global"):
        pol.begin(0, 3)
    with pytest.raises(ValueError, match="expected"):
        pol.begin(1, 5)


def test_async_policy_resume():
    pol = AsyncGroupScheduler(2, 2, rounds_per_iteration=4, total_iterations=20, global_every=5)
    pol.resume({0: 6, 1: 4})
    assert pol.iterations_done() == 10 and pol.snapshot().last_ready == {0: (23, 23), 1: (15, 15)}
    assert pol.snapshot().next_global == 20 and not pol.pending()
    assert pol.begin(0, 6) == (False, [])
    with pytest.raises(ValueError):
        pol.ready(0, 1, 15)  # already done before the checkpoint


def test_async_policy_a_lost_pipeline_rejoins_at_its_last_finished_iteration():
    """m = 2 rounds per iteration, S = 2: pipeline 1 finished iteration 0 on both stages, began
    iteration 1 and made one of its rounds there when it was lost. Iteration 1 no longer counts;
    once both stages are healed (by rounds of pipeline 0), pipeline 1 begins iteration 1 again."""
    now = [0.0]
    pol = AsyncGroupScheduler(2, 2, rounds_per_iteration=2, window=0.01, total_iterations=20,
                              clock=lambda: now[0])
    for p in (0, 1):
        pol.begin(p, 0)
        pol.begin(p, 1)
    for r in (0, 1):
        for s in (1, 0):
            for p in (0, 1):
                pol.ready(s, p, r)
    pol.ready(1, 1, 2)
    (d,) = pol.ready(1, 0, 2)
    assert d.members == (0, 1)  # stage 1 of pipeline 1 made round 2 (iteration 1); stage 0 not
    assert pol.iterations_done() == 4
    pol.leave(1)
    assert pol.iterations_done() == 3 and pol.resume_at == {1: 1}
    pol.rejoin(0, 1)
    pol.rejoin(1, 1)
    now[0] = 1.0
    (d,) = pol.ready(0, 0, 2)
    assert d.members == (0,) and d.heal == ((1, 1),) and 1 not in pol.live
    (d,) = pol.ready(1, 0, 3)
    assert d.heal == ((1, 1),) and 1 in pol.live
    assert pol.snapshot().begun[1] == 1 and pol.snapshot().last_ready[1] == (1, 1)
    assert pol.begin(1, 1) == (False, []) and pol.iterations_done() == 4


def test_async_policy_a_lost_pipeline_redoes_a_decided_iteration_it_never_reported():
    """Both stages of pipeline 1 made both rounds of iterations 0 and 1, but its last stage
    reported only iteration 0 before it was stopped: it goes on from iteration 1."""
    for recorded, resume, done in ((None, 2, 4), (1, 1, 3)):
        pol = AsyncGroupScheduler(2, 2, rounds_per_iteration=2, window=0.01, total_iterations=20,
                                  clock=lambda: 0.0)
        for k in (0, 1):
            for p in (0, 1):
                pol.begin(p, k)
            for r in (2 * k, 2 * k + 1):
                for s in (1, 0):
                    for p in (0, 1):
                        pol.ready(s, p, r)
        assert pol.iterations_done() == 4
        pol.leave(1, recorded)
        assert pol.iterations_done() == done and pol.resume_at == {1: resume}, recorded
