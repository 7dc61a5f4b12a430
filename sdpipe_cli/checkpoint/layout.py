"""Where a run's checkpoints live and what their files are called: the one place for the names.

``<run>/checkpoints/step_<N>/`` holds a finalized checkpoint (its ``manifest.json`` names every
file with its SHA-256), ``.staging-step_<N>/`` one being written, ``.deleting-step_<N>/`` one
being pruned; ``<run>/final/`` the weights each replica writes at the end of a run. Pure paths
and hashing: nothing here reads a shard.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

MANIFEST = "manifest.json"
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"  # a pruned checkpoint is renamed to this first, then removed
STEP_DIR = re.compile(r"step_(\d+)")
FINAL = "final"  # <run>/final/: each replica's weights at the end of the run
_CHUNK = 1 << 20


def checkpoints_dir(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(run_dir: os.PathLike | str, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{STAGING_PREFIX}step_{step}"


def final_dir(run_dir: os.PathLike | str, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step}"


def run_dir_of(ckpt_dir: os.PathLike | str) -> Path:
    return Path(ckpt_dir).parent.parent


def home_of(ckpt_dir: os.PathLike | str, manifest: Mapping[str, Any]) -> Path | None:
    """The run folder whose own checkpoint ``ckpt_dir`` is, or None for one that lies elsewhere
    (copied out of its run, or into another run's folder): a resume must then not write into the
    folder that happens to hold it.

    A run's checkpoints lie in ``<run>/checkpoints/`` (and resharded ones in ``<run>/resharded/``),
    and must be that run's own (:func:`of_run`)."""
    ckpt_dir = Path(ckpt_dir)
    run = run_dir_of(ckpt_dir)
    if ckpt_dir.parent.name not in ("checkpoints", "resharded"):
        return None
    return run if of_run(run, manifest) else None


def of_run(run: os.PathLike | str, manifest: Mapping[str, Any]) -> bool:
    """Whether ``manifest`` (a checkpoint's, or ``final/``'s) was written by the run of folder
    ``run``: ``<run>/config.yaml`` carries the run's id, as the config of every checkpoint it
    writes does. A folder without config.yaml is no run; a checkpoint written before runs had
    ids is taken as its run's, and one with an id is not the run's whose config.yaml cannot
    be read."""
    saved = Path(run) / "config.yaml"
    if not saved.is_file():
        return False
    config: Mapping = manifest["config"] if isinstance(manifest.get("config"), Mapping) else {}
    run_section: Mapping = config["run"] if isinstance(config.get("run"), Mapping) else {}
    wanted = run_section.get("id")
    if wanted is None:
        return True
    from omegaconf import OmegaConf

    from sdpipe_cli.config import yaml_bounds

    yaml_bounds.check_file(saved, "the checkpoint's run folder")
    try:  # read as data: no interpolation is resolved
        found = cast(dict, OmegaConf.to_container(OmegaConf.load(saved), resolve=False))["run"]["id"]
    except Exception:  # noqa: BLE001 - an unreadable config.yaml is not this checkpoint's run
        return False
    return found == wanted


def shard_name(name: str) -> str:
    """The file of shard ``name``: ``"3"`` -> ``"3.pt"``. Hidden names are kept for temp files."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"invalid shard name {name!r}")
    return f"{name}.pt"


def free_name(path: Path, suffix: str) -> Path:
    """``path`` with ``suffix-N`` added, the first N that names nothing yet."""
    n = 1
    while path.with_name(f"{path.name}{suffix}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}{suffix}-{n}")


def final_name(pipeline: int, stage: int) -> str:
    """The shard name of a replica's weights at the end of the run: ``final/p<P>-s<S>.pt``."""
    return f"p{pipeline}-s{stage}"


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
