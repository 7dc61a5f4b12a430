"""Which weights a run left, and the one model they make: found, checked, merged.

A run leaves its model cut into stages and copied once per pipeline: a checkpoint's shards
(``checkpoints/step_N/<rank>.pt``, verified against the manifest's checksums) and, with
``run.save_final``, each replica's weights at the end (``final/p<P>-s<S>.pt``). Both are read
with ``torch.load(weights_only=True)``: tensors and plain containers, never code.

Every tensor is named here by the block it belongs to, ``(block, name inside the block)``,
which no split changes; a stage's shard names it ``"<index in the stage>.<name>"``. The
replicas of a block are then one model:

* **equal** (sdpipe's checkpoints and its end are at a global sync; the lock-step modes never
  differ): any pipeline's copy is the model, and the export says so;
* otherwise their **mean** (a global sync that did not happen), or one pipeline's
  (``--pipeline P``).

Either way the replicas' consensus distance is reported, as training defines it at global
syncs (:func:`sdpipe_cli.sync.groups.average_tensors`): ``sqrt(mean_p ||w_p - w||^2) / ||w||``
over the parameters, ``w`` their mean. The P replicas of one stage are in memory at a time,
beside the model being made.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config import trust, yaml_bounds
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core.partition import stage_ranges
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.model import checkpoint, models
from sdpipe_cli.runtime.errors import CheckpointError

__all__ = ["Merged", "Source", "check_pipeline", "find", "merge"]

Where = tuple[int, str]  # (block, name inside the block)
FINAL = "final"


@dataclass(frozen=True)
class Source:
    """Where a run's weights lie: a complete checkpoint, or its ``final/`` folder."""

    run: Optional[Path]  # the run folder, when the weights lie in one
    path: Path  # the checkpoint folder, or final/
    kind: str  # "checkpoint" or "final"
    config: DictConfig  # the run's config, as the run saved it (resolved, schema-free)
    steps: Optional[dict[int, int]]  # a checkpoint's iterations per pipeline
    manifest: Optional[dict[str, Any]] = None

    @property
    def pipelines(self) -> int:
        return int(self.config.cluster.pipelines)

    @property
    def stages(self) -> int:
        return int(self.config.pipeline.stages)

    def describe(self) -> str:
        if self.kind == FINAL:
            return f"{self.path} (each replica's weights at the end of the run)"
        return f"{self.path} (iterations per pipeline: {self.steps})"

    def shard(self, pipeline: int, stage: int) -> tuple[Path, Any]:
        """The file of a replica's stage, and what it holds: the stage's tensors by its own
        names."""
        if self.kind == FINAL:
            path = self.path / f"p{pipeline}-s{stage}.pt"
            try:
                state = torch.load(path, weights_only=True, map_location="cpu")
            except Exception as err:  # a damaged file fails anywhere in torch.load
                raise CheckpointError(path, f"cannot be loaded as weights: "
                                            f"{' '.join(str(err).split())[:160]}") from None
            return path, state
        rank = str(Grid(self.pipelines, self.stages).rank(pipeline, stage))
        state = checkpoint.load_shard(self.path, rank, self.manifest)
        return self.path / checkpoint.shard_name(rank), state.get("model")


