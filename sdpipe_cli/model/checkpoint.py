"""Checkpoints: every rank saves its own shard, one process makes the set a checkpoint atomically.

A run keeps its checkpoints in ``<run>/checkpoints/step_<N>/``. During a save each process (one per
rank, plus the scheduler) writes its shard into ``checkpoints/.staging-step_<N>/`` with
:func:`save_shard`; the scheduler then calls :func:`finalize`, which writes ``manifest.json`` (the
SHA-256 of every file, plus the caller's metadata), fsyncs everything and renames the staging folder
to ``step_<N>`` in one ``rename``. So a crash in the middle of a save never touches an earlier
checkpoint, and a folder without a manifest (or under a staging name) is never taken for one.

Loading verifies the checksum first, then uses ``torch.load(weights_only=True)``: a checkpoint
copied from elsewhere can hold tensors and plain containers, never code that runs on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from sdpipe_cli.runtime.errors import CheckpointError

MANIFEST = "manifest.json"
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"  # a pruned checkpoint is renamed to this first, then removed
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 1 << 20

log = logging.getLogger("sdpipe.checkpoint")


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
    and ``<run>/config.yaml`` carries the run's id, as every checkpoint's config does. A
    checkpoint written before runs had ids is taken as its run's by its place alone."""
    ckpt_dir = Path(ckpt_dir)
    run = run_dir_of(ckpt_dir)
    if ckpt_dir.parent.name not in ("checkpoints", "resharded") or not (run / "config.yaml").is_file():
        return None
    config = manifest.get("config") if isinstance(manifest.get("config"), Mapping) else {}
    run_section = config.get("run") if isinstance(config.get("run"), Mapping) else {}
    wanted = run_section.get("id")
    if wanted is None:
        return run
    from omegaconf import OmegaConf

    from sdpipe_cli.config import yaml_bounds

    yaml_bounds.check_file(run / "config.yaml", "the checkpoint's run folder")
    try:  # read as data: no interpolation is resolved
        saved = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=False)
        found = saved["run"]["id"]
    except Exception:  # noqa: BLE001 - an unreadable config.yaml is not this checkpoint's run
        return None
    return run if found == wanted else None


