"""``sdpipe simulate``: a run config turned into a simulated workload, simulated under several sync
modes, and the ``simulation.json`` document that reports it.

The engine (:mod:`sdpipe_cli.core.simulation`) is pure; this module reads what it needs from the
config: compute times (``cluster.compute_ms`` or the profile's block costs, as modelled emulation
reads them), the stage sizes and the activation size from the model, the cluster's devices, speed
changes, links and seeded stragglers, and the ``simulate`` section's costs of the transport.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config import derived, measurements
from sdpipe_cli.config.schema import SYNC_CONFIGS, ConfigError, emulation
from sdpipe_cli.core.cluster import EmulatedStragglers
from sdpipe_cli.core.grouping import make_policy
from sdpipe_cli.core.interleaved import stage_blocks
from sdpipe_cli.core.meetings import BYTES, Choice, average_of, choose, meetings_of, precision_of
from sdpipe_cli.core.modes import mode as mode_of
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES
from sdpipe_cli.core.simulation import MODES, Result, Workload, simulate
from sdpipe_cli.data import sources
from sdpipe_cli.hetero.simulated_replan import replanned
from sdpipe_cli.model import models
from sdpipe_cli.model.layout import from_plan
from sdpipe_cli.sync.replay import recorded_meetings

__all__ = ["workload", "run", "FORMAT"]

FORMAT = "sdpipe-simulation/1"
FLOAT_BYTES = 4


def workload(cfg: DictConfig, plan: RunPlan | None = None) -> Workload:
    """The simulated workload of a prepared run config (partition resolved) and its plan (read
    from it when not given); raises :class:`ConfigError` for what cannot be simulated."""
    m = cfg.pipeline.microbatches
    if cfg.pipeline.schedule in ASYNC_SCHEDULES:
        raise ConfigError("pipeline.schedule", f"'{cfg.pipeline.schedule}' cannot be simulated yet; "
                          "use 1f1b or gpipe")
    if emulation(cfg.cluster) != "modelled":
        raise ConfigError("cluster.compute_ms", "simulate needs modelled compute: set "
                          "cluster.compute_ms or give profile=PATH")
    plan = plan or RunPlan.of(cfg)
    P, S, cluster = plan.pipelines, plan.stages, plan.cluster
    blocks = models.count_blocks(cfg.model)
    held = stage_blocks(list(cfg.pipeline.partition), blocks, S)  # the sync's bytes per stage
    forward, backward = [], []
    doc = measurements.load(cfg.profile) if cfg.cluster.compute_ms is None else None
    # read once: a config lookup costs microseconds, and these loops run P x S times
    f = None if doc is not None else float(cfg.cluster.compute_ms) / 1e3
    # a structured node (StragglerConfig): a dict keyed by its field names
    st = SimpleNamespace(**cast(dict[str, Any],
                                OmegaConf.to_container(cfg.cluster.stragglers, resolve=True)))
    seed = cfg.train.seed
    shares: tuple[list, list] = ([], [])  # interleaved, from a profile: each chunk's share
    for p in range(P):
        fwd_row, bwd_row = [], []
        shares[0].append([])
        shares[1].append([])
        for s, chunks in enumerate(stage_blocks(plan.partition_of(p), blocks, S)):  # its own
            if f is not None:
                fwd_row.append(f)
                bwd_row.append(2 * f)
                continue
            # f is None only when doc was read
            fwd, bwd = measurements.block_costs(cast(dict, doc), cluster.device(p, s).name, 1.0)
            for times, row, share in ((fwd, fwd_row, shares[0][p]), (bwd, bwd_row, shares[1][p])):
                each = [sum(times[a:b]) for a, b in chunks]
                row.append(sum(each) / 1e3)
                share.append([t / sum(each) if sum(each) else 1 / len(each) for t in each])
        forward.append(fwd_row)
        backward.append(bwd_row)
    if f is not None or plan.chunks == 1:  # equal shares, or no chunks
        shares = ([], [])
    counts = models.block_param_counts(cfg.model)
    return Workload(
        cluster=cluster, microbatches=m, batch_size=cfg.train.batch_size, steps=cfg.train.steps,
        forward_s=forward, backward_s=backward,
        stage_bytes=[sum(sum(counts[a:b]) for a, b in chunks) * FLOAT_BYTES for chunks in held],
        activation_bytes=_activation_bytes(cfg, plan),
        slowdown=[float(x) for x in cfg.cluster.slowdown],
        shares=list(plan.microbatches) if plan.balanced else [],
        stragglers=[[EmulatedStragglers.of_device(st, seed, cluster.device(p, s).name)
                     for s in range(S)] for p in range(P)],
        per_iteration=st.per == "iteration", schedule=cfg.pipeline.schedule, chunks=plan.chunks,
        chunk_forward=shares[0], chunk_backward=shares[1],
        rtt_s=cfg.simulate.rtt_ms / 1e3, event_s=cfg.simulate.event_ms / 1e3,
        collective_s=cfg.simulate.collective_ms / 1e3, p2p_s=cfg.simulate.p2p_ms / 1e3,
        jitter=cfg.simulate.jitter,
        seed=cfg.train.seed, **_sync_settings(cfg))


def _for_sync(work: Workload, cfg: DictConfig) -> Workload:
    """``work`` under ``cfg``'s sync settings (the only part of a workload they change)."""
    # the straggler draws are generators: each mode gets its own copy, as it had its own workload,
    # so every mode sees the same slow-downs whatever was simulated before it
    return dataclasses.replace(work, stragglers=copy.deepcopy(work.stragglers),
                               **_sync_settings(cfg))


