"""Reading checkpoints back: which are complete, the latest, one named by a path, and a shard
verified before it is loaded.

Loading verifies the file's SHA-256 against the manifest first, then uses
``torch.load(weights_only=True)``: a checkpoint copied from elsewhere can hold tensors and plain
containers, never code that runs on load. A damaged or foreign file is a
:class:`~sdpipe_cli.runtime.errors.CheckpointError` that names it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sdpipe_cli.checkpoint.layout import MANIFEST, STAGING_PREFIX, STEP_DIR, checkpoints_dir, sha256, shard_name
from sdpipe_cli.runtime.errors import CheckpointError


def damaged(run_dir: os.PathLike | str) -> list[Path]:
    """``step_<N>`` folders without a readable manifest (a write cut short, a damaged file):
    a resume passes over them, and should say so."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir()
                  if STEP_DIR.fullmatch(entry.name) and entry.is_dir() and not _has_manifest(entry))


def complete_checkpoints(run_dir: os.PathLike | str) -> list[Path]:
    """Every ``step_<N>`` folder with a readable manifest, oldest first: by the iterations all
    pipelines did together (a run resumed on another number of pipelines numbers its
    checkpoints by its own average pipeline), then by N."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if not (match and entry.is_dir()):
            continue
        try:
            manifest = read_manifest(entry)
        except CheckpointError:
            continue
        step = int(match.group(1))
        steps = manifest.get("steps")
        found.append((sum(steps.values()) if isinstance(steps, dict) else step, step, entry))
    return [path for _, _, path in sorted(found)]


def latest(run_dir: os.PathLike | str) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def go_on_from(run_dir: os.PathLike | str) -> str:
    """Where a run that stopped for want of disk (or a file it could not write) goes on from:
    its latest complete checkpoint and the command that resumes it (read from the disk, which
    reading still reaches when full)."""
    try:
        newest = latest(run_dir) if Path(run_dir).is_dir() else None
    except OSError:
        newest = None
    if newest is None:
        return "no checkpoint is complete yet: start the run again"
    return f"the latest complete checkpoint is {newest}: sdpipe resume {run_dir}"


def resolve(path: os.PathLike | str) -> Path:
    """A checkpoint folder from what a user names: a checkpoint itself, or a run (its latest)."""
    path = Path(path)
    if not path.exists():
        there = complete_checkpoints(path.parent.parent) if path.parent.name == "checkpoints" else []
        if there:  # a step that has no checkpoint of its own (sdpipe's are at global syncs)
            raise CheckpointError(path, "does not exist; this run's complete checkpoints: "
                                        + ", ".join(c.name for c in there))
        raise CheckpointError(path, "does not exist")
    if not path.is_dir():
        raise CheckpointError(path, "is neither a run folder nor a checkpoint folder")
    if (path / MANIFEST).is_file():
        return path
    if STEP_DIR.fullmatch(path.name) or path.name.startswith(STAGING_PREFIX):
        raise CheckpointError(path / MANIFEST, "missing: not a complete checkpoint")
    found = latest(path)
    if found is None:
        raise CheckpointError(path, f"no complete checkpoint in {checkpoints_dir(path)}")
    return found


def read_manifest(ckpt_dir: os.PathLike | str) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, "missing: not a complete checkpoint") from None
    except OSError as err:
        raise CheckpointError(path, f"unreadable: {err}") from err
    except ValueError as err:
        raise CheckpointError(path, f"not valid JSON: {err}") from err
    except RecursionError:
        raise CheckpointError(path, "nests too deeply to be a manifest") from None
    if not isinstance(manifest, dict) or "step" not in manifest or not _valid_files(manifest.get("files")):
        raise CheckpointError(path, "lacks 'step' or a valid 'files' table")
    _check_fields(path, manifest)
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_FIELDS = {
    "step": (_count, "a count"),
    "steps": (lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and k.isdigit() and _count(n) for k, n in v.items()),
        "a table of pipeline -> iterations"),
    # finite: a run's clock starts at now less it (NaN and Infinity fail the bounds)
    "elapsed": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e15,
                "a finite number of seconds, at least 0"),
    "config": (lambda v: isinstance(v, dict), "the run's config"),
    "stand_ins": (lambda v: isinstance(v, list) and all(_count(q) for q in v), "a list of pipelines"),
}


def _check_fields(path: Path, manifest: dict[str, Any]) -> None:
    for name, (valid, meaning) in _FIELDS.items():
        if name in manifest and not valid(manifest[name]):
            raise CheckpointError(path, f"{name!r} should be {meaning}, not "
                                        f"{json.dumps(manifest[name])[:40]}")


def load_shard(ckpt_dir: os.PathLike | str, name: str,
               manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Shard ``name`` of a checkpoint, after checking it against the manifest; never runs code."""
    if manifest is None:
        manifest = read_manifest(ckpt_dir)
    path = Path(ckpt_dir) / shard_name(name)
    if path.name not in manifest["files"]:
        raise CheckpointError(path, f"not listed in {MANIFEST}")
    _check(path, manifest["files"][path.name])
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CheckpointError(path, f"refused by torch.load(weights_only=True): {_refusal(err)}") from err
    except Exception as err:  # a damaged file can fail anywhere in torch.load
        raise CheckpointError(path, f"cannot be loaded: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a dict")
    return state