def shard_name(name: str) -> str:
    """The file of shard ``name``: ``"3"`` -> ``"3.pt"``. Hidden names are kept for temp files."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"invalid shard name {name!r}")
    return f"{name}.pt"


def save_shard(directory: os.PathLike | str, name: str, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/<name>.pt`` atomically (temp file, fsync, rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name(name)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise SaveFailed(path, err) from err
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        # torch wraps a failed write in a RuntimeError ("file write failed")
        if isinstance(err, OSError) or any(t in str(err) for t in ("No space left", "write failed")):
            raise SaveFailed(path, err) from err
        raise
    return path


class SaveFailed(RuntimeError):
    """A checkpoint that could not be written (a full disk, a lost mount, a shard that never
    came): names the file and the latest complete checkpoint, which the failed save left as it
    was. Not bad input: the run may be restarted."""

    def __init__(self, path: Path, err: "BaseException | str"):
        folder = path if path.name.startswith((STAGING_PREFIX, "step_")) else path.parent
        run = folder.parent.parent  # <run>/checkpoints/<staging or step folder>
        newest = latest(run) if run.is_dir() else None
        what = err if isinstance(err, str) else (
            getattr(err, "strerror", None) or str(err).splitlines()[0])
        self.path = str(path)
        self.reason = (f"cannot be written ({what}); the latest complete checkpoint is "
                       f"{newest or 'none yet'}")
        super().__init__(f"{self.path}: {self.reason}")


def discard_staging(run_dir: os.PathLike | str) -> list[Path]:
    """Remove the staging folders of saves that never completed (call once no process of the
    run is left to finish them); returns what was removed. A staging folder is never a
    checkpoint, so nothing complete is lost."""
    removed = []
    folder = checkpoints_dir(run_dir)
    for staging in sorted(folder.glob(STAGING_PREFIX + "*")) if folder.is_dir() else []:
        shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    return removed


def stand_in(directory: os.PathLike | str, source: str, name: str, changes: dict[str, Any]) -> Path:
    """Shard ``name`` in the staging ``directory`` as a copy of shard ``source`` with ``changes``
    (for a replica known to be identical to the source's, which could not save its own)."""
    state = torch.load(Path(directory) / shard_name(source), weights_only=True, map_location="cpu")
    return save_shard(directory, name, {**state, **changes})


def finalize(run_dir: os.PathLike | str, step: int, meta: dict[str, Any], expected: list[str],
             keep: int = 0) -> Path:
    """Turn the staging folder of ``step`` into the checkpoint ``step_<step>``; returns its path.

    ``expected`` names the shards that must be there. With ``keep > 0``, only the newest ``keep``
    complete checkpoints survive; a failure to prune is logged, never raised.
    """
    final = seal(staging_dir(run_dir, step), final_dir(run_dir, step), step, meta, expected)
    if keep > 0:
        _prune(run_dir, keep)
    return final


def seal(staging: Path, final: Path, step: int, meta: dict[str, Any], expected: list[str]) -> Path:
    """Make the shards in ``staging`` the checkpoint ``final`` (of ``step``): check that the
    ``expected`` shards are there, write the manifest, fsync, and rename in one step."""
    if not staging.is_dir():
        raise SaveFailed(staging, "does not exist: no shard was saved for this step")
    for name in expected:
        if not (staging / shard_name(name)).is_file():
            raise SaveFailed(staging / shard_name(name), "missing: a shard was not saved")
    reserved = {"step", "files"} & meta.keys()
    if reserved:
        raise CheckpointError(staging, f"meta must not set {sorted(reserved)}")

    files = {p.name: _fsync_and_hash(p) for p in _payload_files(staging)}
    manifest = {"step": step, "torch_version": torch.__version__, "time": time.time(),
                "files": files, **meta}
    try:
        _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_dir(staging)
    except OSError as err:
        raise SaveFailed(staging / MANIFEST, err) from err
    if final.exists():  # a damaged one, or another timeline's (a resume of an older checkpoint)
        aside = free_name(final, ".superseded")
        os.rename(final, aside)
        log.warning("%s already existed: kept as %s (never pruned)", final, aside.name)
    try:
        os.rename(staging, final)
    except OSError as err:
        raise SaveFailed(final, err) from err
    _fsync_dir(final.parent)
    return final


def free_name(path: Path, suffix: str) -> Path:
    """``path`` with ``suffix-N`` added, the first N that names nothing yet."""
    n = 1
    while path.with_name(f"{path.name}{suffix}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}{suffix}-{n}")


FINAL = "final"


def final_name(pipeline: int, stage: int) -> str:
    """The shard name of a replica's weights at the end of the run: ``final/p<P>-s<S>.pt``."""
    return f"p{pipeline}-s{stage}"


def seal_final(run_dir: os.PathLike | str, meta: dict[str, Any], pipelines: int,
               stages: int) -> Optional[Path]:
    """Give ``<run>/final/`` a manifest once every replica of the run's layout wrote its weights
    there (``run.save_final``): each file's SHA-256 and ``meta`` (the run's config and every
    pipeline's iterations), so that a reader takes exactly this leg's files, checked, and never
    a file an earlier leg of another layout left. The folder of a run that lost a replica gets
    none (and an older manifest is removed): it is not one model's. Returns the manifest."""
    folder = Path(run_dir) / FINAL
    names = [shard_name(final_name(p, s)) for p in range(pipelines) for s in range(stages)]
    manifest = folder / MANIFEST
    if not all((folder / n).is_file() for n in names):
        manifest.unlink(missing_ok=True)
        return None
    doc = {"step": max(meta.get("steps", {0: 0}).values(), default=0), "time": time.time(),
           "torch_version": torch.__version__, "files": {n: sha256(folder / n) for n in names},
           **meta}
    tmp = folder / f".{MANIFEST}.tmp"
    _write_synced(tmp, json.dumps(doc, indent=1))
    os.replace(tmp, manifest)
    return manifest


def damaged(run_dir: os.PathLike | str) -> list[Path]:
    """``step_<N>`` folders without a readable manifest (a write cut short, a damaged file):
    a resume passes over them, and should say so."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir()
                  if _STEP_DIR.fullmatch(entry.name) and entry.is_dir() and not _has_manifest(entry))


def complete_checkpoints(run_dir: os.PathLike | str) -> list[Path]:
    """Every ``step_<N>`` folder with a readable manifest, oldest first: by the iterations all
    pipelines did together (a run resumed on another number of pipelines numbers its
    checkpoints by its own average pipeline), then by N."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
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
    if _STEP_DIR.fullmatch(path.name) or path.name.startswith(STAGING_PREFIX):
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


# what a resume reads from a manifest, and the test each value must pass
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


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_and_hash(path: Path) -> str:
    with path.open("rb") as f:
        os.fsync(f.fileno())
    return sha256(path)


def _payload_files(staging: Path) -> list[Path]:
    """The files a checkpoint is made of: not the manifest, not temp files of interrupted saves."""
    return sorted(p for p in staging.iterdir()
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _prune(run_dir: os.PathLike | str, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints; a checkpoint stops being one (rename) first."""
    root = checkpoints_dir(run_dir)
    try:
        old = complete_checkpoints(run_dir)[:-keep]
        leftovers = [p for p in root.iterdir() if p.name.startswith(DELETING_PREFIX)]
    except OSError as err:
        log.warning("cannot list checkpoints to prune in %s: %s", root, err)
        return
    for ckpt in old:
        doomed = root / f"{DELETING_PREFIX}{ckpt.name}"
        try:
            os.rename(ckpt, doomed)
        except OSError as err:
            log.warning("cannot prune checkpoint %s: %s", ckpt, err)
            continue
        leftovers.append(doomed)
    for path in leftovers:
        try:
            shutil.rmtree(path)
        except OSError as err:
            log.warning("cannot remove pruned checkpoint %s: %s", path, err)
