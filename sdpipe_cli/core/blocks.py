"""How long each block of local steps is, where replicas meet only every few steps: the
scheduler's decision (``Group.nexts``), and the simulator's, which runs the same.

A block is the period (``sync.every``, fixed or following the wire, :mod:`.wire`) except at the
run's end, where two things matter that a period cannot see:

* the last global sync waits for every replica, so a block that ends after the others' is
  waited for by all of them (:func:`closing_block` cuts it to what fits);
* the policy counts meetings, not steps, so blocks of different lengths would end the run
  beside its budget (:class:`BlockPlan` counts the policy's budget again at every block, and
  once the last global sync is declared, :func:`final_block` shares out exactly what is left).

Pure: no I/O, no clock of its own; the policy is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["BlockPlan", "closing_block", "final_block"]


def closing_block(every: int, pipeline: int, step_s: Mapping[int, float],
                  progress: Mapping[int, float], budget: float | None) -> int:
    """The block ``pipeline`` takes next, decided at its meeting now: ``every`` local steps, or
    fewer where the run's budget is spent before they would end.

    The pipelines spend the budget (``budget`` pipeline-steps; None: a run bounded by time
    alone) together, each at its own pace (``step_s``: its seconds per local step), from
    ``progress`` (each one's local steps by now). The run ends about when what is left is done
    at their summed rate, and the last global sync waits for every replica: a block that ends
    later holds every other replica there until it does. A 3x slower replica's whole block of
    H = 12 is 36 of the fast ones' steps, a third of a 100-step run; the fast ones waited for it
    at the end of every run on a slow link. So the block is cut to the whole steps that fit by
    then (at least one): the replica arrives at about the others' time, rather than after them
    (ending a little early costs the slow replica a part of a step; ending late costs every
    other replica as much). Before every pipeline's pace is known, ``every``."""
    if budget is None or not progress or any(step_s.get(q, 0.0) <= 0 for q in progress):
        return every
    rate = sum(1.0 / step_s[q] for q in progress)
    until = (budget - sum(progress.values())) / rate
    return max(1, min(every, math.floor(until / step_s[pipeline] + 1e-9)))


def final_block(pipeline: int, budget: int, committed: Mapping[int, int],
                progress: Mapping[int, float], undecided: Mapping[int, int],
                step_s: Mapping[int, float]) -> int:
    """The block ``pipeline`` takes next, once the run's last global sync is declared by its
    budget (``budget`` pipeline-steps in all): the blocks not decided yet (``undecided``: per
    pipeline, this one's included) end together, at the one moment at which the pipelines,
    each at its pace (``step_s``; equal where one is unknown) from where it is now
    (``progress``), have done the budget, none fewer steps than its decided blocks hold
    (``committed``; ``pipeline``'s: the steps it has done). The last block of the run takes
    what is left, so that the run ends after exactly its budget. Every block has a step at
    least.

    (Sharing what is left among the undecided blocks alone, in proportion to pace, gave too
    little to whoever decided early: four equal pipelines of H = 12 and 50 steps ended at 56,
    48, 48 and 48, three replicas idle for 8 steps.)"""
    left = budget - sum(committed.values())
    blocks = sum(n for n in undecided.values() if n > 0)
    if blocks <= 1:
        return max(1, left)
    known = all(step_s.get(q, 0.0) > 0 for q in undecided)
    rate = {q: (1.0 / step_s[q] if known else 1.0) for q, n in undecided.items() if n > 0}
    fixed = sum(n for q, n in committed.items() if q not in rate)

    def done_by(t: float) -> float:  # pipeline-steps done by t seconds from now
        return fixed + sum(max(committed[q], progress[q] + r * t) for q, r in rate.items())

    low, high = 0.0, 1.0
    while done_by(high) < budget and high < 1e12:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if done_by(mid) < budget else (low, mid)
    share = (progress[pipeline] + rate[pipeline] * high - committed[pipeline]) / undecided[pipeline]
    return max(1, min(left - (blocks - 1), round(share)))


class BlockPlan:
    """Each pipeline's blocks, decided once per pipeline and meeting: ``budget`` pipeline-steps
    over ``pipelines`` pipelines, blocks of ``every`` steps until the first decision."""

    def __init__(self, budget: int, pipelines: int, every: int):
        self.budget = budget
        self.steps = {p: 0 for p in range(pipelines)}  # each pipeline's local steps, as said
        self.since: dict[int, float] = {}  # pipeline -> when its steps last moved on
        self.block: dict[int, int] = {}  # pipeline -> the block it is in
        self.decided: dict[int, int] = {}  # pipeline -> the meeting its last block was decided at
        self.committed: dict[int, int] = {}  # pipeline -> its steps at the end of that block
        self.blocks: dict[tuple[int, int], int] = {}  # (pipeline, meeting) -> its next block
        self.every = every

    def resumed(self, steps: Mapping[int, int]) -> None:
        """Each pipeline goes on from ``steps``: its first block ends where a fixed period's
        would (:class:`~sdpipe_cli.core.wire.Blocks`), at the end of meeting
        ``steps // every``."""
        for q, n in steps.items():
            self.steps[q] = n
            self.decided[q] = n // self.every - 1
            self.committed[q] = (n // self.every + 1) * self.every

    def reported(self, pipeline: int, steps: int, now: float) -> int:
        """``pipeline`` says it has done ``steps`` local steps, at ``now``; returns how many
        since it last said (0: nothing new, a second stage's signal of the same meeting)."""
        done = steps - self.steps.get(pipeline, 0)
        if done > 0:
            self.steps[pipeline] = self.committed[pipeline] = steps
            self.since[pipeline] = now
        return max(done, 0)

    def decide(self, pipeline: int, meeting: int, every: int, step_s: Mapping[int, float],
               policy: Any, now: float) -> int:
        """``pipeline``'s block after ``meeting`` (the period now ``every``; ``step_s``: each
        pipeline's seconds per local step, as measured), and the policy's budget counted again
        in meetings of ``every``."""
        key = (pipeline, meeting)
        if key in self.blocks:
            return self.blocks[key]
        final = policy.final_at(pipeline)
        if final is not None and meeting < final:  # the budget's last blocks: exact
            committed = {q: self.committed.get(q, n) for q, n in self.steps.items()}
            committed[pipeline] = self.steps[pipeline]
            progress = (self.progress(pipeline, now, step_s)
                        or {q: float(n) for q, n in committed.items()})
            block = final_block(pipeline, self.budget, committed, progress,
                                self._undecided(pipeline, meeting, policy), step_s)
        else:
            block = closing_block(every, pipeline, step_s, self.progress(pipeline, now, step_s),
                                  self.budget)
        self.blocks[key] = self.block[pipeline] = block
        self.decided[pipeline] = meeting
        self.committed[pipeline] = self.steps[pipeline] + block
        self.every = every
        # Blocks differ in length (the period changes, the last ones are cut), so the meetings
        # a budget was counted in are not the steps it holds: counted only when the period
        # changed, runs ended 1-6 % beside their budget.
        left = max(0, self.budget - self.done_steps())
        policy.retarget(policy.iterations_done() + math.ceil(left / every))
        return block

    def done_steps(self) -> int:
        return sum(self.steps.values())

    def _undecided(self, pipeline: int, meeting: int, policy: Any) -> dict[int, int]:
        """Per pipeline in the last global sync, its blocks up to it not decided yet:
        ``pipeline``'s from the one at ``meeting`` on."""
        out = {}
        for q in self.steps:
            final = policy.final_at(q)
            if final is not None:
                last = meeting - 1 if q == pipeline else self.decided.get(q, -1)
                out[q] = final - 1 - last
        return out

    def progress(self, pipeline: int, now: float, step_s: Mapping[int, float]
                 ) -> dict[int, float]:
        """Each pipeline's local steps by ``now``: ``pipeline``'s as it said (it is at its
        meeting), every other's as it said plus the steps its pace fits since, within its
        block. Empty while a pace is unknown."""
        if any(step_s.get(q, 0.0) <= 0 or q not in self.since for q in self.steps):
            return {}
        return {q: float(n) if q == pipeline else n + min(
                    self.block.get(q, self.every), max(0.0, now - self.since[q]) / step_s[q])
                for q, n in self.steps.items()}
