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
for another's whole block; once that sync is declared, the blocks up to it share what is left
of the budget (:func:`~sdpipe_cli.core.wire.final_block`), so that the run ends after exactly
``train.steps`` x P pipeline-steps.

Every stage of a pipeline must take the same blocks: the next block of a pipeline's meeting is
decided once, at the first of its stages' rounds, and every other stage's round at that
meeting repeats it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sdpipe_cli.analysis.records import PaceLine
from sdpipe_cli.config.schema import Config
from sdpipe_cli.core.blocks import BlockPlan
from sdpipe_cli.core.meetings import meetings_of
from sdpipe_cli.core.wire import LinkFit, WirePace
from sdpipe_cli.runtime import protocol
from sdpipe_cli.sync.wire_probe import blocks_allowed, record

__all__ = ["Pacing", "pacing_of", "wire_summary"]


class Pacing:
    """``chosen``: the start's choice, whose period follows the wire (None: a period of
    ``every`` kept, whose blocks are cut only at the run's end); ``budget``: the run's
    pipeline-steps (``train.steps`` x P); ``pipelines``: P; ``most``: the longest block
    (``train.steps``)."""

    def __init__(self, chosen: protocol.MeetingChoice | None, budget: int, pipelines: int,
                 most: int, every: int = 0):
        if chosen is None:
            self.pace = WirePace(1.0, "fp32", every, most, pipelines, {}, {}, {})
        else:
            links = {s.stage: LinkFit(s.latency_ms / 1e3, s.mbit_s * 1e6 / 8)
                     for s in chosen.stages}
            self.pace = WirePace(chosen.share, chosen.precision, chosen.every, most, pipelines,
                                 links, {s.stage: s.values for s in chosen.stages},
                                 {0: chosen.iteration_s})
            every = chosen.every
        self.plan = BlockPlan(budget, pipelines, every)
        self.every = every  # the period of the blocks decided last
        self.changes: list[dict[str, Any]] = []  # when the period changed, for the metrics

    def resumed(self, steps: dict[int, int]) -> None:
        self.plan.resumed(steps)

    def ready(self, event: protocol.Ready, now: float) -> None:
        """What a ready signal says of the replica's last round and block (each stage reports
        its round; the block, a pipeline's, is counted once, when its steps move on), at
        ``now`` on the scheduler's clock."""
        if event.wire_s is not None and event.wire_bytes:
            self.pace.round_done(event.stage, event.wire_bytes, event.wire_s)
        if event.steps is None:
            return
        done = self.plan.reported(event.pipeline, event.steps, now)
        if done > 0 and event.block_s is not None:
            self.pace.block_done(event.pipeline, done, event.block_s)

    def nexts(self, members: Sequence[int], meetings: Sequence[int], policy: Any,
              t0: float, now: float) -> list[int]:
        """Each member's next block, decided once per pipeline and meeting (``t0``: the run
        clock's origin, for the metrics; ``now``: the scheduler's clock)."""
        out = []
        for p, k in zip(members, meetings):
            if (p, k) not in self.plan.blocks:
                every = self.pace.every()
                if every != self.every:
                    self._changed(every, round(time.time() - t0, 4))
            out.append(self.plan.decide(p, k, self.every, self.pace.step_s, policy, now))
        return out

    def _changed(self, every: int, now: float) -> None:
        """The period changes (the policy's budget is then counted again in meetings of the
        new length, as at every block decided)."""
        link = min((self.pace.link(s) for s in self.pace.values), key=lambda f: f.bytes_per_s)
        self.changes.append(PaceLine.line(time=now, every=every, was=self.every,
                                          mbit_s=round(link.mbit_s, 3),
                                          step_s=round(min(self.pace.step_s.values()), 6)))
        self.every = every

    def done_steps(self) -> int:
        return self.plan.done_steps()

    def fields(self, nexts: list[int]) -> dict[str, Any]:
        """A group line's: the period, the members' next blocks, the run's pipeline-steps."""
        return {"every": self.every, "nexts": nexts, "done_steps": self.done_steps()}

    def take_changes(self) -> list[dict[str, Any]]:
        out, self.changes = self.changes, []
        return out


def wire_summary(chosen: protocol.MeetingChoice, pacing: Pacing | None) -> dict[str, Any]:
    """``summary.json``'s ``wire``: the start's choice, and the period at the end."""
    out = record(chosen)
    if pacing is not None:
        out["every_now"] = pacing.every
    return out


def pacing_of(chosen: protocol.MeetingChoice | None, settings: Config) -> Pacing | None:
    """The run's pacing: where its meetings follow the wire; or where they are apart at a
    period of their own (described links, ``sync.every`` set), for its last blocks; none where
    a replica may be healed (:func:`~sdpipe_cli.sync.wire_probe.blocks_allowed`)."""
    P, steps = settings.cluster.pipelines, settings.train.steps
    if chosen is not None and chosen.adapt:
        return Pacing(chosen, P * steps, P, steps)
    every = chosen.every if chosen is not None else meetings_of(settings.sync).every
    if every > 1 and blocks_allowed(settings):
        return Pacing(None, P * steps, P, steps, every)
    return None
