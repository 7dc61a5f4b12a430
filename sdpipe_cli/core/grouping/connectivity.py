"""Connectivity: which replicas of a stage have mixed since they were last all connected, and
which rounds must wait until they are.

Replicas that only ever average within their own small groups drift apart. So each stage keeps a
disjoint set of the groups since its replicas were last all connected, and a round that is due
(``connect_every``) does not close without merging what is left (classic), or, under cost_aware,
holds only a round that merges nothing and lies outside the component of the stage's fastest
replica (its *anchor*): the costly replicas never wait, the others come to them.

Under classic only one stage at a time may wait for connectivity (the *token*), as in the
reference: two stages waiting on each other's pipelines could otherwise deadlock, since a pipeline
only moves on when all its stages got their groups. cost_aware needs no token (see
:meth:`Connectivity.may_go_on`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sdpipe_cli.core.grouping.disjoint import DisjointSet
from sdpipe_cli.core.grouping.state import RunState

__all__ = ["Connectivity", "DisjointSet", "without"]


def without(links: DisjointSet, live: Iterable[int]) -> DisjointSet:
    """The same connectivity among the remaining (``live``) replicas."""
    live = list(live)
    rebuilt = DisjointSet(live)
    groups: dict[int, list[int]] = {}
    for p in live:
        groups.setdefault(links.find(p), []).append(p)
    for members in groups.values():
        rebuilt.union(members)
    return rebuilt


class Connectivity:
    """Per stage, who must connect, and the token (classic) or the anchor (cost_aware)."""

    def __init__(self, run: RunState, *, connect_every: int, cost_aware: bool, max_group: int,
                 suspect_after: float | None):
        self.run, self.connect_every, self.cost_aware = run, connect_every, cost_aware
        self.max_group, self.suspect_after = max_group, suspect_after
        self.token: int | None = None  # the stage allowed to wait for connectivity

    def release(self, s: int) -> None:
        """Stage ``s`` no longer waits for connectivity: it gives the token back if it had it."""
        if self.token == s:
            self.token = None

    def reset(self, s: int) -> None:
        """Stage ``s`` is fully connected (a global sync, or a round that merged the rest)."""
        st = self.run.stages[s]
        st.links, st.rounds, st.updates = DisjointSet(self.run.live), 0, 0

    def merged(self, s: int, members: set[int]) -> None:
        """A group round of stage ``s`` closed with ``members``."""
        st = self.run.stages[s]
        st.links.union(members)
        st.rounds += 1
        st.updates += len(members)
        if st.links.components() <= 1:
            self.reset(s)
            self.release(s)

    def drop(self, gone: int) -> None:
        """A pipeline left: the stages keep their connectivity among the others."""
        for st in self.run.stages:
            st.links = without(st.links, self.run.live)

    def admit(self, pipeline: int, sources: dict[int, int]) -> None:
        """A healed pipeline is a copy of its sources: at each stage, in its source's component."""
        for s, st in enumerate(self.run.stages):
            st.links.add(pipeline, sources[s])

    def must_connect(self, s: int) -> bool:
        """Whether this round of stage ``s`` is due to connect all replicas (and may wait for it)."""
        st = self.run.stages[s]
        if self.cost_aware:
            # counted in updates, as the reference does; no token (see may_go_on)
            return not st.global_pending and st.updates >= self.connect_every * len(self.run.live)
        if st.rounds + 1 < self.connect_every:
            return False
        if self.connect_every == 1:
            return True  # every round is a full round: iteration-aligned, no token needed
        if st.global_pending:
            return False  # the pending global sync connects everyone when it closes
        if self.token is None:
            self.token = s
        return self.token == s

    def pick(self, s: int, ready: dict[int, tuple[int, float]]) -> set[int]:
        """A full round's members: the ``max_group`` earliest, but with one replica of another
        component in place of the last when they are all of one component (so that a round due
        to connect still merges)."""
        order = sorted(ready, key=lambda p: (ready[p][1], p))
        members = order[:self.max_group]
        links = self.run.stages[s].links
        if len(links.roots(members)) == 1:
            root = links.find(members[0])
            other = next((p for p in order[self.max_group:] if links.find(p) != root), None)
            if other is not None:
                members[-1] = other
        return set(members)

    def fastest(self, s: int) -> int:
        """The live replica of stage ``s`` of the shortest iteration of its own
        (:meth:`~sdpipe_cli.core.forecast.Forecast.speed`: replicas that wait for each other
        share a pace, not a compute time; unknown ones last, then by number)."""
        return min(self.run.live, key=lambda q: (self._speed(s, q), q))

    def _speed(self, s: int, q: int) -> float:
        speed = self.run.forecast.speed(s, q)
        return float("inf") if speed is None else speed

    def anchor(self, s: int) -> int:
        """cost_aware: the replica whose component a held round of stage ``s`` waits for, the
        stage's fastest (see :meth:`may_go_on`), unless it is overdue by more than
        ``suspect_after`` (a hang or a long stall): then the fastest of the others. Every held
        round waits on the fastest replica's next arrival; while that one is silent, the others'
        rounds would wait with it, and be as silent as a hang themselves."""
        fastest = self.fastest(s)
        if self.suspect_after is None or not self._suspect(s, fastest):
            return fastest
        others = [q for q in self.run.live if not self._suspect(s, q)]
        return min(others, key=lambda q: (self._speed(s, q), q), default=fastest)

    def _suspect(self, s: int, q: int) -> bool:
        due, after = self.run.forecast.expected(s, q), self.suspect_after
        return due is not None and after is not None and self.run.clock() >= due + after  # as hold_until

    def may_go_on(self, s: int, members: set[int]) -> bool:
        """cost_aware: whether a round that is due to connect but does not may close anyway.

        It may if it merges two components (progress), or if its members are the fastest
        replica's component: those are the replicas whose waiting would cost the most, and the
        others come to them. A held round thus waits only for the next arrival from another
        component, and the fastest replica's is never held, so it arrives at every stage each
        iteration: every held round closes within one of its iterations, without a token, and no
        two stages can wait on each other.
        """
        st = self.run.stages[s]
        roots = st.links.roots(members)
        if len(roots) > 1:
            return True
        anchor = self.anchor(s)
        after = self.suspect_after
        due = self.run.forecast.expected(s, anchor) if after is not None else None
        st.hold_until = due + after if due is not None and after is not None else None
        return st.links.find(anchor) in roots
