"""Membership: pipelines that leave, and restarted ones that rejoin and are healed.

A pipeline that is gone never blocks a group: every stage forgets it at once. Its iterations that
not every stage finished (no decision yet) no longer count: the budget is spent by iterations
that were done, and a restarted pipeline redoes them.

A restarted pipeline (``fault.on_pipeline_loss=restart``) asks, stage by stage, to rejoin; the next
group round of that stage (not a global sync, and none pending) names one member, the first, as
its source, which sends its weights and optimizer state to the restarted replica after its update
(``Decision.heal``). A replica healed then is a copy of a live one, so it joins its source's
component. The pipeline is live again once every stage is healed, and goes on from the first
iteration it had not finished. While a global sync is pending no stage is healed, so a pipeline
never becomes live halfway through one.
"""

from __future__ import annotations

from sdpipe_cli.core.grouping.budget import Planner
from sdpipe_cli.core.grouping.connectivity import Connectivity
from sdpipe_cli.core.grouping.lineage import Lineage
from sdpipe_cli.core.grouping.state import RunState


class Membership:
    """Who left (and where it would go on from), and who waits to be healed at which stage."""

    def __init__(self, run: RunState, planner: Planner, links: Connectivity, lineage: Lineage):
        self.run, self.planner, self.links, self.lineage = run, planner, links, lineage
        self.resume_at: dict[int, int] = {}  # left pipeline -> the iteration it would go on from
        self.healing: dict[int, dict[int, int | None]] = {}  # p -> stage -> source (None: waits)

    def leave(self, pipeline: int, recorded: int | None = None) -> bool:
        """``pipeline`` is gone (failed or finished): forget it everywhere and unblock its peers.
        Its unfinished iterations (and, given ``recorded``, those its last stage did not report)
        are given back to the budget. Whether it was live."""
        run = self.run
        self.healing.pop(pipeline, None)
        if pipeline not in run.live:
            return False
        run.live.discard(pipeline)
        run.forecast.forget(pipeline)
        self.resume_at[pipeline] = self.planner.give_back(pipeline, recorded)
        self.lineage.forget(pipeline)
        target = run.global_at.pop(pipeline, None)
        for st in run.stages:
            st.waiting.pop(pipeline, None)
            st.parked.discard(pipeline)
            st.free.pop(pipeline, None)
        self.links.drop(pipeline)
        if target is not None and run.final and not run.global_closed and not run.time_is_up():
            self.planner.hand_over(target - self.resume_at[pipeline] + 1)
        return True

    def rejoin(self, stage: int, pipeline: int) -> None:
        """Stage ``stage`` of ``pipeline``, which left, was restarted and waits for a source to
        heal from."""
        if pipeline in self.run.live:
            raise ValueError(f"pipeline {pipeline} rejoins but never left")
        if pipeline not in self.resume_at:
            raise ValueError(f"pipeline {pipeline} rejoins but was never live")
        self.healing.setdefault(pipeline, {})[stage] = None

    def heal(self, s: int, source: int) -> tuple[tuple[int, int], ...]:
        """The restarted replicas that ``source``, a member of a group round of stage ``s``
        closing now, heals; a pipeline healed at every stage is live again."""
        if not self.healing or self.run.finished or self.run.pending():
            return ()
        waiting = sorted(p for p, stages in self.healing.items() if stages.get(s, 0) is None)
        healed = tuple((p, self.resume_at[p]) for p in waiting)
        for p in waiting:
            self.healing[p][s] = source
            if len(self.healing[p]) == self.run.S and None not in self.healing[p].values():
                self._admit(p, {st: q for st, q in self.healing.pop(p).items() if q is not None})
        return healed

    def _admit(self, pipeline: int, sources: dict[int, int]) -> None:
        """``pipeline`` was healed at every stage: live again, from ``resume_at``, each replica in
        its source's component; its pace is learned anew."""
        k = self.resume_at.pop(pipeline)
        self.run.live.add(pipeline)
        self.planner.restart_pipeline(pipeline, k)
        self.links.admit(pipeline, sources)
        self.run.forecast.forget(pipeline)
        self.planner.admitted(pipeline)
