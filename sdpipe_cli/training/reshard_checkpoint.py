"""Write a checkpoint's state out again for another layout (P, S, the partition): the tensors'
side of :mod:`sdpipe_cli.core.reshard_plan`, which decides where everything goes.

A worker's shard (:meth:`~sdpipe_cli.training.worker.Worker.save`) holds its stage's blocks under
the stage's own names (``"0.attn.weight"`` is the stage's first block), the optimizer's state by
parameter index, the RNG, the data position and the sync strategy's state. Here every tensor is
named by the block it belongs to instead, which no layout changes, and gathered again under the
new stages' names: weights and optimizer state travel with their block, and a tied weight held
by two blocks is found under either.

The result is a complete checkpoint of the new layout (manifest, SHA-256 of every shard), written
once into ``<run>/resharded/`` and resumed from like any other; the source checkpoint is only
read. Memory: one old pipeline's shards at a time.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sdpipe_cli import checkpoint
from sdpipe_cli.core import reshard_plan as reshard
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.core.segments import partitions_of
from sdpipe_cli.model import models
from sdpipe_cli.runtime.errors import CheckpointError
from sdpipe_cli.sync.strategies import strategy_class

__all__ = ["layout_of", "plan_for", "write"]

Where = tuple[int, str]  # (block, name inside the block)


def layout_of(cfg: DictConfig) -> reshard.Layout:
    pipelines = int(cfg.cluster.pipelines)
    base = tuple(int(b) for b in cfg.pipeline.partition)
    own = tuple((q, bounds) for q, bounds in enumerate(partitions_of(cfg.pipeline, pipelines))
                if bounds != base)
    return reshard.Layout(pipelines, base, models.count_blocks(cfg.model), own,
                          int(cfg.pipeline.get("chunks", 1)))


def plan_for(ckpt: Path, manifest: dict[str, Any], old: DictConfig, new: DictConfig,
             train_steps: int | None) -> reshard.Plan:
    """The plan of resuming ``ckpt`` (of a run configured ``old``) as ``new``; ``train_steps``:
    the user's ``train.steps`` for the new layout, if given."""
    steps = {int(p): int(k) for p, k in manifest["steps"].items()}
    found: dict[int, int] = {}
    grid = Grid(len(steps), int(old.pipeline.stages))
    for p in sorted(steps):  # the streams: the first stage's shard of each old pipeline
        state = checkpoint.load_shard(ckpt, str(grid.rank(p, 0)), manifest)
        data = state.get("data")
        if not isinstance(data, Mapping) or not isinstance(data.get("position"), int):
            break
        found[p] = int(data["position"])
    positions = found if len(found) == len(steps) else None  # every stream's, or none
    samples = int(new.data.resolved.train) if positions is not None else None
    even = not strategy_class(new.sync.name).scheduled_checkpoints
    return reshard.plan(steps, int(old.train.steps), int(old.train.batch_size),
                        int(new.cluster.pipelines), even=even, positions=positions or None,
                        samples=samples, new_train_steps=train_steps)


