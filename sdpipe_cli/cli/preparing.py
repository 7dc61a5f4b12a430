"""Preparing a run: a checked config resolved for this machine, once, before anything starts.

What a config leaves to the machine it runs on is settled here, in the launcher's process, so that
every child reads the same answers from ``config.yaml`` instead of settling them again: the device
(CPU, or one GPU per worker), the data's size and classes and vocabulary, the partition of the
model into stages (``auto`` from a profile), the recorded run of ``sync.replay``, how often
sdpipe's replicas meet on slow links (``sync.every=0``, ``sync.precision=auto``), and the run plan
(:class:`~sdpipe_cli.core.plan.RunPlan`: topology, placement, budget, micro-batch size). Bad input
found here raises :class:`~sdpipe_cli.config.schema.ConfigError` before a run folder exists.
:func:`check_memory` refuses a training run that cannot fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config import measurements
from sdpipe_cli.config.pipeline_checks import validate_own_partitions, validate_partition
from sdpipe_cli.config.schema import ConfigError, num_classes, objective
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core import balance, meetings, partition, replan
from sdpipe_cli.core.cluster import Cluster
from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.plan import RunPlan, cluster_of, microbatch_size
from sdpipe_cli.core.slowdowns import carried_of
from sdpipe_cli.data import sources
from sdpipe_cli.hetero import simulated_run
from sdpipe_cli.model import memory, models


def prepare(cfg: DictConfig) -> tuple[DictConfig, partition.Plan | None,
                                      meetings.Choice | None]:
    """Resolve what depends on this machine (device, partition, the profile's path) into a
    concrete run config, read-only; with ``pipeline.partition=auto`` also the plan that chose
    it, and where sdpipe's meetings were chosen from slow links, that choice."""
    # a copy, schema-free (a DictConfig's container is a dict, which makes a DictConfig)
    cfg = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))
    cluster = cluster_of(cfg)  # checked by validate()
    cfg.cluster.device = resolve_device(cfg, cluster)
    if cfg.profile:
        cfg.profile = str(Path(cfg.profile).expanduser().resolve())
    _resolve_data(cfg)
    blocks, stages, chunks = models.count_blocks(cfg.model), cfg.pipeline.stages, cfg.pipeline.chunks
    if stages > blocks:
        raise ConfigError("pipeline.stages", f"is {stages} but model {cfg.model.name} has only "
                          f"{blocks} blocks; use at most {blocks} stages")
    if stages * chunks > blocks:
        raise ConfigError("pipeline.chunks", f"is {chunks}: {stages} stages of {chunks} chunks need "
                          f"{stages * chunks} blocks, but model {cfg.model.name} has only {blocks}")
    if not isinstance(cfg.pipeline.partition, str):
        validate_partition(cfg.pipeline.partition, stages, blocks, chunks=chunks)
    validate_own_partitions(cfg.pipeline, int(cfg.cluster.pipelines), blocks)
    counts = models.block_param_counts(cfg.model) if cfg.pipeline.partition == "params" else None
    plan = None
    if cfg.profile:
        try:
            measurements.check_model(measurements.load(cfg.profile), cfg.model.name, blocks,
                                     microbatch_size(cfg))
        except measurements.ProfileError as err:
            raise ConfigError("profile", str(err)) from None
    if cfg.pipeline.partition == "auto":
        block_ms = measurements.worker_block_ms(measurements.load(cfg.profile), cluster,
                                                list(cfg.cluster.slowdown))
        cost = partition.device_cost(block_ms)  # by stage; a chunk runs on its stage's devices
        # interleaved pieces judged by the iteration's timeline, as a re-plan judges them
        plan = (partition.plan(cost, blocks, stages) if chunks == 1
                else partition.plan_chunks(cost, blocks, stages, chunks, replan.slowest_iteration(
                    block_ms, int(cfg.pipeline.microbatches), str(cfg.pipeline.schedule))))
    cfg.pipeline.partition = plan.bounds if plan else partition.resolve(
        cfg.pipeline.partition, blocks, stages * chunks, counts)
    found = models.check(cfg)
    for q, own in (cfg.pipeline.partitions or {}).items():  # each split, as its workers see it
        try:
            models.check(cast(DictConfig, OmegaConf.merge(cfg, {"pipeline": {"partition": own}})), found)
        except ConfigError as err:
            key = f"pipeline.partitions.{q}" if err.key == "pipeline.partition" else err.key
            raise ConfigError(key, err.reason) from None
    cfg.plan = RunPlan.resolve(cfg, cluster, blocks, balance_of(cfg, cluster, blocks),
                               found.carried()).section()
    if cfg.fault.on_slowdown == "replan":  # the leg after a re-plan goes on from this checkpoint
        cfg.checkpoint.on_exit = True
    resolved, choice = simulated_run.resolve_meetings(cfg)  # sdpipe on slow links: how often
    for key, value in resolved.items():  # replicas meet, and in what
        cfg.sync[key] = value
    if cfg.sync.get("replay"):  # the recorded run must fit this one: before anything starts
        from sdpipe_cli.sync.replay import load as load_recorded

        cfg.sync.replay = str(Path(cfg.sync.replay).expanduser().resolve())
        if cfg.fault.on_pipeline_loss != "stop":
            raise ConfigError("sync.replay", "repeats a run without losses: use "
                              "fault.on_pipeline_loss=stop")
        load_recorded(cfg.sync.replay, settings_of(cfg))
    # prepared: from here on read; what a launch or a later leg derives is a config of its own
    # (config/derived.py), so that no holder of this one sees it change
    OmegaConf.set_readonly(cfg, True)
    return cfg, plan, choice


