"""The scheduler's side of ``fault.on_slowdown=replan``: straggler lines in, a re-plan decided.

The decision is :func:`sdpipe_cli.core.replan.propose`'s; this holds what it is asked with:
each device's block times from the run's profile (at the speeds the run started with, and the
pipelines' ``cluster.slowdown``), the slowdowns measured since (every device's compute over its
own start, at the moment of a straggler or recovered line, counted where it reaches
``fault.slowdown_threshold``: a slowdown its peers share is a slowdown here, though it named no
one; ``fault.slowed`` carries those of earlier legs), the split, the budget left, and what moving
costs here: the run's own start-up (from the scheduler's start to the first step report) and the
checkpoint's bytes. A split the run was given against the profile's advice (``uniform``, an
explicit one) is not taken back for a slowdown that does not change that advice. At most one
re-plan per leg: once it goes, the run stops at its next consistent point and the next leg starts
resharded (:mod:`sdpipe_cli.cli.run_loop`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from omegaconf import DictConfig

from sdpipe_cli.config import measurements
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.partition import device_cost, plan as partition_plan
from sdpipe_cli.core.replan import Proposal, propose, scaled
from sdpipe_cli.model.optim import state_slots

__all__ = ["Replanning", "checkpoint_bytes", "slowed_key"]

FLOAT_BYTES = 4


def checkpoint_bytes(doc: dict, train: DictConfig, pipelines: int) -> float:
    """What a checkpoint of the whole run holds, from a profile: every replica's weights and
    optimizer state (0 for an older profile without ``block_params``)."""
    params = sum(doc["model"].get("block_params") or [])
    return params * FLOAT_BYTES * (1 + state_slots(train)) * pipelines


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
        self.threshold = float(cfg.fault.slowdown_threshold)
        self.partition = [int(b) for b in cfg.pipeline.partition]
        self.microbatches, self.batch = int(cfg.pipeline.microbatches), int(cfg.train.batch_size)
        self.lock_step = mode(cfg.sync.name).paced_by_slowest
        self.state_bytes = checkpoint_bytes(doc, cfg.train, plan.pipelines)
        self.budget_samples = plan.budget * self.batch
        self.chosen: Optional[Proposal] = None
        # the split the speeds of this leg's start call for (the profile's advice then)
        self.advised = partition_plan(device_cost(scaled(self.base, self.slowed)),
                                      len(self.base[0][0]), plan.stages).bounds

    def consider(self, own: dict[tuple[int, int], Optional[float]], samples_done: float,
                 restart_s: float) -> Optional[Proposal]:
        """After a straggler or recovered line, with every device's own slowdown now (``own``,
        None before its baseline): the proposal (None once one went)."""
        if self.chosen is not None:
            return None
        for where, factor in own.items():
            counted = factor if factor is not None and factor >= self.threshold else 1.0
            self.slowed[where] = self.start[where] * counted
        proposal = propose(scaled(self.base, self.slowed), self.partition, self.microbatches, self.batch,
                           self.lock_step, max(0.0, self.budget_samples - samples_done),
                           restart_s, self.state_bytes)
        if proposal.go and proposal.bounds == self.advised != self.partition:
            proposal = dataclasses.replace(proposal, go=False, reason=(
                f"{proposal.bounds} is what the profile advised at the start too; the run's own "
                f"split {self.partition} was given"))
        if proposal.go:
            self.chosen = proposal
        return proposal

    def slowed_now(self) -> dict[str, float]:
        """``fault.slowed`` for the next leg: every device measured slower so far."""
        return {slowed_key(p, s): round(f, 4) for (p, s), f in sorted(self.slowed.items())
                if f != 1.0}