def write(ckpt: Path, manifest: dict[str, Any], old: DictConfig, new: DictConfig,
          plan: reshard.Plan, run_dir: Path) -> Path:
    """The new layout's checkpoint, in ``<run_dir>/resharded/`` (the run that resumes); returns
    its folder."""
    before, after = layout_of(old), layout_of(new)
    name = (f"{ckpt.name}-P{after.pipelines}xS{after.stages}-"
            + "_".join(str(b) for b in after.partition or (0,))
            + "".join(f"-p{q}_" + "_".join(map(str, bounds)) for q, bounds in after.own))
    final = run_dir / "resharded" / name
    if final.exists():  # resharded before, for a resume that did not get far
        final = checkpoint.free_name(final, "")
    staging = final.with_name(checkpoint.STAGING_PREFIX + final.name)
    shutil.rmtree(staging, ignore_errors=True)
    meta = {"config": OmegaConf.to_container(new, resolve=True), "steps": plan.steps,
            "elapsed": manifest["elapsed"], "partition": list(after.partition), "stand_ins": [],
            "resharded_from": {"checkpoint": str(ckpt), "pipelines": before.pipelines,
                               "stages": before.stages, "partition": list(before.partition),
                               "at": time.time()}}
    try:
        _write_shards(ckpt, manifest, old, new, plan, staging)
        scheduler = checkpoint.load_shard(ckpt, "scheduler", manifest)
        checkpoint.save_shard(staging, "scheduler", {**scheduler, "steps": plan.steps})
        expected = [str(r) for r in range(after.pipelines * after.stages)] + ["scheduler"]
        return checkpoint.seal(staging, final, round(sum(plan.steps.values()) / after.pipelines),
                               meta, expected)
    except BaseException:  # nothing half-written is left behind
        shutil.rmtree(staging, ignore_errors=True)
        if staging.parent.is_dir() and not any(staging.parent.iterdir()):
            staging.parent.rmdir()
        raise

def _write_shards(ckpt: Path, manifest: dict[str, Any], old: DictConfig, new: DictConfig,
                  plan: reshard.Plan, staging: Path) -> None:
    """Every new rank's shard, one old pipeline's shards in memory at a time."""
    before, after = layout_of(old), layout_of(new)
    ties = _ties(new)
    flat_keys = strategy_class(new.sync.name).flat_state
    S_old, S_new = before.stages, after.stages
    for src in sorted(set(plan.sources.values())):
        ranks = Grid(before.pipelines, S_old).pipeline_ranks(src)
        shards = [checkpoint.load_shard(ckpt, str(r), manifest) for r in ranks]
        files = [ckpt / checkpoint.shard_name(str(r)) for r in ranks]
        old_names = [_param_names(old, held) for held in before.held(src)]
        model = _model_by_block(files, shards, before.held(src))
        optim = _optimizer_by_block(files, shards, old_names)
        flats = {k: _flat_by_block(shards, before.held(src), old_names, k, old)
                 for k in flat_keys}
        for q in (q for q, p in sorted(plan.sources.items()) if p == src):
            new_keys = [_stage_keys(new, held) for held in after.held(q)]
            new_names = [_param_names(new, held) for held in after.held(q)]
            new_meta = [_stage(new, held).state_dict() for held in after.held(q)]
            for s, runs in enumerate(reshard.pieces(before, after, src, q)):
                first_old = shards[runs[0][0]]
                state: dict[str, Any] = {
                    "step": plan.steps[q], "pipeline": q, "stage": s,
                    "model": {k: _find(model, w, ties, ckpt, "weight") for k, w in new_keys[s]},
                    "optimizer": {
                        "state": {i: _find(optim, w, ties, ckpt, "optimizer state")
                                  for i, w in enumerate(new_names[s]) if _has(optim, w, ties)},
                        "param_groups": [{**first_old["optimizer"]["param_groups"][0],
                                          "params": list(range(len(new_names[s])))}]},
                    "rng": first_old["rng"]}
                checkpoint.check_tensors(ckpt, f"the model of stage {s} (from pipeline {src})",
                                         dict(new_meta[s]), state["model"])
                if "sync" in first_old:
                    state["sync"] = {**first_old["sync"], **{
                        k: torch.cat([_find(flat, w, ties, ckpt, k).reshape(-1)
                                      for w in new_names[s]])
                        for k in flat_keys if (flat := flats[k]) is not None}}
                if (s == 0 or s == S_new - 1) and plan.positions is not None:
                    saved = shards[0].get("data", {})
                    state["data"] = {"position": plan.positions[q], "step": plan.steps[q],
                                     "fingerprint": saved.get("fingerprint"),
                                     "pipelines": after.pipelines}
                checkpoint.save_shard(staging, str(Grid(after.pipelines, S_new).rank(q, s)),
                                      state)
        del shards, model, optim, flats


# -- naming tensors by block -----------------------------------------------------------------

