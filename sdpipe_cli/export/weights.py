"""Which weights a run left, and the one model they make: found, checked, merged.

A run leaves its model cut into stages and copied once per pipeline: a checkpoint's shards
(``checkpoints/step_N/<rank>.pt``, verified against the manifest's checksums) and, with
``run.save_final``, each replica's weights at the end (``final/p<P>-s<S>.pt``). Both are read
with ``torch.load(weights_only=True)``: tensors and plain containers, never code.

Every tensor is named here by the block it belongs to, ``(block, name inside the block)``,
which no split changes; a stage's shard names it ``"<index in the stage>.<name>"``, counted
from the first block of that stage under its pipeline's own partition (``pipeline.partitions``
may split pipelines differently, so stage s of one pipeline may hold other blocks than stage s
of another). The replicas of a block are then one model:

* **equal** (sdpipe's checkpoints and its end are at a global sync; the lock-step modes never
  differ): any pipeline's copy is the model, and the export says so;
* otherwise their **mean** (a global sync that did not happen), or one pipeline's
  (``--pipeline P``).

Either way the replicas' consensus distance is reported, as training defines it at global
syncs (:func:`sdpipe_cli.sync.groups.average_tensors`): ``sqrt(mean_p ||w_p - w||^2) / ||w||``
over the parameters, ``w`` their mean. The P replicas of one segment of blocks
(:mod:`~sdpipe_cli.core.segments`: a stage, when every pipeline has the same split) are compared
at a time, with at most one stage's shard of each pipeline in memory, beside the model being made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli import checkpoint
from sdpipe_cli.config import trust
from sdpipe_cli.config.saved import typed
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core.interleaved import stage_blocks
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.core.segments import Segments, partitions_of
from sdpipe_cli.model import models
from sdpipe_cli.runtime.errors import CheckpointError

__all__ = ["Merged", "Source", "check_pipeline", "find", "merge"]

Where = tuple[int, str]  # (block, name inside the block)
FINAL = checkpoint.FINAL


@dataclass(frozen=True)
class Source:
    """Where a run's weights lie: a complete checkpoint, or its sealed ``final/`` folder; both
    have a manifest (the run's config, every pipeline's iterations, each file's SHA-256)."""

    run: Path | None  # the run folder, when the weights lie in one
    path: Path  # the checkpoint folder, or final/
    kind: str  # "checkpoint" or "final"
    config: DictConfig  # the run's config, typed by its schema
    steps: dict[int, int]  # iterations per pipeline
    manifest: dict[str, Any]

    @property
    def pipelines(self) -> int:
        return int(self.config.cluster.pipelines)

    @property
    def stages(self) -> int:
        return int(self.config.pipeline.stages)

    def partition(self, pipeline: int) -> tuple[int, ...]:
        """Pipeline ``pipeline``'s partition: what its stages were built from, and its shards
        hold (``pipeline.partitions``, else the shared ``pipeline.partition``)."""
        return partitions_of(self.config.pipeline, self.pipelines)[pipeline]

    def describe(self) -> str:
        what = "each replica's weights at the end of the run, " if self.kind == FINAL else ""
        return f"{self.path} ({what}iterations per pipeline: {self.steps})"

    def shard(self, pipeline: int, stage: int) -> tuple[Path, Any]:
        """The file of a replica's stage (checked against the manifest), and what it holds:
        the stage's tensors by its own names."""
        if self.kind == FINAL:
            name = checkpoint.final_name(pipeline, stage)
            state = checkpoint.load_shard(self.path, name, self.manifest)
            return self.path / checkpoint.shard_name(name), state
        rank = str(Grid(self.pipelines, self.stages).rank(pipeline, stage))
        state = _while_there(self.path, lambda: checkpoint.load_shard(self.path, rank, self.manifest))
        return self.path / checkpoint.shard_name(rank), state.get("model")


def find(path: os.PathLike | str, which: str | None = None, trusted: bool = False) -> Source:
    """The weights of ``path`` (a run folder, or a checkpoint folder): ``which`` names one of
    the run's checkpoints (``step_N``, or its folder) or ``final``; by default whichever of the
    run's latest complete checkpoint and its ``final/`` holds more iterations (``final/`` on a
    tie). A saved config that names code (a user's model) is refused unless a launch of this
    user's sealed it or ``trusted`` (:mod:`sdpipe_cli.config.trust`): exporting builds the
    model."""
    path = Path(os.path.normpath(Path(path).absolute()))  # "..": where it leads, not through
    if not path.is_dir():
        raise CheckpointError(path, "does not exist" if not path.exists() else
                              "is not a folder: name a run folder or a checkpoint folder")
    if (path / checkpoint.MANIFEST).is_file():
        if which is not None:
            raise ConfigError("CHECKPOINT", f"{path} is a checkpoint already; name a run folder "
                              f"with {which}")
        source = _checkpoint(path)
    elif which == FINAL:
        source = _final(path)
    elif which is not None:
        source = _checkpoint(checkpoint.resolve(_inside(path, which)), path)
    else:
        if not (path / "config.yaml").is_file():
            raise CheckpointError(path, "is neither a run folder (no config.yaml) nor a checkpoint "
                                        "(no manifest.json)")
        found = checkpoint.latest(path)
        final = _final(path) if (path / FINAL / checkpoint.MANIFEST).is_file() else None
        if found is None and final is None:
            raise CheckpointError(path, "has no complete checkpoint and no final/ with a manifest "
                                        "(train with checkpoint.every=N or run.save_final=true)")
        latest = _checkpoint(found, path) if found is not None else None
        # latest is None only when found is, and then final is set (refused above otherwise)
        source = cast(Source, final) if latest is None or (
            final is not None and sum(final.steps.values()) >= sum(latest.steps.values())) else latest
    config = cast(dict[str, Any], OmegaConf.to_container(source.config))  # a DictConfig's: a dict
    trust.check(config, str(source.path / checkpoint.MANIFEST), trusted)
    return source


def _inside(run: Path, which: str) -> Path:
    """Checkpoint ``which`` of ``run``: a name in its ``checkpoints/`` (or ``resharded/``), or a
    folder inside the run; never one elsewhere that the name happens to reach (``..``). Whose
    checkpoint it is, the run's id says (:func:`_checkpoint`): a link inside the run may lead to
    the run's own checkpoints elsewhere."""
    named = Path(which)
    if not named.is_absolute():
        for place in (run / which, run / "checkpoints" / which, run / "resharded" / which):
            if place.exists() and _within(run, place):
                return place
        if _within(run, checkpoint.checkpoints_dir(run) / which):
            return checkpoint.checkpoints_dir(run) / which
    elif _within(run, named):
        return named
    raise ConfigError("CHECKPOINT", f"{which} is not a checkpoint of {run}; name it alone "
                      "(sdpipe export CHECKPOINT --out DIR)")


def _within(run: Path, place: Path) -> bool:
    return run in Path(os.path.normpath(place)).parents


def _checkpoint(ckpt: Path, run: Path | None = None) -> Source:
    """The checkpoint ``ckpt``: named by its own path (``run`` None), its run is the one whose
    own checkpoint it is, if any (:func:`sdpipe_cli.checkpoint.home_of`); found in ``run``, it
    must be that run's."""
    manifest = _while_there(ckpt, lambda: checkpoint.verify_run(ckpt))
    if run is None:
        return _source(checkpoint.home_of(ckpt, manifest), ckpt, "checkpoint", manifest)
    return _source(_owned(run, ckpt, manifest), ckpt, "checkpoint", manifest)


def _owned(run: Path, found: Path, manifest: dict[str, Any]) -> Path | None:
    """``run``, whose weights ``found`` are (a checkpoint or final/ of it), or None where
    ``run`` is no run (no config.yaml); weights that carry another run's id are refused: copied
    in from another run, they are not this run's model."""
    if not (run / "config.yaml").is_file():
        return None
    if not checkpoint.of_run(run, manifest):
        raise CheckpointError(found, f"lies in {run} but is not that run's (it carries another "
                              "run's id): name one of the run's own checkpoints, or this one by "
                              "its own path, as no run's")
    return run


def _while_there(ckpt: Path, read):
    """``read()`` of checkpoint ``ckpt``; a file of it found missing or cut short because the
    checkpoint is gone meanwhile is said so: a run still training prunes its older checkpoints
    (``checkpoint.keep``) while they are read."""
    try:
        return read()
    except (CheckpointError, OSError):
        if (ckpt / checkpoint.MANIFEST).is_file():
            raise
        raise CheckpointError(ckpt, "was removed while it was read (a run still training prunes "
                              "its older checkpoints: checkpoint.keep): export again, or name "
                              "another step") from None


def _final(run: Path) -> Source:
    folder = run / FINAL
    if not (folder / checkpoint.MANIFEST).is_file():
        raise CheckpointError(folder / checkpoint.MANIFEST, "missing: final/ is sealed when a run "
                              "with run.save_final=true ends with every replica (export a "
                              "checkpoint instead)")
    manifest = checkpoint.read_manifest(folder)
    for name in ("config", "steps"):
        if name not in manifest:
            raise CheckpointError(folder / checkpoint.MANIFEST, f"lacks {name!r}")
    return _source(_owned(run, folder, manifest), folder, FINAL, manifest)


def _source(run: Path | None, path: Path, kind: str, manifest: dict[str, Any]) -> Source:
    where = str(path / checkpoint.MANIFEST)
    config = typed(manifest["config"], where)
    steps = {int(p): int(n) for p, n in manifest["steps"].items()}
    P, S = int(config.cluster.pipelines), int(config.pipeline.stages)
    if P < 1 or S < 1 or sorted(steps) != list(range(P)):
        raise CheckpointError(where, f"lists pipelines {sorted(steps)} for a layout of P={P}, "
                              f"S={S}")
    return Source(run, path, kind, config, steps, manifest)


# -- merging -------------------------------------------------------------------------------------

@dataclass
class Merged:
    """The model the replicas make, by block."""

    state: dict[Where, torch.Tensor]
    how: str  # "equal", "mean" or "pipeline"
    pipelines: list[int]  # the replicas merged
    distance: float  # the replicas' consensus distance (0: equal)

    def describe(self) -> str:
        if self.how == "equal" and len(self.pipelines) == 1:
            return "one pipeline: its replica"
        if self.how == "equal":
            return f"the {len(self.pipelines)} replicas are equal; took pipeline {self.pipelines[0]}'s"
        if self.how == "mean":
            return (f"the mean of pipelines {self.pipelines} (consensus distance "
                    f"{self.distance:.3g})")
        return f"pipeline {self.pipelines[0]}'s replica (consensus distance {self.distance:.3g})"


def merge(source: Source, pipeline: int | None = None) -> Merged:
    """One model from the replicas (see the module's docstring); ``pipeline``: that one's.

    Segment by segment (stage by stage where every pipeline has the same split): at most one
    stage's shard of each pipeline is in memory at a time, beside the model being made, and
    each tensor's mean is taken in float64. Where the replicas are equal that mean is
    each of them, bit for bit (P copies of a float32 sum and divide back exactly)."""
    check_pipeline(source, pipeline)
    P = source.pipelines
    params = set(_parameter_places(source.config))
    state: dict[Where, torch.Tensor] = {}
    equal, squares, norm = True, 0.0, 0.0
    for stage in _stages(source):
        for where, values in stage.items():
            same = all(torch.equal(values[0], v) for v in values[1:])
            equal = equal and same
            if same or not values[0].is_floating_point():  # counters (BatchNorm's): the first's
                state[where] = values[pipeline or 0]
                if same and where in params:
                    norm += float(values[0].double().pow(2).sum())
                continue
            mean = torch.stack([v.double() for v in values]).mean(0)
            if where in params:
                squares += sum(float((v.double() - mean).pow(2).sum()) for v in values) / P
                norm += float(mean.pow(2).sum())
            state[where] = values[pipeline] if pipeline is not None else mean.to(values[0].dtype)
    distance = 0.0 if equal else math.sqrt(squares) / max(math.sqrt(norm), 1e-30)
    if pipeline is not None:
        return Merged(state, "pipeline", [pipeline], distance)
    return Merged(state, "equal" if equal else "mean", list(range(P)), distance)


def check_pipeline(source: Source, pipeline: int | None) -> None:
    if pipeline is not None and not 0 <= pipeline < source.pipelines:
        raise ConfigError("--pipeline", f"is {pipeline}; {source.path} has pipelines "
                          f"0..{source.pipelines - 1}")


def _stages(source: Source) -> Iterator[dict[Where, list[torch.Tensor]]]:
    """Segment by segment (:mod:`~sdpipe_cli.core.segments`; the stages, where every pipeline has
    the same split), each tensor's P replicas by (block, name): pipeline p's copy of a block is
    read from the stage that holds it under p's own partition. Every shard is checked against the
    stage the config builds for its pipeline, and read once."""
    blocks, _ = models.meta_blocks(source.config.model)
    parts = [source.partition(p) for p in range(source.pipelines)]
    chunks = int(source.config.pipeline.get("chunks", 1))
    held = []  # each pipeline's stages' blocks, chunk after chunk (interleaved: several ranges)
    for p, bounds in enumerate(parts):
        if len(bounds) + 1 != source.stages * chunks:
            raise CheckpointError(source.path, f"its config has {source.stages} stages"
                                  + (f" of {chunks} chunks" if chunks > 1 else "")
                                  + f" but a partition of {len(bounds) + 1}"
                                  + (f" for pipeline {p}" if parts[p] != parts[0] else ""))
        held.append([[b for lo, hi in ranges for b in range(lo, hi)]
                     for ranges in stage_blocks(list(bounds), len(blocks), source.stages)])
    segments = Segments.of(parts, stages=source.stages)
    stage = [-1] * source.pipelines  # the stage of each pipeline whose shard is in memory
    tables: list[dict[Where, torch.Tensor]] = [{} for _ in range(source.pipelines)]
    for k in range(segments.count):
        lo, stop = segments.start(k), segments.stop(k)
        hi = len(blocks) if stop is None else stop
        table: dict[Where, list[torch.Tensor]] = {}
        for p in range(source.pipelines):
            s = segments.holder(p, k)
            if stage[p] != s:  # the stage before is done with: one shard per pipeline at a time
                tables[p] = {}
                tables[p], stage[p] = _shard(source, p, s, held[p][s], blocks), s
            for where, value in tables[p].items():
                if lo <= where[0] < hi:
                    table.setdefault(where, []).append(value)
        yield table


def _shard(source: Source, pipeline: int, stage: int, held: Sequence[int],
           blocks: Sequence[torch.nn.Module]) -> dict[Where, torch.Tensor]:
    """Stage ``stage`` of ``pipeline``, holding blocks ``held`` (in its module's order), by
    (block, name), checked against the blocks it must hold."""
    expected = torch.nn.Sequential(*(blocks[b] for b in held)).state_dict()
    path, found = source.shard(pipeline, stage)
    checkpoint.check_tensors(path, f"stage {stage}'s weights", expected, found)
    out: dict[Where, torch.Tensor] = {}
    for key, value in found.items():
        index, _, name = key.partition(".")
        out[(held[int(index)], name)] = value
    return out


def _parameter_places(config: DictConfig) -> list[Where]:
    """Every parameter's (block, name): what the consensus distance measures (a tied weight once
    per block that holds it, as each stage holds its copy)."""
    blocks, _ = models.meta_blocks(config.model)
    return [(b, name) for b, block in enumerate(blocks) for name, _ in block.named_parameters()]


def by_block(state: Mapping[Where, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Block ``block``'s tensors under its own names."""
    return {name: v for (b, name), v in state.items() if b == block}