def _sync_settings(cfg: DictConfig) -> dict:
    own = {key: int(cfg.sync[key]) for key in ("staleness", "local_steps", "overlap")
           if key in cfg.sync}
    return {"average": average_of(cfg.sync), "every": meetings_of(cfg.sync).every,
            "precision": precision_of(cfg.sync), "staleness": None, "local_steps": None, **own}


def _activation_bytes(cfg: DictConfig, plan: RunPlan) -> int:
    """The largest message between two stages: from the layout the plan carries, else traced."""
    known = from_plan(plan.layout, plan.microbatch_size, plan.blocks)
    if known is None:
        return models.activation_bytes(cfg, sources.example(cfg, plan.microbatch_size)[0])
    return max((b.nbytes for b in known.outputs), default=0)


def _with_sync(cfg: DictConfig, sync: str, plan: RunPlan | None = None) -> DictConfig:
    """``cfg`` with another sync mode's defaults (for the comparison rows), its plan with that
    mode's servers; sdpipe's meetings chosen as a launch would (:func:`resolve_meetings`)."""
    if cfg.sync.name == sync:
        return cfg
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # cfg: a DictConfig
    values["sync"] = OmegaConf.to_container(OmegaConf.structured(SYNC_CONFIGS[sync]))
    values["plan"] = (plan or RunPlan.of(cfg)).for_sync(sync).section()
    other = OmegaConf.create(values)
    meetings, _ = resolve_meetings(other, plan)
    return derived.with_values(other, {f"sync.{key}": value for key, value in meetings.items()})


