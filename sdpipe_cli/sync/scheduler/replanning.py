"""The scheduler's side of ``fault.on_slowdown=replan``: straggler lines in, a re-plan decided.

The decision is :func:`sdpipe_cli.core.replan.propose`'s; this holds what it is asked with:
each device's block times from the run's profile (at the speeds the run started with, and the
pipelines' ``cluster.slowdown``), the slowdowns measured since (every device's compute over its
speed before any slowdown, at the moment of a straggler or recovered line, counted where it
reaches ``fault.slowdown_threshold``: a slowdown its peers share is a slowdown here, though it
named no one), the splits, the budget left, and what moving costs here: the run's own start-up
(from the scheduler's start to the first step report) and the checkpoint's bytes. A split that
would not fit a device's declared memory is declined before anything stops.

**In place** (``fault.replan_in_place``, sdpipe: the plan's ``in_place``): a re-plan that changes
some pipelines' splits but leaves at least one live pipeline as it was does not stop the run.
The scheduler asks the launcher, in the progress snapshot (``resplit``), to restart those
pipelines on their new splits; when each is announced under its new incarnation, the scheduler
says where its blocks lie from then on (:class:`~sdpipe_cli.runtime.protocol.Split`). They
rejoin and heal from the others, as a pipeline restarted after a failure does, while the others
go on. Its devices' slowdowns are carried into their new baselines, and once every one of them
is back and healed, another re-plan may follow (back, when a device recovers).

``fault.slowed`` carries the slowdowns of earlier legs: the detector measures such a device from
its speed before them (:mod:`sdpipe_cli.core.slowdowns`), so it recovers when it is back to it,
and the re-plan at that recovery goes back to the split its speeds then call for. At most one
re-plan per leg that stops the run: it stops at its next consistent point and the next leg starts
resharded (:mod:`sdpipe_cli.cli.run_loop`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, cast

from omegaconf import DictConfig

from sdpipe_cli.config import measurements
from sdpipe_cli.config.schema import Config, TrainConfig
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.replan import Proposal, as_config, called_for, pace_bound, propose, scaled
from sdpipe_cli.core.slowdowns import carried_of, slowed_key
from sdpipe_cli.data import sources
from sdpipe_cli.model import memory
from sdpipe_cli.model.optim import state_slots

__all__ = ["Replanning", "checkpoint_bytes"]

FLOAT_BYTES = 4


def checkpoint_bytes(doc: dict, train: TrainConfig | DictConfig, pipelines: int) -> float:
    """What a checkpoint of the whole run holds, from a profile: every replica's weights and
    optimizer state (0 for an older profile without ``block_params``)."""
    params = sum(doc["model"].get("block_params") or [])
    return params * FLOAT_BYTES * (1 + state_slots(train)) * pipelines


class Replanning:
    """One leg's re-plan state: the measured slowdowns and the proposal that went, if any.

    ``settings``: the run's config, typed, which this reads; ``cfg``: the same, the record,
    which a new split's memory is estimated from."""

    def __init__(self, cfg: DictConfig, settings: Config, plan: RunPlan):
        fault, pipeline = settings.fault, settings.pipeline
        doc = measurements.load(cfg.profile)  # the launcher's path (validated, resolved)
        self.base = measurements.worker_block_ms(doc, plan.cluster, list(settings.cluster.slowdown))
        # each device's slowdown when this leg began (earlier legs measured it), and now
        self.start = carried_of(fault.slowed, plan.pipelines, plan.stages)
        self.slowed = dict(self.start)
        self.threshold = fault.slowdown_threshold
        self.partitions = [list(b) for b in plan.partitions]  # each pipeline's split
        self.shared = [int(b) for b in pipeline.partition]  # theirs unless given their own
        self.microbatches, self.batch = pipeline.microbatches, settings.train.batch_size
        self.pace = pace_bound(mode(settings.sync.name).paced_by_slowest, settings.sync)
        self.own = mode(settings.sync.name).segments  # pipelines may be split apart
        self.state_bytes = checkpoint_bytes(doc, settings.train, plan.pipelines)
        self.budget_samples = plan.budget * self.batch
        self.chosen: Proposal | None = None
        self.memory_of = (cfg, plan) if settings.run.memory_check else None  # to check a split
        # the splits the speeds of this leg's start call for (the profile's advice then)
        self.chunks, self.schedule = plan.chunks, pipeline.schedule  # its timeline
        self.advised = called_for(scaled(self.base, self.slowed), self.own, self.chunks,
                                  self.microbatches, self.schedule)
        self.in_place = plan.in_place
        self.stages = plan.stages
        self.resplitting: dict[int, list[int]] = {}  # pipeline -> its new split, until restarted
        self.healing: set[int] = set()  # restarted on their new splits, until live again
        self.resplits = 0  # re-splits in place asked for in this leg
        # the last one, for the progress snapshot (``resplit``), which the launcher acts on
        self.asked: dict[str, Any] | None = None

    def resplit(self, live: frozenset[int]) -> list[int]:
        """The pipelines the chosen proposal re-splits in place, now asked for (none: the run
        stops instead). In place needs a plan for it, and a live pipeline left as it was to heal
        the others from."""
        chosen = cast(Proposal, self.chosen)  # asked once a proposal went (consider chose it)
        changed = [p for p, (now, new) in enumerate(zip(chosen.current, chosen.bounds))
                   if list(now) != list(new)]
        if not (self.in_place and changed and set(live) - set(changed)
                and set(changed) <= set(live)):
            return []
        self.resplitting = {p: list(chosen.bounds[p]) for p in changed}
        self.resplits += 1
        self.asked = {"version": self.resplits,
                      "partitions": {str(p): b for p, b in sorted(self.resplitting.items())},
                      "slowed": self.slowed_now()}
        return changed

    def restarted(self, pipeline: int) -> list[int] | None:
        """``pipeline`` came back on its new split (None: it was not to be re-split): its
        devices' slowdowns as of now are where its next baselines start from."""
        bounds = self.resplitting.pop(pipeline, None)
        if bounds is None:
            return None
        self.partitions[pipeline] = bounds
        for s in range(self.stages):
            self.start[(pipeline, s)] = self.slowed[(pipeline, s)]
        self.healing.add(pipeline)
        return bounds

    def release(self, live: frozenset[int]) -> None:
        """Once every re-split pipeline is back and healed (``live``), the next re-plan may
        go: until then the run has no checkpoint with its new split to stop at."""
        if self.chosen is not None and not self.resplitting and self.healing <= set(live) \
                and self.resplits:
            self.chosen, self.healing = None, set()
            self.advised = called_for(scaled(self.base, self.slowed), self.own, self.chunks,
                                      self.microbatches, self.schedule)

    def consider(self, own: dict[tuple[int, int], float | None], samples_done: float,
                 restart_s: float, policy: Any = None) -> Proposal | None:
        """After a straggler or recovered line, with every device's own slowdown now (``own``,
        None before its baseline): the proposal (None once one went). Predicted with the pace
        model of the group ``policy`` (sdpipe's), as it stands: how much slower than the
        fastest a pipeline may be and still be waited for (``tolerance()``); a lock-step mode
        waits for every pipeline."""
        if self.chosen is not None:
            return None
        pace = self.pace
        if policy is not None and pace != math.inf:
            pace = policy.tolerance()
        for where, factor in own.items():
            if factor is None:  # no baseline yet: as the leg began
                self.slowed[where] = self.start[where]
            else:  # measured from its speed before any slowdown (carried ones included)
                self.slowed[where] = factor if factor >= self.threshold else 1.0
        proposal = propose(scaled(self.base, self.slowed), self.partitions, self.advised,
                           self.microbatches, self.batch, pace, self.own,
                           max(0.0, self.budget_samples - samples_done), restart_s,
                           self.state_bytes, in_place=self.in_place, schedule=self.schedule)
        over = self.over_memory(proposal.bounds) if proposal.go else None
        if over is not None:
            proposal = replace(proposal, go=False, reason=f"the new split does not fit: {over}")
        if proposal.go:
            self.chosen = proposal
        return proposal

    def over_memory(self, splits: list[list[int]]) -> str | None:
        """Why ``splits`` would not fit a device's declared memory (None: it would, as far as
        is known before the stop; the next leg's launch checks the machine's too)."""
        if self.memory_of is None:
            return None
        cfg, plan = self.memory_of
        example = sources.example(cfg, plan.microbatch_size, device="meta")[0]
        return memory.over_device(cfg, example, splits, plan.cluster.device)

    def next_leg(self) -> dict[str, Any]:
        """What the next leg takes from the re-plan that went: the splits (``pipeline.partition``
        for all, or ``pipeline.partitions`` for the pipelines split apart) and ``fault.slowed``."""
        chosen = cast(Proposal, self.chosen)  # asked once a proposal went (consider chose it)
        partition, partitions = as_config(chosen.bounds, self.shared)
        return {"partition": partition, "partitions": partitions, "reason": chosen.reason,
                "slowed": self.slowed_now()}

    def slowed_now(self) -> dict[str, float]:
        """``fault.slowed`` for the next leg: every device measured slower so far."""
        return {slowed_key(p, s): round(f, 4) for (p, s), f in sorted(self.slowed.items())
                if f != 1.0}