def balance_of(cfg: DictConfig, cluster: Cluster, blocks: int) -> tuple[int, ...]:
    """Each pipeline's micro-batches under ``pipeline.balance`` (:mod:`~sdpipe_cli.core.balance`),
    judged by the speeds the run starts with: the profile's block times on each device where a
    profile is given, else every block alike at the device's speed; ``cluster.slowdown`` on top,
    and what earlier legs measured (``fault.slowed``: a leg after a re-plan shares the batch
    anew). ``()`` (every pipeline ``pipeline.microbatches``) with ``balance=equal``."""
    if cfg.pipeline.balance == "equal":
        return ()
    slowdown = list(cfg.cluster.slowdown) if cfg.cluster.slowdown else [1.0] * cluster.pipelines
    if cfg.profile:
        block_ms = measurements.worker_block_ms(measurements.load(cfg.profile), cluster, slowdown)
    else:
        block_ms = [[[float(slowdown[p]) / cluster.speed(cluster.device(p, s))] * blocks
                     for s in range(cluster.stages)] for p in range(cluster.pipelines)]
    block_ms = replan.scaled(block_ms, carried_of(cfg.fault.slowed, cluster.pipelines, cluster.stages))
    plan = RunPlan.resolve(cfg, cluster, blocks)
    schedule = str(cfg.pipeline.schedule)
    grain = balance.grain_of(schedule in CHUNKED_SCHEDULES, plan.stages)
    chosen = balance.decide(block_ms, plan.partitions, int(cfg.pipeline.microbatches), grain, schedule,
                            replan.pace_bound(mode(cfg.sync.name).paced_by_slowest, cfg.sync))
    return chosen.microbatches