def resolve_meetings(cfg: DictConfig, plan: RunPlan | None = None
                     ) -> tuple[dict[str, Any], Choice | None]:
    """sdpipe's ``sync.every`` and ``sync.precision`` where ``cfg`` leaves them to choose (0,
    ``auto``), from the cluster's emulated links (:func:`~sdpipe_cli.core.meetings.choose`):
    the fastest pipeline's iteration, simulated alone for a few steps, against one meeting of
    every replica of the costliest stage. Where no link is emulated, or compute is not modelled
    (nothing to estimate an iteration from), every iteration in float32, as on fast links; so
    too under an asynchronous schedule, whose rounds are per update. Returns the ``sync`` keys
    to set (the caller makes the config: ``cli/preparing.py``) and the choice made (None:
    nothing was left to choose from links)."""
    y = cfg.sync
    if not mode_of(y.name).meets or (y.every != 0 and y.precision != "auto"):
        return {}, None
    plan = plan or RunPlan.of(cfg)
    if not plan.cluster.links_emulated and measurable(cfg, plan):
        values: dict[str, Any] = {}
        if y.precision == "auto" and cfg.fault.on_pipeline_loss == "restart":
            values["precision"] = "fp32"  # a healed replica's anchor could miss a global sync
        recorded = recorded_meetings(y.replay) if y.get("replay") else None  # sync/replay.py
        if recorded is not None:  # a replay meets as its recording did
            values = {"every": int(recorded["every"]), "precision": str(recorded["precision"])}
        return values, None  # left to the run's measured wire (sync/wire_probe.py) where 0/auto
    if (not plan.cluster.links_emulated or emulation(cfg.cluster) != "modelled"
            or cfg.pipeline.schedule in ASYNC_SCHEDULES):  # meetings need a flushed schedule
        return {"every": y.every or 1,
                "precision": "fp32" if y.precision == "auto" else y.precision}, None
    work = workload(cfg, plan)
    probe = dataclasses.replace(work, steps=min(work.steps, 4), stragglers=copy.deepcopy(
        work.stragglers))
    alone = simulate(probe, "none")
    iteration_s = min(t / k for k, t in zip(alone.iterations, alone.finished_at) if k)
    replicas = [Placement.of(0, s, plan.pipelines, plan.stages).replicas()
                for s in range(plan.stages)]
    round_s = {p: max(plan.cluster.allreduce_s(r, n * BYTES[p] // FLOAT_BYTES) + work.collective_s
                      for r, n in zip(replicas, work.stage_bytes))
               for p in BYTES}
    precision = str(y.precision)
    if precision == "auto" and cfg.fault.on_pipeline_loss == "restart":
        precision = "fp32"  # a healed replica's anchor could miss a global sync (validation)
    choice = choose(iteration_s, round_s, float(y.wire_share), int(y.every), precision,
                    most=int(cfg.train.steps))
    return {"every": choice.every, "precision": choice.precision}, choice


def measurable(cfg: DictConfig, plan: RunPlan) -> bool:
    """Whether a run can settle its meetings from its measured wire
    (:mod:`~sdpipe_cli.sync.wire_probe`): some stage's replicas span nodes (within one node
    nothing needs measuring: the run meets every iteration in float32, as it always has),
    every pipeline is split alike (the probe is per stage), under a flushed schedule."""
    if cfg.pipeline.schedule in ASYNC_SCHEDULES or not plan.segments.uniform:
        return False
    return any(plan.cluster.slowest_link(plan.grid.stage_ranks(s)).kind == "cross_node"
               for s in range(plan.stages))


def _row(result: Result, limit: float, wall_clock_s: float) -> dict:
    sps = result.samples_per_s
    return {"sync": result.sync, "samples_per_s": sps, "limit_samples_per_s": limit,
            "fraction_of_limit": sps / limit if limit else None,
            "mean_group_size": result.mean_group_size, "wall_s": result.wall_s,
            "iterations": result.iterations, "sync_wait_fraction": [
                w / max(t, 1e-12) for w, t in zip(result.wait_s, result.finished_at)],
            "sync_bytes_per_sample": result.sync_bytes_per_sample,
            "cross_node_bytes_per_sample": (result.sent_bytes.get("cross_node", 0.0)
                                            / max(sum(result.samples()), 1)),
            "comm_share": result.comm_share, "consensus": result.consensus,
            "simulated_in_s": wall_clock_s}


def run(cfg: DictConfig, compare: Sequence[str] = ()) -> dict:
    """Simulate ``cfg`` (its own sync mode, then each of ``compare``) and the limit; the
    ``simulation.json`` document."""
    modes = [cfg.sync.name] + [m for m in compare if m != cfg.sync.name]
    for m in modes:
        if m not in MODES:
            raise ConfigError("--compare", f"'{m}' is not a sync mode; choose from {', '.join(MODES)}")
    started = time.perf_counter()
    plan = RunPlan.of(cfg)
    work = workload(cfg, plan)  # built once (P x S devices, draws, costs): only the sync settings differ
    # the run's own shares (pipeline.balance) are its mode's; the limit and the other modes take
    # equal ones, as they would run
    equal = dataclasses.replace(work, shares=[])
    solo = simulate(_for_sync(equal, _with_sync(cfg, "none", plan)), "none")
    limit = sum(solo.solo_rates())
    shared = None  # pipelines split apart (pipeline.partitions): one split for a mode without
    if cfg.pipeline.get("partitions"):  # segments, as it would have to run
        one = derived.variant(cfg, {"pipeline.partitions": {}})
        shared = workload(one, RunPlan.of(one))
    rows = []
    for mode in modes:
        mode_cfg = _with_sync(cfg, mode, plan)
        begun = time.perf_counter()
        base = (shared if shared is not None and not mode_of(mode).segments
                else work if mode == cfg.sync.name else equal)
        own = plan if mode == cfg.sync.name else dataclasses.replace(
            plan, microbatches=(int(cfg.pipeline.microbatches),) * plan.pipelines)
        result = solo if mode_of(mode).exchange == "local" else simulate(
            _for_sync(base, mode_cfg), mode,
            functools.partial(make_policy, mode_cfg, own, evaluations=False, units=plan.stages))
        rows.append(_row(result, limit, time.perf_counter() - begun))
    doc = {"format": FORMAT, **rows[0], "pipelines": cfg.cluster.pipelines,
           "stages": cfg.pipeline.stages, "solo_samples_per_s": solo.solo_rates(),
           "compare": rows[1:], "simulated_in_s": time.perf_counter() - started,
           "config": OmegaConf.to_container(cfg, resolve=True)}
    replan = replanned(cfg, workload)  # fault.on_slowdown=replan with a device that slows
    if replan is not None:
        doc["replan"] = replan
    return doc


def write(doc: dict, run_dir: Path) -> Path:
    path = run_dir / "simulation.json"
    path.write_text(json.dumps(doc, indent=1))
    return path
