"""Round formation: when a stage's open round closes, and with whom.

The first ready replica of a stage opens a round with a window of its own adaptive length; the
round closes when every available replica of the stage is ready, or when the window (and the
horizon of the replicas it waits for, :mod:`.prediction`) ends, with everyone ready at that
moment, unless it is due to connect the stage (:mod:`.connectivity`). A replica's window doubles
(up to ``window_max``) when its group had fewer than ``min_group`` members and shrinks by 0.9
(down to ``window_min``) otherwise, so fast replicas learn to wait a little for each other while
stragglers never hold them up. A pending global sync closes at a stage once every live replica is
parked at its target there.
"""

from __future__ import annotations

from collections.abc import Container

from sdpipe_cli.core.grouping.budget import Planner
from sdpipe_cli.core.grouping.connectivity import Connectivity
from sdpipe_cli.core.grouping.freshness import Freshness
from sdpipe_cli.core.grouping.lineage import Lineage
from sdpipe_cli.core.grouping.membership import Membership
from sdpipe_cli.core.grouping.prediction import Prediction
from sdpipe_cli.core.grouping.state import (
    JOINED,
    LEFT_OUT,
    REASONS,
    Decision,
    Joined,
    LeftOut,
    Reason,
    RunState,
    StageState,
)

__all__ = ["JOINED", "LEFT_OUT", "REASONS", "RoundFormer"]


