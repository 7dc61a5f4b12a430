"""The scheduler's side of ``fault.on_slowdown=replan``: straggler lines in, a re-plan decided.

The decision is :func:`sdpipe_cli.core.replan.propose`'s; this holds what it is asked with:
each device's block times from the run's profile (at the speeds the run started with, and the
pipelines' ``cluster.slowdown``), the slowdowns measured since (a straggler line's ``slower``;
``fault.slowed`` carries those of earlier legs), the split, the budget left, and what moving
costs here: the run's own start-up (from the scheduler's start to the first step report) and the
checkpoint's bytes. At most one re-plan per leg: once it goes, the run stops at its next
consistent point and the next leg starts resharded (:mod:`sdpipe_cli.cli.run_loop`).
"""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig

from sdpipe_cli.config import measurements
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.replan import Proposal, propose

__all__ = ["Replanning", "slowed_key"]

FLOAT_BYTES = 4


def slowed_key(pipeline: int, stage: int) -> str:
    """How ``fault.slowed`` names a device: ``p<pipeline>s<stage>``."""
    return f"p{pipeline}s{stage}"


class Replanning:
    """One leg's re-plan state: the measured slowdowns and the proposal that went, if any."""

    def __init__(self, cfg: DictConfig, plan: RunPlan):
        doc = measurements.load(cfg.profile)
        self.base = measurements.worker_block_ms(doc, plan.cluster, list(cfg.cluster.slowdown))
        # each device's slowdown when this leg began (earlier legs measured it), and now
        self.start = {(p, s): float(cfg.fault.slowed.get(slowed_key(p, s), 1.0))
                      for p in range(plan.pipelines) for s in range(plan.stages)}
        self.slowed = dict(self.start)
        self.partition = [int(b) for b in cfg.pipeline.partition]
        self.microbatches, self.batch = int(cfg.pipeline.microbatches), int(cfg.train.batch_size)
        self.lock_step = mode(cfg.sync.name).paced_by_slowest
        t = cfg.train
        slots = 2 if t.optimizer == "adamw" else (1 if t.momentum else 0)
        params = sum(doc["model"].get("block_params") or [])  # older profiles lack it: 0
        self.state_bytes = params * FLOAT_BYTES * (1 + slots) * plan.pipelines
        self.budget_samples = plan.budget * self.batch
        self.chosen: Optional[Proposal] = None

    def consider(self, line: dict[str, Any], samples_done: float, restart_s: float
                 ) -> Optional[Proposal]:
        """A straggler or recovered line: the proposal it leads to (None once one went)."""
        if self.chosen is not None:
            return None
        where = (int(line["pipeline"]), int(line["stage"]))
        # the detector measures a device against its own start of this leg
        recovered = line["kind"] == "recovered"
        self.slowed[where] = self.start[where] * (1.0 if recovered else float(line["slower"]))
        block_ms = [[[t * self.slowed[(p, s)] for t in row] for s, row in enumerate(rows)]
                    for p, rows in enumerate(self.base)]
        proposal = propose(block_ms, self.partition, self.microbatches, self.batch,
                           self.lock_step, max(0.0, self.budget_samples - samples_done),
                           restart_s, self.state_bytes)
        if proposal.go:
            self.chosen = proposal
        return proposal

    def slowed_now(self) -> dict[str, float]:
        """``fault.slowed`` for the next leg: every device measured slower so far."""
        return {slowed_key(p, s): round(f, 4) for (p, s), f in sorted(self.slowed.items())
                if f != 1.0}