def check_tensors(path: os.PathLike | str, what: str, expected: Mapping[str, torch.Tensor],
                  found: Any) -> None:
    """``found`` holds exactly ``expected``'s tensors, each of its dtype and shape; else a
    :class:`CheckpointError` naming the first mismatch. ``load_state_dict`` would cast a wrong
    dtype silently (integers into float weights) and name only some shape mismatches."""
    if not isinstance(found, Mapping):
        raise CheckpointError(path, f"{what} is a {type(found).__name__}, not a table of tensors")
    missing = [k for k in expected if k not in found]
    if missing:
        raise CheckpointError(path, f"{what} lacks {missing[0]!r} (and {len(missing) - 1} more): "
                                    "saved from another model or partition?")
    extra = [k for k in found if k not in expected]
    if extra:
        raise CheckpointError(path, f"{what} holds {extra[0]!r}, which this stage does not have: "
                                    "saved from another model or partition?")
    for name, want in expected.items():
        _check_tensor(path, f"{what} {name!r}", want, found[name])


def check_optimizer(path: os.PathLike | str, optimizer: torch.optim.Optimizer, found: Any) -> None:
    """An optimizer state saved for the same parameters: as many groups and parameters, and
    every per-parameter tensor (momentum, Adam's moments) of its parameter's dtype and shape."""
    if not isinstance(found, Mapping) or not isinstance(found.get("param_groups"), list) \
            or not isinstance(found.get("state"), Mapping):
        raise CheckpointError(path, "optimizer state lacks 'state' or 'param_groups'")
    groups = optimizer.param_groups
    saved = found["param_groups"]
    if len(saved) != len(groups) or any(
            not isinstance(g, Mapping) or len(g.get("params", ())) != len(h["params"])
            for g, h in zip(saved, groups)):
        raise CheckpointError(path, "optimizer state is for other parameters (group or "
                                    "parameter counts differ): saved by another optimizer?")
    params = {pid: p for g, h in zip(saved, groups) for pid, p in zip(g["params"], h["params"])}
    for pid, entry in found["state"].items():
        if pid not in params or not isinstance(entry, Mapping):
            raise CheckpointError(path, f"optimizer state names parameter {pid!r}, which none is")
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _check_tensor(path, f"optimizer {name!r} of parameter {pid}", params[pid], value)


def _check_tensor(path: os.PathLike | str, what: str, want: torch.Tensor, got: Any) -> None:
    if not isinstance(got, torch.Tensor):
        raise CheckpointError(path, f"{what} is a {type(got).__name__}, not a tensor")
    if got.dtype != want.dtype:
        raise CheckpointError(path, f"{what} is {got.dtype}, the model's is {want.dtype}")
    if got.shape != want.shape:
        raise CheckpointError(path, f"{what} has shape {tuple(got.shape)}, the model's is "
                                    f"{tuple(want.shape)}")


def verify(ckpt_dir: os.PathLike | str) -> dict[str, Any]:
    """The manifest, once every file it lists matches its checksum."""
    manifest = read_manifest(ckpt_dir)
    for filename, digest in manifest["files"].items():
        _check(Path(ckpt_dir) / filename, digest)
    return manifest


def verify_run(ckpt_dir: os.PathLike | str) -> dict[str, Any]:
    """:func:`verify`, and the manifest holds what a resume needs: the run's config (with its
    sync mode), every pipeline's iterations and the run clock."""
    manifest = verify(ckpt_dir)
    path = Path(ckpt_dir) / MANIFEST
    for name in ("config", "steps", "elapsed"):
        if name not in manifest:
            raise CheckpointError(path, f"lacks {name!r}: not a checkpoint of an sdpipe run")
    sync = manifest["config"].get("sync")
    if not isinstance(sync, dict) or not isinstance(sync.get("name"), str):
        raise CheckpointError(path, "its config lacks sync.name")
    return manifest


def _refusal(err: pickle.UnpicklingError) -> str:
    """The gist of torch's long weights_only message (which goes on to explain how to load unsafely)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    return f"it needs {found.group(1)}, which is neither a tensor nor plain data" if found else \
        str(err).splitlines()[0]


def _check(path: Path, digest: str) -> None:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    if sha256(path) != digest:
        raise CheckpointError(path, "checksum mismatch: truncated or corrupted")


def _has_manifest(ckpt_dir: Path) -> bool:
    try:
        read_manifest(ckpt_dir)
    except CheckpointError:
        return False
    return True


def _valid_files(files: Any) -> bool:
    """A table of plain file names (no path can reach outside the checkpoint) to hex digests."""
    return isinstance(files, dict) and all(
        isinstance(k, str) and isinstance(v, str) and k and "/" not in k and os.sep not in k
        and k not in (".", "..") for k, v in files.items())
