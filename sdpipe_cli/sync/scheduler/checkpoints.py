"""The scheduler's part in checkpoints: which global syncs are checkpoints, and when one is whole.

With sdpipe, replicas are consistent only right after a global sync, so checkpoints are taken
there, the same one on every stage (:class:`~sdpipe_cli.core.cadence.GlobalSyncCheckpoints`
decides which). Each worker writes its shard and says so; once the shards of the pipelines at
that sync are in, the checkpoint is finalized here. A pipeline that was missing (lost, or
restarting) gets a copy of a present replica's shard at its own iteration count (a *stand-in*):
every replica of a stage is identical right after a global sync, so the checkpoint is complete,
and a resume restarts that pipeline too. Lock-step modes count checkpoints the same way, by the
iterations of an average pipeline.

Kept apart from the event handling (:mod:`.handling`) so that the cadence and the completeness
rule are read in one place; the files themselves are :mod:`sdpipe_cli.checkpoint`'s.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli import checkpoint
from sdpipe_cli.config import derived
from sdpipe_cli.config.schema import Config
from sdpipe_cli.core.cadence import Cadence, GlobalSyncCheckpoints
from sdpipe_cli.core.grouping import Decision
from sdpipe_cli.core.meetings import Meetings
from sdpipe_cli.core.plan import RunPlan

log = logging.getLogger("sdpipe.scheduler")

__all__ = ["Checkpoints"]


class Checkpoints:
    """A run's checkpoints as the scheduler sees them: due, partly written, finalized.

    ``cfg``: the run's record, which each manifest stores (and a re-split replaces, as the
    next leg's); ``settings``: the same config typed, whose ``train`` and ``checkpoint``
    sections set the cadence and how many are kept."""

    def __init__(self, cfg: DictConfig, settings: Config, plan: RunPlan, run_dir: Path,
                 meetings: Meetings, clock: Callable[[], float]):
        self.cfg, self.plan, self.run_dir, self.meetings, self.clock = (
            cfg, plan, run_dir, meetings, clock)
        self.keep = settings.checkpoint.keep
        self.cadence = GlobalSyncCheckpoints(Cadence.of(settings.train, settings.checkpoint),
                                             clock())
        self.saved: dict[int, dict[int, int]] = {}  # checkpoint id -> rank -> step
        self.shards_from: dict[int, set[int]] = {}  # checkpoint id -> pipelines that save a shard
        self.stand_ins: dict[int, dict[int, int]] = {}  # checkpoint id -> the others' iterations
        # global decisions per stage, or segment (policy.global_history)
        self.global_seen = [0] * plan.segments.count
        self.global_checkpoint: dict[int, int | None] = {}  # global index -> checkpoint id
        self.cut: dict[int, tuple[int, int]] = {}  # pipeline -> (meeting, steps): a short block
        self.dropped: set[int] = set()  # checkpoints a failed global sync left unmade

    def mean_steps(self, steps: dict[int, int]) -> int:
        """Iterations of an average pipeline: how checkpoints are numbered in every sync mode."""
        return round(sum(steps.values()) / self.plan.pipelines)

    def resume(self, steps: dict[int, int]) -> None:
        self.cadence.resume(self.mean_steps(steps))

    def at_global_sync(self, d: Decision, policy: Any) -> int | None:
        """The checkpoint taken right after global decision ``d`` (None: not one); the same
        id on every stage of that global sync."""
        g = self.global_seen[d.stage]
        self.global_seen[d.stage] += 1
        if g not in self.global_checkpoint:
            missing = self.missing_steps(d.members, policy)
            steps = {**missing, **{p: self.steps_after(p, k)
                                   for p, k in policy.global_history[g].items()}}
            ckpt = self.cadence.at_global_sync(self.mean_steps(steps), d.stop, self.clock())
            self.global_checkpoint[g] = ckpt
            if ckpt is not None:
                self.shards_from[ckpt] = set(d.members)
                self.stand_ins[ckpt] = missing
        return self.global_checkpoint[g]

    def cut_short(self, pipeline: int, meeting: int, steps: int) -> None:
        """``pipeline`` went to ``meeting`` after ``steps`` local steps, before its block of
        ``sync.every`` ended: the run's end asked its replicas to meet at once."""
        self.cut[pipeline] = (meeting, steps)

    def steps_after(self, pipeline: int, meeting: int) -> int:
        """The local steps ``pipeline`` had done at ``meeting``: a full block's, unless the run's
        end cut it short (then what its replicas said)."""
        at, steps = self.cut.get(pipeline, (None, 0))
        return steps if at == meeting else self.meetings.steps(meeting + 1)

    def missing_steps(self, members, policy: Any) -> dict[int, int]:
        """Pipelines not at a global sync (lost, or restarting): the iterations each has done."""
        return {q: self.resume_step(q, policy)
                for q in range(self.plan.pipelines) if q not in members}

    @overload
    def resume_step(self, p: int, policy: Any, unknown: int = 0) -> int: ...
    @overload
    def resume_step(self, p: int, policy: Any, unknown: None) -> int | None: ...

    def resume_step(self, p: int, policy: Any, unknown: int | None = 0) -> int | None:
        """The local step a left pipeline would go on from (the policy counts meetings)."""
        k = policy.resume_at.get(p)
        return unknown if k is None else self.meetings.steps(k)

    def shard_saved(self, ckpt: int, rank: int, step: int) -> None:
        if ckpt not in self.dropped:
            self.saved.setdefault(ckpt, {})[rank] = step

    def drop(self, ckpt: int, live: bool) -> bool:
        """Checkpoint ``ckpt`` is not made: a replica says the global sync it follows failed,
        so its shards are not one model's (nor would a stand-in copied from them be). Its
        staging folder goes (``live``: not while replaying, where the dead scheduler did that);
        shards that still come are ignored. False if it was made, or dropped, already."""
        pending = ckpt in self.saved or ckpt in self.shards_from
        self.saved.pop(ckpt, None)
        self.shards_from.pop(ckpt, None)
        self.stand_ins.pop(ckpt, None)
        if not pending or ckpt in self.dropped:
            return False
        self.dropped.add(ckpt)
        if live:
            shutil.rmtree(checkpoint.staging_dir(self.run_dir, ckpt), ignore_errors=True)
        return True

    def resplit(self, pipeline: int, bounds: list[int], slowed: dict[str, float]) -> None:
        """``pipeline`` was re-split in place: checkpoints from now on hold its new split, and
        their manifests' config says so, with the slowdowns measured (``sdpipe resume`` goes on
        with both); the plan here is the run's from now on."""
        self.cfg = derived.resplit(self.cfg, {pipeline: bounds}, slowed)
        splits = list(self.plan.partitions)
        splits[pipeline] = tuple(int(b) for b in bounds)
        self.plan = replace(self.plan, partitions=tuple(splits))

    def pipeline_lost(self, p: int, policy: Any) -> list[int]:
        """Pipeline ``p``'s shards will not come: it stands in where it was due; the
        checkpoints that may now be complete."""
        waiting = []
        for ckpt, pipelines in list(self.shards_from.items()):
            if p in pipelines:
                pipelines.discard(p)
                self.stand_ins[ckpt][p] = self.resume_step(p, policy)
                waiting.append(ckpt)
        return waiting

    def _stand_in_source(self, q: int, present: list[int]) -> int | None:
        """A pipeline at the global sync whose shards can stand in for lost pipeline ``q``'s:
        every replica is alike there, but a shard holds its stage's blocks, so it must be of a
        pipeline split as ``q`` is."""
        partitions = self.plan.partitions
        return next((p for p in present if partitions[p] == partitions[q]), None)

    def finalize(self, ckpt: int, live: bool, elapsed: float, metrics: Callable[[], dict]
                 ) -> tuple[Path, dict[int, int]] | None:
        """Finalize checkpoint ``ckpt`` if the shards of the pipelines at its global sync are in
        (``live=False``: replaying a dead scheduler's journal, which finalized it already where
        its staging folder is gone); its path and iterations per pipeline, or None."""
        S, P = self.plan.stages, self.plan.pipelines
        grid = self.plan.grid
        shards = self.saved.get(ckpt, {})
        present = sorted(self.shards_from.get(ckpt, range(P)))
        if not present or any(grid.rank(p, s) not in shards for p in present for s in range(S)):
            return None
        del self.saved[ckpt]
        self.shards_from.pop(ckpt, None)
        staging = checkpoint.staging_dir(self.run_dir, ckpt)
        steps = {p: shards[grid.rank(p, 0)] for p in present}
        stand_ins = self.stand_ins.pop(ckpt, {})
        steps.update(stand_ins)
        if not live and not staging.is_dir():
            self.cadence.saved(self.clock())
            return None
        for q, k in sorted(stand_ins.items()):
            source = self._stand_in_source(q, present)
            if source is None:
                log.warning("checkpoint %d is not written: pipeline %d was lost and no live "
                            "pipeline is split as it is, to stand in for it", ckpt, q)
                shutil.rmtree(staging, ignore_errors=True)
                self.cadence.saved(self.clock())
                return None
            for s in range(S):
                checkpoint.stand_in(staging, str(grid.rank(source, s)), str(grid.rank(q, s)),
                                    {"step": k, "pipeline": q})
        checkpoint.save_shard(staging, "scheduler",
                              {"steps": steps, "elapsed": elapsed, "metrics": metrics()})
        path = checkpoint.finalize(
            self.run_dir, ckpt, keep=self.keep,
            expected=[str(r) for r in range(self.plan.workers)] + ["scheduler"],
            meta={"config": OmegaConf.to_container(self.cfg, resolve=True), "steps": steps,
                  "elapsed": elapsed, "partition": list(self.cfg.pipeline.partition),
                  "stand_ins": sorted(set(range(P)) - set(present))})
        self.cadence.saved(self.clock())
        return path, steps