def _stage(cfg: DictConfig, held: Sequence[int]) -> nn.Module:
    """The module of a stage holding blocks ``held`` (in its order) on the meta device (its
    names, shapes and order; no memory)."""
    blocks, _ = models.meta_blocks(cfg.model)
    return nn.Sequential(*(blocks[b] for b in held))


def _split(held: Sequence[int], key: str) -> Where:
    """A stage module's tensor ``key`` (``index.name``) as (the model's block, name)."""
    index, _, rest = key.partition(".")
    return held[int(index)], rest


def _stage_keys(cfg: DictConfig, held: Sequence[int]) -> list[tuple[str, Where]]:
    return [(k, _split(held, k)) for k in _stage(cfg, held).state_dict()]


def _param_names(cfg: DictConfig, held: Sequence[int]) -> list[Where]:
    """The stage's parameters in the optimizer's order (``module.parameters()``)."""
    return [_split(held, k) for k, _ in _stage(cfg, held).named_parameters()]


def _ties(cfg: DictConfig) -> dict[Where, tuple[Where, ...]]:
    """Every place of a weight shared by several blocks -> all its places."""
    out: dict[Where, tuple[Where, ...]] = {}
    for places in models.tied_parameters(models.meta_blocks(cfg.model)[0]):
        for place in places:
            out[place] = places
    return out


def _model_by_block(files: list[Path], shards: list[dict], helds: list[list[int]]
                    ) -> dict[Where, Any]:
    table: dict[Where, Any] = {}
    for path, held, shard in zip(files, helds, shards):
        found = shard.get("model")
        if not isinstance(found, Mapping):
            raise CheckpointError(path, "lacks 'model'")
        for k, v in found.items():
            index = k.partition(".")[0] if isinstance(k, str) else ""
            if not index.isdigit() or int(index) >= len(held):
                raise CheckpointError(path, f"model holds {k!r}, not a block's tensor")
            table[_split(held, k)] = v
    return table


def _optimizer_by_block(files: list[Path], shards: list[dict], names: list[list[Where]]
                        ) -> dict[Where, Any]:
    table: dict[Where, Any] = {}
    for path, shard, order in zip(files, shards, names):
        found = shard.get("optimizer")
        if not isinstance(found, Mapping) or not isinstance(groups := found.get("param_groups"), list) \
                or len(groups) != 1 or not isinstance(found.get("state"), Mapping):
            raise CheckpointError(path, "optimizer state is not one parameter group: cannot "
                                        "reshard it")
        for index, entry in found["state"].items():
            if not isinstance(index, int) or not 0 <= index < len(order):
                raise CheckpointError(path, f"optimizer state names parameter {index!r}, which "
                                            "none is")
            table[order[index]] = entry
    return table


def _flat_by_block(shards: list[dict], helds: list[list[int]], names: list[list[Where]],
                   key: str, cfg: DictConfig) -> dict[Where, torch.Tensor] | None:
    """A sync state's flat vector over each old stage's parameters, cut back into them."""
    table: dict[Where, torch.Tensor] = {}
    for s, (held, shard) in enumerate(zip(helds, shards)):
        flat = shard.get("sync", {}).get(key)
        if flat is None:
            return None
        params = {_split(held, k): p for k, p in _stage(cfg, held).named_parameters()}
        offset = 0
        for where in names[s]:
            p = params[where]
            table[where] = flat[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
    return table


def _has(table: Mapping[Where, Any], where: Where, ties: Mapping[Where, tuple[Where, ...]]) -> bool:
    return any(w in table for w in ties.get(where, (where,)))


def _find(table: Mapping[Where, Any], where: Where, ties: Mapping[Where, tuple[Where, ...]],
          ckpt: Path, what: str) -> Any:
    for w in ties.get(where, (where,)):
        if w in table:
            return table[w]
    raise CheckpointError(ckpt, f"holds no {what} for block {where[0]}'s {where[1]!r}: saved "
                                "from another model?")

