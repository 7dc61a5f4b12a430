"""One flushed iteration of a pipeline as the simulator walks it: the schedule's actions in an
order that respects their dependencies (its own tick order), each with the action it waits for,
and the same iteration with runs of a stage's actions that nothing observes fused into one.

Pure: built from :mod:`~sdpipe_cli.core.schedule`'s action lists.
"""

from __future__ import annotations

from collections.abc import Callable

from sdpipe_cli.core.interleaved import schedule_of, virtual_stage
from sdpipe_cli.core.schedule import SPLIT_SCHEDULES, SPLIT_SHARE, Kind, tick_order

__all__ = ["IterationPlan"]


class IterationPlan:
    """One flushed iteration of a pipeline as a list of actions in an order that respects their
    dependencies (the schedule's own tick order), with each action's dependency precomputed.

    With ``chunks`` model chunks a stage (an interleaved schedule), an action depends on the
    neighbouring *virtual* stage's (:mod:`~sdpipe_cli.core.interleaved`), runs on its chunk
    (:attr:`chunk`, whose share of the stage's time the workload says), and the messages
    between the last stage's chunk ``c`` and the first's ``c + 1`` cross the *wrap*
    (:attr:`wraps`)."""

    def __init__(self, schedule: str, stages: int, microbatches: int, chunks: int = 1):
        fn = schedule_of(schedule, chunks)
        rows = tick_order(fn, stages, microbatches, chunks=chunks)
        order = sorted((t, s) for s, row in enumerate(rows) for t, a in enumerate(row) if a is not None)
        last = stages * chunks - 1
        position: dict[tuple[Kind, int, int], int] = {}
        self.steps: list[tuple[int, bool, int]] = []  # (stage, backward, index of dependency)
        # of its chunk's forward or backward time, what each action takes: SPLIT_SHARE for each
        # of a split backward's B and W (a W waits for no transfer), else all of it
        self.share: list[float] = []
        self.chunk: list[int] = []  # the action's chunk (0 but in an interleaved schedule)
        self.wraps: list[bool] = []  # whether the action's input crosses from the last stage to the first
        split = schedule in SPLIT_SCHEDULES
        for t, s in order:
            action = rows[s][t]
            assert action is not None  # order holds the ticks with an action
            backward = action.kind is not Kind.F
            k = virtual_stage(s, action.chunk, stages)
            dep = ((Kind.B, k + 1, action.microbatch) if action.kind is Kind.B and k < last
                   else (Kind.F, k - 1, action.microbatch) if not backward and k > 0 else None)
            position[(action.kind, k, action.microbatch)] = len(self.steps)
            self.steps.append((s, backward, position[dep] if dep is not None else -1))
            share = SPLIT_SHARE if split and backward else 1.0
            self.share.append(share)
            self.chunk.append(action.chunk)
            self.wraps.append((action.kind is Kind.F and s == 0 and action.chunk > 0)
                              or (action.kind is Kind.B and s == stages - 1 and action.chunk < chunks - 1))
        self.fused, self.members = self._fuse(self.steps)

    def makespan(self, cost: Callable[[int, bool, int], float]) -> float:
        """One iteration's length when the action of stage ``s`` on chunk ``c`` takes
        ``cost(s, backward, c)`` (a split backward's ``B`` and ``W`` each their :attr:`share`
        of it) and nothing else (no transfer, no sync): each action starts once its stage is
        free and the action it waits for has ended."""
        free: dict[int, float] = {}
        ends: list[float] = []
        for (s, backward, dep), c, share in zip(self.steps, self.chunk, self.share):
            start = max(free.get(s, 0.0), ends[dep] if dep >= 0 else 0.0)
            ends.append(start + cost(s, backward, c) * share)
            free[s] = ends[-1]
        return max(ends, default=0.0)

    @staticmethod
    def _fuse(steps: list[tuple[int, bool, int]]
              ) -> tuple[list[tuple[int, bool, int]], list[list[int]]]:
        """The same iteration with each run of a stage's actions that nothing in between
        observes taken as one: an action that waits for no other stage joins the stage's
        previous one if no other stage waits for that. With a fixed scale per stage and
        iteration the ends that matter are unchanged; a pipeline of one stage becomes a single
        action, which is what makes many-pipeline simulations fast. Returns the fused actions as
        :attr:`steps` lists them (with the first one's direction) and the actions each sums."""
        observed = {dep for _, _, dep in steps if dep >= 0}
        fused: list[tuple[int, bool, int]] = []
        members: list[list[int]] = []
        at: dict[int, int] = {}  # original action -> its fused action
        open_: dict[int, int] = {}  # stage -> the fused action its next one may join
        for i, (s, backward, dep) in enumerate(steps):
            j = open_.get(s) if dep < 0 else None
            if j is None:
                j = len(fused)
                fused.append((s, backward, at[dep] if dep >= 0 else -1))
                members.append([])
            members[j].append(i)
            at[i] = j
            if i in observed:
                open_.pop(s, None)
            else:
                open_[s] = j
        return fused, members
