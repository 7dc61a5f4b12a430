"""A discrete-event simulation of a run's timing: the real group policy, modelled workers.

A sync policy is judged by its samples/s against the heterogeneity limit, at scales and on
clusters a development machine cannot run, without the CPU contention that blurs real runs.
The simulation drives the scheduler's own policy (:func:`~sdpipe_cli.core.grouping.make_policy`)
through an injected clock: only the workers' time is modelled; no process starts, nothing sleeps.

The model of worker (pipeline p, stage s), for the flushed schedules (1F1B, GPipe, ZB-H1,
interleaved 1F1B and zero bubble, :class:`~sdpipe_cli.core.iteration_plan.IterationPlan`):

* An action (one micro-batch's forward or backward, on its chunk) takes its share of the
  stage's modelled time, times the pipeline's slow-down and the worker's straggler draw, over
  its device's speed when it starts, times a seeded log-normal ``jitter`` per iteration: what
  modelled emulation makes real workers sleep (:mod:`sdpipe_cli.hetero.emulation`).
* A forward also waits for the previous (virtual) stage's forward of the micro-batch, a backward
  for the next one's backward, each plus the link's transfer of one activation and ``p2p_s``.
* After its last backward the worker synchronizes, per mode:
  - ``sdpipe``: after every ``every``-th iteration (otherwise nothing), the ready signal reaches
    the scheduler after half a round trip. The scheduler handles one event at a time
    (``event_s`` each) and feeds it to the policy, which counts meetings. A decision reaches its
    members after another half round trip; then they all-reduce the stage's payload (a group
    round's in ``precision``; a global sync's in float32).
  - ``allreduce`` and ``adpsgd``: each replica waits for every other at the same iteration,
    then all-reduces over all replicas (AD-PSGD: averages with its partner).
  - ``ps``: the gradients go to the stage's server, one push at a time; the weights come back.
    A replica more than ``staleness`` iterations ahead of the slowest waits.
  - ``diloco``: nothing for ``local_steps - 1`` iterations, then as ``allreduce`` on the
    stage's weights (their change, in ``precision``).
  - ``none``: nothing.
* The stage starts its next iteration when its sync is done. Workers do not evaluate here, so
  the policy is told of no evaluation pauses (``make_policy(..., evaluations=False)``).

An all-reduce costs :meth:`~sdpipe_cli.core.cluster.Cluster.allreduce_s` (a ring on the slowest
link) plus ``collective_s``, the fixed cost of one collective call.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import cast

from sdpipe_cli.core import modes
from sdpipe_cli.core.blocks import BlockPlan
from sdpipe_cli.core.grouping import GroupScheduler, gossip_peer
from sdpipe_cli.core.iteration_plan import IterationPlan
from sdpipe_cli.core.meetings import BYTES, Meetings
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.core.simulated import Result, Workload
from sdpipe_cli.core.wire import Blocks

__all__ = ["Workload", "Result", "simulate", "MODES"]

MODES = tuple(modes.MODES)  # every mode has its transport below


class _Run:
    def __init__(self, work: Workload, sync: str,
                 policy_factory: Callable[[Callable[[], float]], GroupScheduler] | None):
        if sync not in MODES:
            raise ValueError(f"sync: cannot simulate '{sync}'; choose one of {', '.join(MODES)}")
        if modes.mode(sync).group_policy and policy_factory is None:
            raise ValueError("sync=sdpipe needs its policy")
        self.w, self.sync, self.mode = work, sync, modes.mode(sync)
        P, S = work.pipelines, work.stages
        self.P, self.S = P, S
        self.now = 0.0
        self.policy = (policy_factory(lambda: self.now)
                       if self.mode.group_policy and policy_factory is not None else None)
        counts = work.shares or [work.microbatches] * P  # each pipeline's iteration, by its m
        made = {k: IterationPlan(work.schedule, S, k, work.chunks) for k in set(counts)}
        self.plans = [made[k] for k in counts]
        self.meetings = Meetings(work.every)  # sdpipe: the policy counts meetings
        # sdpipe with meetings apart: each pipeline's blocks, as the scheduler decides them
        # (core.blocks), with what it decides them from: each block's steps and seconds
        self.blocks = ([Blocks(work.every) for _ in range(P)]
                       if self.mode.group_policy and work.every > 1 else None)
        self.block_plan = BlockPlan(P * work.steps, P, work.every)
        self.step_s: dict[int, float] = {}
        self.block_began = [0.0] * P
        self.meeting_at = [0] * P  # the iteration after which each pipeline meets next
        self.next_block: dict[int, int] = {}
        cl = work.cluster
        self.devices = [[cl.device(p, s) for s in range(S)] for p in range(P)]
        self.dynamic = {d.name for row in self.devices for d in row if cl.change_points(d)}
        # per worker: its fixed speed (None: it changes during the run, looked up per action)
        self.speed = [[None if d.name in self.dynamic else d.speed for d in row]
                      for row in self.devices]
        self.where = [[Placement.of(p, s, P, S) for s in range(S)] for p in range(P)]
        self._cost_actions()
        self.noise = [[random.Random(f"{work.seed}/jitter/{p}/{s}") for s in range(S)]
                      for p in range(P)]
        self.heap: list = []
        self.seq = 0
        self.iteration = [0] * P  # the iteration each pipeline is in
        self.synced = [[0.0] * S for _ in range(P)]  # when each stage finished its last sync
        self.pending = [S] * P  # stages of the current iteration not synced yet
        self.stopped = [False] * P
        self.done = [0] * P
        self.finished_at = [0.0] * P
        self.busy = [0.0] * P
        self.wait = [0.0] * P
        self.ready_at: dict[tuple[int, int], float] = {}  # (p, s) -> ready time of the current iteration
        self.groups: list[int] = []
        self.globals: list[int] = []
        self.barriers: dict[tuple[int, int], dict[int, float]] = {}
        self.sched_free = 0.0
        self.server_free = [0.0] * S
        self.pushes = [[0] * P for _ in range(S)]
        self.deferred: list[list[tuple[int, int, float, bool]]] = [[] for _ in range(S)]
        self.budget_left = P * work.steps
        self.sent: dict[str, float] = {}  # per link class: bytes every worker's sync sent
        self.comm_s = 0.0  # the workers' seconds in sync collectives, summed
        # the mixing model: one number per replica, see _step
        self.drift = [[0.0] * S for _ in range(P)]
        self.draw = random.Random(f"{work.seed}/drift")
        self.spread = [0.0, 0]  # sum and count of the first stage's spreads

    # -- workers --------------------------------------------------------------------------------

    def _cost_actions(self) -> None:
        """Per pipeline and action of the iteration: its cost at speed 1 and the transfer before
        it (the inner loop of _start_iteration runs P x steps x actions times); the same fused."""
        work, cl, P = self.w, self.w.cluster, self.P

        def hop(src: int | None, dst: int) -> float:
            return 0.0 if src is None else work.p2p_s + cl.link(src, dst).transfer_s(work.activation_bytes)

        # transfer into stage s: from s - 1 (forward) and from s + 1 (backward)
        self.link_in = [[(hop(x.prev_rank, x.rank), hop(x.next_rank, x.rank)) for x in row]
                        for row in self.where]
        wrap_in = [(hop(row[-1].rank, row[0].rank), hop(row[0].rank, row[-1].rank))  # interleaved
                   for row in self.where]
        even = [[[1.0 / work.chunks] * work.chunks] * self.S] * P  # chunks of equal shares
        fshare, bshare = work.chunk_forward or even, work.chunk_backward or even
        self.action_s = [[(work.backward_s[p][s] * bshare[p][s][c] if b
                           else work.forward_s[p][s] * fshare[p][s][c]) * share
                          for (s, b, _), c, share in zip(plan.steps, plan.chunk, plan.share)]
                         for p, plan in enumerate(self.plans)]
        # an action that waits for no other stage (a W: a split backward's weights' part; the
        # ends' own) receives nothing: no transfer before it
        self.action_link = [[(wrap_in[p][b] if wrap else self.link_in[p][s][b]) if dep >= 0 else 0.0
                             for (s, b, dep), wrap in zip(plan.steps, plan.wraps)]
                            for p, plan in enumerate(self.plans)]
        self.fused_s = [[sum(costs[i] for i in m) for m in plan.members]
                        for costs, plan in zip(self.action_s, self.plans)]
        self.fused_link = [[links[m[0]] for m in plan.members]
                           for links, plan in zip(self.action_link, self.plans)]
    def _start_iteration(self, p: int) -> None:
        """All stages of ``p`` are synced: compute its next iteration and post the ready signals."""
        w, S = self.w, self.S
        at = list(self.synced[p])
        draws = w.stragglers[p] if w.stragglers else [None] * S
        per_action = not w.per_iteration and any(d is not None for d in draws)
        # per iteration and stage: slow-down x straggler x jitter (x 1/speed unless it changes)
        scale = []
        slowdown, speeds, noise = w.slowdown[p] if w.slowdown else 1.0, self.speed[p], self.noise[p]
        for s in range(S):
            x = slowdown
            draw = draws[s]
            if w.per_iteration and draw is not None:
                x *= draw.draw()
            if w.jitter:
                x *= math.exp(noise[s].gauss(0.0, w.jitter))
            speed = speeds[s]
            scale.append(x if speed is None else x / speed)
        slow = per_action or bool(self.dynamic)  # a scale per action, not per stage
        if slow:
            steps, cost, link = self.plans[p].steps, self.action_s[p], self.action_link[p]
        else:
            steps, cost, link = self.plans[p].fused, self.fused_s[p], self.fused_link[p]
        end = [0.0] * len(steps)
        busy = 0.0
        for i, (s, _, dep) in enumerate(steps):
            t = at[s]
            if dep >= 0:
                arrival = end[dep] + link[i]
                if arrival > t:
                    t = arrival
            duration = cost[i] * scale[s]
            if slow:
                draw = draws[s]
                if per_action and draw is not None:
                    duration *= draw.draw()
                device = self.devices[p][s]
                if device.name in self.dynamic:
                    duration /= w.cluster.speed(device, t, self.iteration[p])
            if s == 0:
                busy += duration
            end[i] = at[s] = t + duration
        self.busy[p] += busy
        k = self.iteration[p]
        self.pending[p] = S
        # sdpipe's ready signal does nothing but travel to the scheduler: one event, not two
        to_scheduler = self.w.rtt_s / 2 if self.policy is not None else None
        meets = self.blocks[p].meets(k) if self.blocks else self.meetings.meets(k)
        if to_scheduler is not None and not meets:
            to_scheduler = None  # sdpipe between meetings: nothing to do (see _ready)
        elif self.blocks:
            self.meeting_at[p] = k
        for s in range(S):
            self.ready_at[(p, s)] = at[s]
            if to_scheduler is None:
                self._push(at[s], "ready", p, s, k)
            else:
                self._push(at[s] + to_scheduler, "scheduler", p, s, k)

    def _push(self, t: float, kind: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, args))

    def _synced(self, p: int, s: int, k: int, t: float, stop: bool) -> None:
        self.synced[p][s] = t
        if s == 0:
            self.wait[p] += t - self.ready_at[(p, s)]
        if stop:
            self.stopped[p] = True
        self.pending[p] -= 1
        if self.pending[p]:
            return
        self.done[p] += 1
        self.finished_at[p] = max(self.synced[p])
        if p in self.next_block and self.blocks is not None:  # its meeting: its next block, as decided
            self.blocks[p].went(k, self.next_block.pop(p))
            self.block_began[p] = self.finished_at[p]
        self.iteration[p] = k + 1
        if self.mode.shares_budget:
            go = not self.stopped[p]
        else:
            go = self.done[p] < self.w.steps
        if go:
            self._start_iteration(p)

    def _allreduce_s(self, members: Sequence[int], s: int, nbytes: float) -> float:
        if len(members) < 2:
            return 0.0
        ranks = self.where[0][s].replicas(list(members))
        return self.w.cluster.allreduce_s(ranks, nbytes) + self.w.collective_s

    def _count(self, members: Sequence[int], s: int, nbytes: float) -> None:
        """A ring all-reduce of ``nbytes`` over ``members`` of stage ``s``, as the workers count
        it: each sends 2(k-1)/k of it, on the slowest link the ring uses."""
        k = len(members)
        if k < 2:
            return
        link = self.w.cluster.slowest_link(self.where[0][s].replicas(list(members))).kind
        self.sent[link] = self.sent.get(link, 0.0) + 2 * (k - 1) * nbytes

    # -- mixing ---------------------------------------------------------------------------------
    def _step(self, p: int, s: int) -> None:
        """Replica (p, s) took a local step. A model of mixing, not of training: each replica
        holds one number, every local step adds independent unit noise to it (the step's own
        gradient), and every averaging its group does averages the numbers. Their spread over
        a stage's replicas, sampled at each of its first stage's steps, is how far the policy
        lets replicas drift apart, in units of one step's noise: 0.59 for four replicas that
        all-reduce after every step (sampled while some have stepped and some not), growing
        as the square root of the steps a replica goes without meeting anyone (9 after 200
        steps of ``sync=none``). Not a loss: a way to compare policies' mixing at no cost."""
        self.drift[p][s] += self.draw.gauss(0.0, 1.0)
        if s == 0:
            x = [row[0] for row in self.drift]
            mean = sum(x) / len(x)
            self.spread[0] += math.sqrt(sum((v - mean) ** 2 for v in x) / len(x))
            self.spread[1] += 1

    def _average(self, s: int, members: Sequence[int]) -> None:
        if len(members) > 1:
            mean = sum(self.drift[q][s] for q in members) / len(members)
            for q in members:
                self.drift[q][s] = mean

    # -- sync modes -----------------------------------------------------------------------------
    def _ready(self, t: float, p: int, s: int, k: int) -> None:
        w = self.w
        self._step(p, s)
        exchange = self.mode.exchange
        if exchange in ("local", "groups") or (exchange == "outer" and (k + 1) % cast(int, w.local_steps)):
            self._synced(p, s, k, t, False)  # groups: the scheduler's decision syncs it
        elif exchange in ("everyone", "pairs", "outer"):
            arrived = self.barriers.setdefault((s, k), {})
            arrived[p] = t
            if len(arrived) == self.P:
                del self.barriers[(s, k)]
                start = max(arrived.values()) + w.collective_s  # everyone agrees to go on
                everyone = list(range(self.P))
                nbytes = w.stage_bytes[s] * BYTES[w.precision] // BYTES["fp32"]  # diloco: bf16
                full = self._allreduce_s(everyone, s, nbytes)  # one ring, computed once
                pairs = exchange == "pairs"
                if not pairs:
                    self._count(everyone, s, nbytes)
                    self._average(s, everyone)
                for q in everyone:
                    if not pairs:
                        cost = full
                    else:
                        mate = gossip_peer(w.seed, s, k, q, self.P)
                        pair = [q, mate] if mate is not None else [q]
                        cost = self._allreduce_s(pair, s, w.stage_bytes[s])
                        self._count(pair, s, w.stage_bytes[s] / 2)  # each pair is met twice
                        if q < pair[-1]:
                            self._average(s, pair)
                    # in the collective from its own arrival: the wait for the others is inside it
                    self.comm_s += start + cost - arrived[q]
                    self._synced(q, s, k, start + cost, False)
                self.groups.append(2 if pairs else self.P)
        else:
            self._push_to_server(t, p, s, k)

    def _push_to_server(self, t: float, p: int, s: int, k: int) -> None:
        """The gradients go to the stage's server (over the slowest link among its replicas),
        which applies one push at a time; the weights come back, held while ``p`` is more than
        ``staleness`` pushes ahead of the slowest replica. The first stage's server counts the
        budget; replies after it is spent tell the pipeline to stop."""
        w = self.w
        link = w.cluster.slowest_link(self.where[p][s].replicas())
        start = max(t + link.transfer_s(w.stage_bytes[s]), self.server_free[s])
        self.server_free[s] = start + w.collective_s
        reply = self.server_free[s] + link.transfer_s(w.stage_bytes[s])
        self.sent["server"] = self.sent.get("server", 0.0) + w.stage_bytes[s]  # the gradients out
        self.comm_s += reply - t
        if s == 0:
            self.budget_left -= 1
        self.pushes[s][p] += 1
        self.deferred[s].append((p, k, reply, s == 0 and self.budget_left <= 0))
        slowest = min(self.pushes[s])
        held = []
        for q, kq, at, stop in self.deferred[s]:
            if self.pushes[s][q] - slowest <= cast(int, w.staleness):
                self._synced(q, s, kq, max(at, t), stop)
            else:
                held.append((q, kq, at, stop))
        self.deferred[s] = held

    def _scheduler(self, t: float, p: int, s: int, k: int) -> None:
        self._step(p, s)
        self.now = max(t, self.sched_free)
        if self.blocks is None:
            meeting = self.meetings.meeting(k)
        else:  # the ready signal says its steps and its block's seconds, as a worker's does
            meeting = self.blocks[p].meeting()
            done = self.block_plan.reported(p, k + 1, self.now)
            if done:
                self.step_s[p] = (self.ready_at[(p, 0)] - self.block_began[p]) / done
        assert self.policy is not None  # only group policies' modes send ready signals here
        self._decided(self.policy.ready(s, p, meeting))
        self.sched_free = self.now + self.w.event_s

    def _decided(self, decisions) -> None:
        w = self.w
        for d in decisions:
            (self.globals if d.kind == "global" else self.groups).append(len(d.members))
            twice = w.average == "weights_grads" and not d.twins  # twins: gradients only
            nbytes = w.stage_bytes[d.stage] * (2 if twice else 1)
            if d.kind == "global" and w.average == "weights_grads":
                nbytes *= 2  # the optimizer's two moments too
            if d.kind == "group":
                nbytes = nbytes * BYTES[w.precision] // BYTES["fp32"]
            cost = self._allreduce_s(d.members, d.stage, nbytes)
            self._count(d.members, d.stage, nbytes)
            self._average(d.stage, d.members)
            self.comm_s += len(d.members) * cost if len(d.members) > 1 else 0.0
            done = self.now + w.rtt_s / 2 + cost
            behind = d.kind == "group" and w.average == "weights" and w.overlap
            for q, k in zip(d.members, d.iterations):  # k: a meeting
                back = done
                if behind:  # merged late: the replica waits only for what its steps do not hide
                    back -= min(cost, w.overlap * self.step_s.get(q, 0.0))
                if self.blocks is None:
                    self._synced(q, d.stage, self.meetings.last_step(k), back, d.stop)
                    continue
                self.next_block[q] = self.block_plan.decide(q, k, w.every, self.step_s,
                                                            self.policy, self.now)
                self._synced(q, d.stage, self.meeting_at[q], back, d.stop)

    # -- the event loop -------------------------------------------------------------------------
    def run(self) -> Result:
        for p in range(self.P):
            self._start_iteration(p)
        handlers = {"ready": self._ready, "scheduler": self._scheduler}
        policy, heap = self.policy, self.heap
        # The policy's deadline changes only when the policy is called (its clock is self.now,
        # which moves only then), so it is asked after each call rather than at every event.
        due = policy.next_deadline() if policy is not None else None
        while heap:
            t = heap[0][0]
            if due is not None and due <= t:
                self.now = max(due, self.sched_free)
                assert policy is not None  # a deadline is the policy's
                decisions = policy.tick()
                self._decided(decisions)
                after = due
                due = policy.next_deadline()
                if decisions or due is None or due > after:
                    continue  # look again: a later deadline may also come before t
            _, _, kind, args = heapq.heappop(heap)
            handlers[kind](t, *args)
            if policy is not None and kind == "scheduler":
                due = policy.next_deadline()
        spread = (self.spread[0] / self.spread[1] if self.spread[1] and self.mode.exchange != "server"
                  else None)  # a parameter server's replicas hold its weights, not their own
        return Result(self.sync, list(self.done), list(self.finished_at), list(self.busy),
                      list(self.wait), list(self.groups), self.w.batch_size, list(self.globals),
                      dict(self.sent), self.comm_s, self.S, spread,
                      [k * self.w.batch_size // self.w.microbatches for k in self.w.shares])


def simulate(work: Workload, sync: str,
             policy_factory: Callable[[Callable[[], float]], GroupScheduler] | None = None) -> Result:
    """Simulate ``work`` under ``sync``; ``policy_factory(clock)`` builds sdpipe's policy."""
    return _Run(work, sync, policy_factory).run()
