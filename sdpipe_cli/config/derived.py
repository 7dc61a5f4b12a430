"""A run's config as it is after something sdpipe decided: new configs, the old one untouched.

The composed config is the user's; what sdpipe derives during a run reaches its processes as a
config of its own, made here from the one before it, never by assigning to a config that other
holders still read. (A pipeline's own split is no config of its own: its workers take it from
the run plan, ``RunPlan.partition_of``, and build from it.)

- :func:`resplit`: the run's config once pipelines were re-split in place (the launcher's
  ``config.replan.yaml`` for their new workers, the scheduler's checkpoint manifests), with the
  slowdowns that made it (``fault.slowed``);
- :func:`with_slowed`: the config of a leg that starts from the slowdowns an earlier leg
  measured;
- :func:`variant`: a resolved copy with some keys set, for the simulator's what-ifs (the run
  with another split, other speed changes, one shared split);
- :func:`with_run`: the config a launch writes into its run folder, with what the launch gave
  it (``run.id``, ``run.dir``; :func:`sealed`: ``run.code_seal``); :func:`with_values`, any
  keys set (a resharded leg's budget).

The prepared config itself is read-only (:func:`~sdpipe_cli.cli.preparing.prepare`): each of
these returns a new one, writable only while it is made.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf, read_write

from sdpipe_cli.config import trust
from sdpipe_cli.core.segments import with_split

__all__ = ["resplit", "sealed", "variant", "with_run", "with_slowed", "with_values"]


def resplit(cfg: DictConfig, splits: Mapping[int, Sequence[int]],
            slowed: Mapping[str, float]) -> DictConfig:
    """``cfg`` with each pipeline of ``splits`` split at its bounds and ``fault.slowed``."""
    out = with_slowed(cfg, slowed)
    with read_write(out):
        for p, bounds in splits.items():
            out.pipeline.partitions = with_split(out.pipeline.partitions,
                                                 out.pipeline.partition, p, bounds)
    return out


def with_slowed(cfg: DictConfig, slowed: Mapping[str, float]) -> DictConfig:
    """``cfg`` whose ``fault.slowed`` is ``slowed``."""
    return with_values(cfg, {"fault.slowed": {str(k): float(v) for k, v in slowed.items()}})


def with_run(cfg: DictConfig, **run: Any) -> DictConfig:
    """``cfg`` whose ``run`` section holds ``run`` (``id=``, ``dir=``, ``code_seal=``)."""
    return with_values(cfg, {f"run.{key}": value for key, value in run.items()})


def sealed(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the seal of the code it names (``run.code_seal``: :mod:`.trust`)."""
    return with_run(cfg, code_seal=trust.seal(
        cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True))))  # a DictConfig's


def with_values(cfg: DictConfig, values: Mapping[str, Any]) -> DictConfig:
    """``cfg`` with each dotted key of ``values`` set (read-only if ``cfg`` was)."""
    out = copy.deepcopy(cfg)
    with read_write(out):
        for key, value in values.items():
            OmegaConf.update(out, key, value, merge=False)
    return out


def variant(cfg: DictConfig, values: Mapping[str, Any]) -> DictConfig:
    """A resolved copy of ``cfg`` with each dotted key of ``values`` set."""
    out = OmegaConf.create(cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True)))
    for key, value in values.items():
        OmegaConf.update(out, key, value, merge=False)
    return out