def check_memory(cfg: DictConfig) -> None:
    """Refuse a training run that cannot fit (:mod:`~sdpipe_cli.model.memory`; a prepared config,
    ``run.memory_check``): on CPU the workers of this machine together against its available
    RAM, on CUDA each worker against its GPU. Not for ``simulate`` or ``profile``, which train
    nothing of that size here."""
    if not cfg.run.memory_check:
        return
    run = RunPlan.of(cfg)
    example = sources.example(cfg, run.microbatch_size, device="meta")[0]
    splits = {bounds: memory.estimate(cfg, example, bounds)
              for bounds in set(run.partitions)}
    if None in splits.values():
        return
    known = cast(dict[tuple[int, ...], list[memory.StageMemory]], splits)  # no None: just above
    grid, cluster, partitions = run.grid, run.cluster, run.partitions

    def of(rank: int) -> memory.StageMemory:  # a worker, under its pipeline's own split
        return known[partitions[grid.pipeline_of(rank)]][grid.stage_of(rank)]

    stages = [e for estimates in known.values() for e in estimates]
    ranks = run.ranks_on(cfg.run.node)
    fixes = ("lower train.batch_size, raise pipeline.microbatches or pipeline.stages, or set "
             "pipeline.activation_checkpointing=true (run.memory_check=false to try anyway)")
    over = memory.over_device(cfg, example, partitions, cluster.device, splits)
    if over is not None:  # a device's own limit, declared in the cluster
        raise ConfigError("cluster.nodes", f"{over}; give it fewer blocks (pipeline.partition), "
                          + fixes)
    if cfg.cluster.device == "cpu":
        worst = max(stages, key=lambda e: e.total)
        need = sum(of(r).total for r in ranks)
        have = psutil.virtual_memory().available
        if need > have:
            # one worker of each stage fits: there are too many of them here, not too large ones
            crowded = max(sum(e.total for e in estimates) for estimates in known.values()) <= have
            # the weights and their training state alone do not fit: no batch would
            heavy = not crowded and sum(of(r).state for r in ranks) > have
            raise ConfigError(
                "cluster.pipelines" if crowded else "model" if heavy else "train.batch_size",
                f"the {len(ranks)} workers on this machine need about {need / memory.GIB:.1f} GiB "
                f"(stage {worst.stage}: {worst.describe()}), but {have / memory.GIB:.1f} GiB is "
                "available; " + ("run fewer pipelines (or stages) on this machine "
                                 "(run.memory_check=false to try anyway)" if crowded else
                                 "its weights alone do not fit: a smaller model, or more stages on "
                                 "more machines" if heavy else fixes))
        return
    for r in ranks:
        index = cluster.device_of_rank(r).index if cluster.real else r
        if index is None or index >= torch.cuda.device_count():
            continue
        have = torch.cuda.get_device_properties(index).total_memory
        worker = of(r)
        if worker.total > have:
            raise ConfigError("model" if worker.state > have else "train.batch_size",
                              f"a worker of stage {worker.stage} needs about "
                              f"{worker.total / memory.GIB:.1f} GiB ({worker.describe()}), but GPU "
                              f"{index} has {have / memory.GIB:.1f} GiB; " + fixes)


def _resolve_data(cfg: DictConfig) -> None:
    """Open the data once (bad data is bad input: one line, nothing written) and let it settle
    what the model's config leaves open: the classes, the vocabulary, the evaluation's size."""
    cfg.data.resolved = resolved = sources.resolve(cfg)
    if resolved["train"] < cfg.cluster.pipelines:
        raise ConfigError("cluster.pipelines", f"{cfg.cluster.pipelines} pipelines share {resolved['train']} "
                          "training samples, fewer than one each; use more data or fewer pipelines")
    if cfg.model.num_classes is None and objective(cfg) == "classify":
        cfg.model.num_classes = num_classes(cfg)
        if cfg.model.num_classes is None:
            raise ConfigError("model.num_classes", f"data={cfg.data.name} does not say how many classes "
                              "it has (no `classes` attribute); set model.num_classes")
    vocab = resolved.get("vocab_size")
    if vocab is not None and vocab != cfg.model.vocab_size:
        if cfg.model.pretrained and vocab > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", f"the pretrained model has {cfg.model.vocab_size} "
                              f"tokens, the data's tokenizer {vocab}; prepare the data with the "
                              "model's own tokenizer (--tokenizer PATH/tokenizer.json)")
        if not cfg.model.pretrained:
            cfg.model.vocab_size = vocab  # a new model takes the data's tokenizer
    count = sources.val_count(cfg)
    cfg.data.eval_batches = count


def resolve_device(cfg: DictConfig, cluster: Cluster) -> str:
    """``cpu`` or ``cuda`` for this run; CUDA needs one GPU per worker on this host (on a real
    node: GPUs up to the highest device index placed there)."""
    if not mode(cfg.sync.name).cuda:
        if cfg.cluster.device == "cuda":
            raise ConfigError("cluster.device", f"sync={cfg.sync.name} runs on CPU only (its "
                              "server receives from any worker, which NCCL cannot); use "
                              "cluster.device=cpu")
        return "cpu"

    if cluster.real:  # this node's workers, each on the GPU of its device index
        local = [cluster.device_of_rank(r).index for r in cluster.ranks_on(cfg.run.node)]
        workers = max(local) + 1 if local else 0
    else:
        workers = cluster.pipelines * cluster.stages
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.cluster.device == "cpu":
        return "cpu"
    if cfg.cluster.device == "cuda":
        if gpus == 0:
            raise ConfigError("cluster.device", "is cuda but no CUDA device is visible here; "
                              "use cluster.device=cpu or auto")
        if gpus < workers:
            raise ConfigError("cluster.device", f"cuda needs one GPU per worker: {workers} here "
                              f"but {gpus} visible; lower cluster.pipelines or pipeline.stages")
        return "cuda"
    return "cuda" if gpus >= workers else "cpu"
