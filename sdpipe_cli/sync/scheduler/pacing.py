"""The scheduler's side of meetings that follow the wire during the run.

Where a run settled its meetings from its measured wire and they are apart
(:class:`~sdpipe_cli.runtime.protocol.MeetingChoice` ``adapt``), every decision also tells each
member how many local steps its next block takes (``Group.nexts``): the period
:class:`~sdpipe_cli.core.wire.WirePace` wants now, from what the members' ready signals say of
their last round and block. A replica's blocks then differ in length, so the scheduler keeps
what the meetings' count no longer says: each pipeline's local steps, from its ready signals
(``Ready.steps``), and the run's pipeline-steps for the learning rate's clock
(``Group.done_steps``); and when the period changes it counts the policy's budget again in
meetings of the new length (``GroupScheduler.retarget``), so that the run still ends after
about ``train.steps`` per pipeline (within a block, as with a fixed period).

Near the run's end a block is cut to what fits before the budget is spent
(:func:`~sdpipe_cli.core.wire.closing_block`), so that no replica waits at the last global sync
for another's whole block.

Every stage of a pipeline must take the same blocks: the next block of a pipeline's meeting is
decided once, at the first of its stages' rounds, and every other stage's round at that
meeting repeats it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence

from sdpipe_cli.core.wire import LinkFit, WirePace, closing_block
from sdpipe_cli.runtime import protocol
from sdpipe_cli.sync.wire_probe import record

__all__ = ["Pacing", "pacing_of", "wire_summary"]


class Pacing:
    """``chosen``: the start's choice; ``budget``: the run's pipeline-steps
    (``train.steps`` x P); ``pipelines``: P; ``most``: the longest block (``train.steps``)."""

    def __init__(self, chosen: protocol.MeetingChoice, budget: int, pipelines: int, most: int):
        links = {s.stage: LinkFit(s.latency_ms / 1e3, s.mbit_s * 1e6 / 8) for s in chosen.stages}
        self.pace = WirePace(chosen.share, chosen.precision, chosen.every, most, pipelines, links,
                             {s.stage: s.values for s in chosen.stages}, {0: chosen.iteration_s})
        self.budget, self.P = budget, pipelines
        self.steps = {p: 0 for p in range(pipelines)}  # each pipeline's local steps, as said
        self.since: dict[int, float] = {}  # pipeline -> when its steps last moved on
        self.block: dict[int, int] = {}  # pipeline -> the block it is in
        self.blocks: dict[tuple[int, int], int] = {}  # (pipeline, meeting) -> its next block
        self.every = chosen.every  # the period of the blocks decided last
        self.changes: list[dict[str, Any]] = []  # when the period changed, for the metrics

    def resumed(self, steps: dict[int, int]) -> None:
        self.steps.update(steps)

    def ready(self, event: protocol.Ready, now: float) -> None:
        """What a ready signal says of the replica's last round and block (each stage reports
        its round; the block, a pipeline's, is counted once, when its steps move on), at
        ``now`` on the scheduler's clock."""
        if event.wire_s is not None and event.wire_bytes:
            self.pace.round_done(event.stage, event.wire_bytes, event.wire_s)
        if event.steps is None:
            return
        done = event.steps - self.steps.get(event.pipeline, 0)
        if done > 0:
            if event.block_s is not None:
                self.pace.block_done(event.pipeline, done, event.block_s)
            self.steps[event.pipeline] = event.steps
            self.since[event.pipeline] = now

    def nexts(self, members: Sequence[int], meetings: Sequence[int], policy: Any,
              t0: float, now: float) -> list[int]:
        """Each member's next block, decided once per pipeline and meeting (``t0``: the run
        clock's origin, for the metrics; ``now``: the scheduler's clock)."""
        out = []
        for p, k in zip(members, meetings):
            if (p, k) not in self.blocks:
                every = self.pace.every()
                if every != self.every:
                    self._changed(every, policy, round(time.time() - t0, 4))
                self.blocks[(p, k)] = self.block[p] = closing_block(
                    every, p, self.pace.step_s, self.progress(p, now), self.budget)
                self._recount(every, policy)
            out.append(self.blocks[(p, k)])
        return out

    def progress(self, pipeline: int, now: float) -> dict[int, float]:
        """Each pipeline's local steps by ``now``: ``pipeline``'s as it said (it is at its
        meeting), every other's as it said plus the steps its pace fits since, within its
        block. Empty while a pace is unknown."""
        step_s = self.pace.step_s
        if any(step_s.get(q, 0.0) <= 0 or q not in self.since for q in self.steps):
            return {}
        return {q: float(n) if q == pipeline else n + min(
                    self.block.get(q, self.every), max(0.0, now - self.since[q]) / step_s[q])
                for q, n in self.steps.items()}

    def _recount(self, every: int, policy: Any) -> None:
        """The policy's budget counted again, at every block decided: the pipeline-steps left,
        in meetings of the period now. Blocks differ in length (the period changes, the last
        ones are cut), so the meetings a budget is counted in at the start are not the steps it
        holds; counted only when the period changed, the run ended 1-2 % short of its budget,
        its fast replicas waiting for the slow one's last block instead of training."""
        left = max(0, self.budget - self.done_steps())
        policy.retarget(policy.iterations_done() + math.ceil(left / every))

    def _changed(self, every: int, policy: Any, now: float) -> None:
        """The period changes (the policy's budget is counted again in meetings of the new
        length by :meth:`_recount`)."""
        link = min((self.pace.link(s) for s in self.pace.values), key=lambda f: f.bytes_per_s)
        self.changes.append({"kind": "pace", "time": now, "every": every, "was": self.every,
                             "mbit_s": round(link.mbit_s, 3),
                             "step_s": round(min(self.pace.step_s.values()), 6)})
        self.every = every

    def done_steps(self) -> int:
        return sum(self.steps.values())

    def fields(self, nexts: list[int]) -> dict[str, Any]:
        """A group line's: the period, the members' next blocks, the run's pipeline-steps."""
        return {"every": self.every, "nexts": nexts, "done_steps": self.done_steps()}

    def take_changes(self) -> list[dict[str, Any]]:
        out, self.changes = self.changes, []
        return out


def wire_summary(chosen: protocol.MeetingChoice, pacing: Optional[Pacing]) -> dict[str, Any]:
    """``summary.json``'s ``wire``: the start's choice, and the period at the end."""
    out = record(chosen)
    if pacing is not None:
        out["every_now"] = pacing.every
    return out


def pacing_of(chosen: Optional[protocol.MeetingChoice], cfg) -> Optional[Pacing]:
    """The run's pacing, where its meetings follow the wire."""
    if chosen is None or not chosen.adapt:
        return None
    P = int(cfg.cluster.pipelines)
    return Pacing(chosen, P * int(cfg.train.steps), P, int(cfg.train.steps))