def find(path: os.PathLike | str, which: Optional[str] = None, trusted: bool = False) -> Source:
    """The weights of ``path`` (a run folder, or a checkpoint folder): ``which`` names a
    checkpoint (a folder, or ``step_N`` of the run) or ``final``; by default the newest of the
    run's latest complete checkpoint and its ``final/``. A saved config that names code (a
    user's model) is refused unless a launch of this user's sealed it or ``trusted``
    (:mod:`sdpipe_cli.config.trust`): exporting builds the model."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(path, "does not exist" if not path.exists() else
                              "is not a folder: name a run folder or a checkpoint folder")
    if (path / checkpoint.MANIFEST).is_file():
        if which is not None:
            raise ConfigError("CHECKPOINT", f"{path} is a checkpoint already; name a run folder "
                              f"with {which}")
        source = _checkpoint(path)
    elif which == FINAL or (which is None and _final_is_newest(path)):
        source = _final(path)
    elif which is not None:
        named = Path(which)
        source = _checkpoint(checkpoint.resolve(named if named.is_absolute() or named.exists()
                                                else checkpoint.checkpoints_dir(path) / which))
    else:
        if not (path / "config.yaml").is_file():
            raise CheckpointError(path, "is neither a run folder (no config.yaml) nor a checkpoint "
                                        "(no manifest.json)")
        found = checkpoint.latest(path)
        if found is None:
            raise CheckpointError(path, "has no complete checkpoint and no final/ (train with "
                                        "checkpoint.every=N or run.save_final=true)")
        source = _checkpoint(found)
    where = source.path / checkpoint.MANIFEST if source.kind != FINAL else source.run / "config.yaml"
    trust.check(OmegaConf.to_container(source.config), str(where), trusted)
    return source


def _checkpoint(ckpt: Path) -> Source:
    manifest = checkpoint.verify_run(ckpt)
    config = OmegaConf.create(manifest["config"])
    steps = {int(p): int(n) for p, n in manifest["steps"].items()}
    if len(steps) != int(config.cluster.pipelines):
        raise CheckpointError(ckpt / checkpoint.MANIFEST, f"lists {len(steps)} pipelines, its "
                              f"config {config.cluster.pipelines}")
    return Source(checkpoint.home_of(ckpt, manifest), ckpt, "checkpoint", config, steps, manifest)


def _final(run: Path) -> Source:
    folder = run / FINAL
    config_file = run / "config.yaml"
    if not folder.is_dir():
        raise CheckpointError(folder, "does not exist (train with run.save_final=true)")
    if not config_file.is_file():
        raise CheckpointError(config_file, "missing: final/ needs its run's config")
    yaml_bounds.check_file(config_file, "the run folder")
    try:  # data only: no interpolation is resolved
        config = OmegaConf.create(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False))
        grid = Grid(int(config.cluster.pipelines), int(config.pipeline.stages))
    except Exception as err:  # noqa: BLE001 - a config.yaml that is not a run's
        raise CheckpointError(config_file, f"is not a run's config: {str(err).splitlines()[0]}") from None
    for p in range(grid.pipelines):
        for s in range(grid.stages):
            if not (folder / f"p{p}-s{s}.pt").is_file():
                raise CheckpointError(folder / f"p{p}-s{s}.pt", "missing: the run did not end, or "
                                      "ended with another layout than config.yaml's")
    return Source(run, folder, FINAL, config, None)


def _final_is_newest(run: Path) -> bool:
    """Whether the run's ``final/`` was written after its latest complete checkpoint."""
    files = list((run / FINAL).glob("p*-s*.pt")) if (run / FINAL).is_dir() else []
    if not files:
        return False
    latest = checkpoint.latest(run)
    if latest is None:
        return True
    try:
        saved = float(checkpoint.read_manifest(latest).get("time", 0.0))
    except (CheckpointError, TypeError, ValueError):
        return True
    return min(f.stat().st_mtime for f in files) >= saved


# -- merging -------------------------------------------------------------------------------------

@dataclass
class Merged:
    """The model the replicas make, by block."""

    state: dict[Where, torch.Tensor]
    how: str  # "equal", "mean" or "pipeline"
    pipelines: list[int]  # the replicas merged
    distance: float  # the replicas' consensus distance (0: equal)

    def describe(self) -> str:
        if self.how == "equal":
            return f"the {len(self.pipelines)} replicas are equal; took pipeline {self.pipelines[0]}'s"
        if self.how == "mean":
            return (f"the mean of pipelines {self.pipelines} (consensus distance "
                    f"{self.distance:.3g})")
        return f"pipeline {self.pipelines[0]}'s replica (consensus distance {self.distance:.3g})"


def merge(source: Source, pipeline: Optional[int] = None) -> Merged:
    """One model from the replicas (see the module's docstring); ``pipeline``: that one's.

    Stage by stage: the P replicas of one stage are in memory at a time, beside the model being
    made, and each tensor's mean is taken in float64. Where the replicas are equal that mean is
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


def check_pipeline(source: Source, pipeline: Optional[int]) -> None:
    if pipeline is not None and not 0 <= pipeline < source.pipelines:
        raise ConfigError("--pipeline", f"is {pipeline}; {source.path} has pipelines "
                          f"0..{source.pipelines - 1}")


def _stages(source: Source) -> Iterator[dict[Where, list[torch.Tensor]]]:
    """Stage by stage, each tensor's P replicas by (block, name), every shard checked against
    the model the config builds."""
    blocks, _ = models.meta_blocks(source.config.model)
    ranges = stage_ranges(list(source.config.pipeline.partition), len(blocks))
    if len(ranges) != source.stages:
        raise CheckpointError(source.path, f"its config has {source.stages} stages but a "
                              f"partition of {len(ranges)}")
    for s, (lo, hi) in enumerate(ranges):
        expected = torch.nn.Sequential(*blocks[lo:hi]).state_dict()
        table: dict[Where, list[torch.Tensor]] = {}
        for p in range(source.pipelines):
            path, found = source.shard(p, s)
            checkpoint.check_tensors(path, f"stage {s}'s weights", expected, found)
            for key, value in found.items():
                index, _, name = key.partition(".")
                table.setdefault((lo + int(index), name), []).append(value)
        yield table


def _parameter_places(config: DictConfig) -> list[Where]:
    """Every parameter's (block, name): what the consensus distance measures (a tied weight once
    per block that holds it, as each stage holds its copy)."""
    blocks, _ = models.meta_blocks(config.model)
    return [(b, name) for b, block in enumerate(blocks) for name, _ in block.named_parameters()]


def by_block(state: Mapping[Where, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Block ``block``'s tensors under its own names."""
    return {name: v for (b, name), v in state.items() if b == block}
