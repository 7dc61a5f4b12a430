"""``sdpipe simulate`` with ``fault.on_slowdown=replan``: the run with a device that slows down
(``cluster.changes``), as it goes with the split it has and as it would go re-planned.

The simulator (:mod:`sdpipe_cli.core.simulation`) runs one split, so the re-planned run is
joined from phases, each simulated:

1. until the change, the run at the speeds before it (the change left out);
2. the device named slow after the detector's verdict, ``2 x (window // 2 + 1) - 1`` of its
   pipeline's iterations at the slow speed (:mod:`sdpipe_cli.core.slowdowns`; a change before
   the device's start was measured is taken as measured), then one more to stop;
3. the proposal of :func:`sdpipe_cli.core.replan.propose` at those speeds; if it goes, moving
   (``RESTART_S`` of start-up, the real run measures its own, plus the checkpoint written and
   read back; in place, only the re-split pipelines' share of a start-up and of a copy of their
   state, :func:`~sdpipe_cli.core.replan.move_cost`), then the rest of the budget with the new
   split and the device slow.

Without re-planning, the run is simulated as configured (the change where it is). Both are
reported in ``simulation.json``'s ``replan`` with the proposal; the console prints one line.
"""

from __future__ import annotations

from omegaconf import DictConfig

from sdpipe_cli.config import derived, measurements
from sdpipe_cli.core.grouping import make_policy
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.replan import as_config, called_for, pace_bound, propose, scaled
from sdpipe_cli.core.simulation import Result, simulate
from sdpipe_cli.sync.scheduler.replanning import checkpoint_bytes

__all__ = ["replanned", "RESTART_S"]

RESTART_S = 10.0  # the start-up a simulated restart costs (a real run measures its own)


def replanned(cfg: DictConfig, work_of) -> dict | None:
    """The ``replan`` section of ``simulation.json`` for a prepared ``cfg`` (None: nothing to
    re-plan); ``work_of(cfg, plan)``: its simulated workload."""
    if cfg.fault.on_slowdown != "replan" or not cfg.cluster.changes:
        return None
    plan = RunPlan.of(cfg)
    change = _first_slowdown(plan, float(cfg.fault.slowdown_threshold))
    if change is None:
        return None
    (p, s), before, after, at = change
    without = _run(cfg, plan, work_of)
    speeds_before = _run(_changes(cfg, []), plan, work_of)
    slow_cfg = _changes(cfg, [{"device": plan.cluster.device(p, s).name, "speed": after,
                               "start": 0.0, "end": None}])
    slow = _run(slow_cfg, plan, work_of)
    batch = int(cfg.train.batch_size)
    budget = plan.budget * batch
    iteration = slow.finished_at[p] / max(slow.iterations[p], 1)  # the slowed pipeline's
    window = int(cfg.fault.slowdown_window)
    verdict = 2 * (window // 2 + 1) * iteration  # the detector's 2 x confirm - 1, then the stop
    switch = at + verdict
    done = min(budget, speeds_before.samples_per_s * at + slow.samples_per_s * verdict)
    doc = measurements.load(cfg.profile)
    base = measurements.worker_block_ms(doc, plan.cluster, list(cfg.cluster.slowdown))
    own = mode(cfg.sync.name).segments
    schedule = str(cfg.pipeline.schedule)
    proposal = propose(scaled(base, {(p, s): before / after}), plan.partitions,
                       called_for(base, own, plan.chunks, int(cfg.pipeline.microbatches), schedule),
                       int(cfg.pipeline.microbatches), batch,
                       pace_bound(mode(cfg.sync.name).paced_by_slowest, cfg.sync), own,
                       budget - done, RESTART_S,
                       checkpoint_bytes(doc, cfg.train, plan.pipelines), in_place=plan.in_place,
                       schedule=schedule)
    out = {"device": plan.cluster.device(p, s).name, "pipeline": p, "stage": s, "at": at,
           "speed": after, **proposal.record(), "without_s": without.wall_s,
           "without_samples_per_s": without.samples_per_s}
    if not proposal.go:
        return {**out, "with_s": without.wall_s, "with_samples_per_s": without.samples_per_s}
    partition, partitions = as_config(proposal.bounds, cfg.pipeline.partition)
    moved = derived.variant(slow_cfg, {"pipeline.partition": partition,
                                       "pipeline.partitions": partitions})
    rest = _run(moved, plan, work_of)
    with_s = switch + proposal.move_s + (budget - done) / rest.samples_per_s
    return {**out, "switch_s": switch, "with_s": with_s, "with_samples_per_s": budget / with_s}


def _first_slowdown(plan: RunPlan, threshold: float):
    """((pipeline, stage), speed before, speed after, start) of the first change that slows a
    device of the run by ``threshold`` or more (less is never named); None without one."""
    cluster = plan.cluster
    where = {cluster.device(p, s).name: (p, s) for p in range(plan.pipelines)
             for s in range(plan.stages)}
    for change in sorted(cluster.changes, key=lambda c: c.start):
        if change.device not in where:
            continue
        before = cluster.speed(cluster.devices[change.device], max(0.0, change.start - 1e-9))
        if change.start > 0 and before >= threshold * change.speed:
            return where[change.device], before, change.speed, change.start
    return None


def _changes(cfg: DictConfig, changes: list) -> DictConfig:
    return derived.variant(cfg, {"cluster.changes": changes})


def _run(cfg: DictConfig, plan: RunPlan, work_of) -> Result:
    variant = RunPlan.of(cfg)  # the cluster of this variant's changes
    policy = None
    if mode(cfg.sync.name).group_policy:
        def policy(clock):
            return make_policy(cfg, variant, clock, evaluations=False,
                               units=variant.stages)
    return simulate(work_of(cfg, variant), cfg.sync.name, policy)
