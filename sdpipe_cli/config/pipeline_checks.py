"""The ``pipeline`` section's checks: stages against the model's blocks, micro-batches, their
balance, the schedule and its chunks (interleaving), the partition, weight versions.

Part of :func:`~sdpipe_cli.config.validation.validate`; the partition checks are also what the
launcher runs once a partition name is resolved (``cli/preparing.py``).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig

from sdpipe_cli.config import schema
from sdpipe_cli.config.checks import need
from sdpipe_cli.config.schema import ConfigError, n_blocks
from sdpipe_cli.core.balance import BALANCES
from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES
from sdpipe_cli.core.modes import names_with
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, SPLIT_SCHEDULES

# pipeline.microbatches: each worker holds its iteration's schedule as a list of actions, two per
# micro-batch and chunk; 10^8 micro-batches held 4 GB before the first step
MAX_MICROBATCHES = 65_536

__all__ = ["validate_own_partitions", "validate_partition", "validate_pipeline"]


def validate_pipeline(cfg: DictConfig) -> None:
    """``pipeline``: stages against the model's blocks, micro-batches, schedule, chunks, partition,
    weight versions."""
    m, p = cfg.model, cfg.pipeline
    blocks = n_blocks(m)  # custom models: checked once built (models.check)
    need(p.stages >= 1, "pipeline.stages", "must be at least 1")
    need(blocks is None or p.stages <= blocks, "pipeline.stages",
         f"is {p.stages} but model {m.name} has only {blocks} blocks; use at most {blocks} stages")
    need(p.microbatches >= 1, "pipeline.microbatches", "must be at least 1")
    need(p.microbatches <= MAX_MICROBATCHES, "pipeline.microbatches", f"is {p.microbatches:,}; an "
         f"iteration takes at most {MAX_MICROBATCHES:,}")
    need(p.schedule in schema.SCHEDULES, "pipeline.schedule",
         f"is '{p.schedule}'; choose one of {', '.join(schema.SCHEDULES)}")
    _validate_chunks(cfg, blocks)
    _validate_balance(cfg)
    if blocks is not None:
        validate_partition(p.partition, p.stages, blocks, chunks=p.chunks)
    validate_own_partitions(p, cfg.cluster.pipelines, blocks)
    need(not (p.schedule in SPLIT_SCHEDULES and p.activation_checkpointing), "pipeline.schedule",
         f"{p.schedule} with recomputed activations would run each stage's forward again for "
         "every weight group of every W; use pipeline.activation_checkpointing=false or "
         "pipeline.schedule=1f1b")
    if p.weight_versions is not None:
        need(p.schedule == "async_1f1b", "pipeline.weight_versions",
             f"only applies to pipeline.schedule=async_1f1b (schedule is {p.schedule})")
        need(p.weight_versions == 2, "pipeline.weight_versions",
             f"is {p.weight_versions}; use 2 (PipeDream-2BW) or null (PipeDream: up to S - s)")
        need(p.microbatches >= p.stages, "pipeline.weight_versions",
             f"2 needs pipeline.microbatches >= pipeline.stages (m={p.microbatches}, "
             f"S={p.stages}): micro-batches in flight must span at most two updates")


def _validate_balance(cfg: DictConfig) -> None:
    """``pipeline.balance``: a known rule, under a mode that counts each pipeline by its samples
    and a schedule with an iteration to share."""
    p, key = cfg.pipeline, "pipeline.balance"
    need(p.balance in BALANCES, key, f"is '{p.balance}'; choose one of {', '.join(BALANCES)}")
    if p.balance == "equal":
        return
    need(cfg.sync.name in names_with("balances"), key,
         f"{p.balance} needs a mode that counts each pipeline by its samples; sync={cfg.sync.name} "
         f"does not: use sync={' or '.join(names_with('balances'))}, or pipeline.balance=equal")
    need(p.schedule not in ASYNC_SCHEDULES, key,
         f"{p.balance} shares an iteration's micro-batches, which {p.schedule} does not flush: use "
         "a flushed schedule (1f1b), or pipeline.balance=equal")


def _validate_chunks(cfg: DictConfig, blocks: int | None) -> None:
    """``pipeline.chunks``: an interleaved schedule's model chunks per stage, and what interleaving
    needs: a stage before and after each chunk, micro-batches in groups of the stages, a block
    for every piece."""
    p, key = cfg.pipeline, "pipeline.chunks"
    need(p.chunks >= 1, key, f"is {p.chunks}; must be at least 1")
    if p.schedule in CHUNKED_SCHEDULES:
        need(p.microbatches % p.stages == 0, "pipeline.microbatches",
             f"is {p.microbatches}; {p.schedule} takes micro-batches in groups of the stages: use a "
             f"multiple of pipeline.stages={p.stages}")
    if p.chunks == 1:
        return
    need(p.schedule in CHUNKED_SCHEDULES, key, f"is {p.chunks}, but pipeline.schedule={p.schedule} "
         f"runs one chunk a stage; use pipeline.schedule={' or '.join(CHUNKED_SCHEDULES)}, or "
         "pipeline.chunks=1")
    need(p.stages >= 2, key, f"is {p.chunks} on one stage, which holds its chunks as one: "
         "use pipeline.chunks=1, or pipeline.stages >= 2")
    need(blocks is None or p.chunks * p.stages <= blocks, key,
         f"is {p.chunks}: {p.chunks} x {p.stages} stages = {p.chunks * p.stages} pieces, but model "
         f"{cfg.model.name} has {blocks} blocks; use at most {(blocks or 0) // p.stages} chunks")


def validate_own_partitions(p: DictConfig, pipelines: int, blocks: int | None) -> None:
    """``pipeline.partitions``: pipelines of the run, each with S - 1 explicit boundaries (known
    once the model is: ``blocks`` None checks only the pipelines)."""
    for q, bounds in (p.partitions or {}).items():
        key = f"pipeline.partitions.{q}"
        need(0 <= q < pipelines, key, f"names pipeline {q}; the run has pipelines 0 to "
             f"{pipelines - 1} (cluster.pipelines={pipelines})")
        if blocks is not None:
            need(not isinstance(bounds, str), key, "must be a list of block boundaries")
            validate_partition(bounds, p.stages, blocks, key, chunks=p.chunks)




def validate_partition(partition: Any, stages: int, blocks: int,
                       key: str = "pipeline.partition", chunks: int = 1) -> None:
    """``pipeline.partition`` (or a pipeline's own, ``key``) is a known name or ``chunks x S - 1``
    increasing block boundaries (S - 1 but with interleaving: one per virtual stage)."""
    pieces = stages * chunks
    if isinstance(partition, str):
        if partition not in schema.PARTITIONS:
            raise ConfigError(key, f"is '{partition}'; choose {', '.join(schema.PARTITIONS)} "
                              f"or a list of {pieces - 1} block boundaries")
        return
    if not isinstance(partition, (list, ListConfig)) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in partition
    ):
        raise ConfigError(key, "must be uniform, params, auto or a list of integer block boundaries")
    bounds = list(partition)
    if len(bounds) != pieces - 1:
        held = f"{stages} stages" if chunks == 1 else f"{stages} stages of {chunks} chunks"
        raise ConfigError(key, f"has {len(bounds)} boundaries; {held} need {pieces - 1}")
    edges = [0, *bounds, blocks]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        raise ConfigError(key, f"boundaries {bounds} must increase strictly within 1..{blocks - 1} "
                          "so that no stage is empty")