class RoundFormer:
    """Closes rounds (group and global) as replicas arrive and deadlines pass."""

    def __init__(self, run: RunState, *, links: Connectivity, prediction: Prediction,
                 planner: Planner, membership: Membership, lineage: Lineage,
                 freshness: Freshness, window: float, min_group: int, window_min: float,
                 window_max: float, max_group: int, cost_aware: bool):
        self.run, self.links, self.prediction = run, links, prediction
        self.planner, self.membership, self.lineage = planner, membership, lineage
        self.freshness = freshness
        self.min_group, self.window_min, self.window_max = min_group, window_min, window_max
        self.max_group, self.cost_aware = max_group, cost_aware
        self.window = {(s, p): window for s in range(run.S) for p in range(run.P)}

    def arrived(self, stage: int, pipeline: int, iteration: int, now: float) -> None:
        """``pipeline``'s replica of ``stage`` is ready for ``iteration`` at ``now``."""
        run = self.run
        st = run.stages[stage]
        st.waiting[pipeline] = (iteration, now)
        if st.global_pending and run.global_at.get(pipeline) == iteration:
            st.parked.add(pipeline)
        else:
            st.free[pipeline] = (iteration, now)
            self.prediction.joined(stage, pipeline, now)

    def deadlines(self) -> list[float]:
        """When an open round closes without everyone, or a held one stops waiting for its
        anchor."""
        stages = self.run.stages
        times = [st.deadline for st in stages
                 if st.waiting and st.deadline is not None and not st.connecting]
        times += [st.hold_until for st in stages
                  if st.connecting and st.waiting and st.hold_until is not None]
        return times

    def decide(self) -> list[Decision]:
        decisions: list[Decision] = []
        progress = True
        while progress:
            progress = False
            for s in range(self.run.S):
                decision = self._close_global(s) or self._close_group(s)
                if decision is not None:
                    decisions.append(decision)
                    progress = True
        return decisions

    def _at_global(self, s: int) -> set[int]:
        st = self.run.stages[s]
        return st.parked if st.global_pending else set()

    def _close_global(self, s: int) -> Decision | None:
        run = self.run
        st = run.stages[s]
        arrived = self._at_global(s)
        if not st.global_pending or not run.live or not arrived >= run.live:
            return None
        decision = self._emit(s, sorted(arrived), kind="global", stop=run.final,
                              reason="stop" if run.final else "global")
        self.links.reset(s)
        st.global_pending = False
        run.global_closed.add(s)
        self.links.release(s)
        if not run.pending():
            run.global_at = {}
            run.finished = run.final
        return decision

    def _close_group(self, s: int) -> Decision | None:
        run = self.run
        st = run.stages[s]
        at_global = self._at_global(s)
        ready = st.free
        if not ready:
            st.deadline, st.window_end, st.connecting, st.opener = None, None, False, None
            self.links.release(s)
            return None
        now = run.clock()
        if st.window_end is None:
            opener = st.opener = min(ready, key=lambda p: (ready[p][1], p))
            opened = ready[opener][1]
            st.window_end = opened + self.window[(s, opener)]
            self.prediction.open(s, opener, opened, ready, at_global)
        full = bool(self.max_group) and len(ready) >= self.max_group
        members = self.links.pick(s, ready) if full else set(ready)
        # wait for the predicted replicas until they came or the horizon passed
        missing = st.expect.difference(members)
        if missing and at_global:
            missing -= at_global
        st.deadline = max(st.window_end, st.horizon) if missing else st.window_end
        everyone = len(members) == len(run.live) - len(at_global)  # members: live, not at_global
        reason: Reason = "all"
        if not everyone:
            if now < st.deadline and not full:  # a full round does not wait for more
                return None
            held = st.connecting
            # a full round cannot hold everyone: merging two components is progress enough
            st.connecting = (self.links.must_connect(s) and not st.links.connected_with(members)
                             and not (self.cost_aware and self.links.may_go_on(s, members))
                             and not (full and len(st.links.roots(members)) > 1)
                             and not self._held_elsewhere(s, members, at_global))
            if st.connecting:
                return None  # wait for the components that are left
            reason = self._why(full, held, missing, st.expect)
        members = set(members)
        outside = self._left_out(members, ready, st.expect, at_global)
        decision = self._emit(s, sorted(members), kind="group", stop=False, reason=reason,
                              outside=outside, inside=self._joined(members, st))
        self.links.merged(s, members)
        for p in members:
            key = (s, p)
            grow = len(members) < self.min_group
            self.window[key] = (min(self.window[key] * 2, self.window_max) if grow
                                else max(self.window[key] * 0.9, self.window_min))
        return decision

    def _held_elsewhere(self, s: int, members: set[int], at_global: set[int]) -> bool:
        """Whether every live replica this round lacks is held in another stage's round that
        itself waits to connect: waiting there for an iteration this stage has decided for it
        already, it comes here only once that round closes, which may wait for this round's own
        members (a restarted pipeline healed to an earlier iteration than the others': each
        stage's full round then lacks a replica held in the other's). Of such a cycle of holds
        the round that looks second goes on."""
        run = self.run
        missing = run.live - members - at_global
        return bool(missing) and all(
            any(q in run.stages[t].waiting and run.stages[t].connecting
                and run.decided[q][s] >= run.stages[t].waiting[q][0]
                for t in range(len(run.stages)) if t != s)
            for q in missing)

    @staticmethod
    def _why(full: bool, held: bool, missing: frozenset, expected: frozenset) -> Reason:
        """Why a group round closed without every live replica (:data:`REASONS`)."""
        if full:
            return "cap"
        if held:
            return "connected"
        if missing:
            return "late"
        return "expected" if expected else "window"

    def _left_out(self, members: set[int], ready: Container[int], expected: frozenset,
                  at_global: set[int]) -> tuple[tuple[int, LeftOut], ...]:
        """Each live pipeline not in ``members``, with why (:data:`LEFT_OUT`)."""
        return tuple((p, "global" if p in at_global else "capped" if p in ready
                      else "late" if p in expected else "busy")
                     for p in sorted(self.run.live - members))

    @staticmethod
    def _joined(members: set[int], st: StageState) -> tuple[tuple[int, Joined], ...]:
        """Each member of a group round, with why it is in (:data:`JOINED`)."""
        return tuple((p, "opened" if p == st.opener else "expected" if p in st.expect else "ready")
                     for p in sorted(members))

    def _emit(self, s: int, members: list[int], kind: str, stop: bool, reason: Reason,
              outside: tuple[tuple[int, LeftOut], ...] = (),
              inside: tuple[tuple[int, Joined], ...] = ()) -> Decision:
        run = self.run
        st = run.stages[s]
        now = run.clock()
        st.round_no += 1
        group = kind == "group"
        heal = self.membership.heal(s, members[0]) if group else ()
        twins = group and self.lineage.alike(members)
        done = self.planner.iterations_done()
        weight_shares, grad_shares = self.freshness.shares(s, members, done, twins)
        decision = Decision(stage=s, round=st.round_no, members=tuple(members),
                            iterations=tuple(st.waiting[p][0] for p in members),
                            waited=tuple(now - st.waiting[p][1] for p in members),
                            kind=kind, stop=stop, heal=heal, twins=twins, reason=reason, outside=outside,
                            inside=inside, weight_shares=weight_shares, grad_shares=grad_shares)
        self.lineage.note(decision)
        self.freshness.note(s, members, done)
        for q, _ in heal:
            self.freshness.healed(s, q, members[0])
        for p in members:
            run.decided[p][s] = st.waiting[p][0]
            self.planner.release(s, p, st.waiting[p][0], now)
            del st.waiting[p]
            st.parked.discard(p)
            st.free.pop(p, None)
        st.deadline, st.window_end, st.connecting, st.opener = None, None, False, None
        return decision
