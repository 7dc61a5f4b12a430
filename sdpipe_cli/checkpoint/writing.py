"""Writing checkpoints: every rank saves its own shard, one process makes the set a checkpoint
atomically.

During a save each process (one per rank, plus the scheduler) writes its shard into
``checkpoints/.staging-step_<N>/`` with :func:`save_shard`; the scheduler then calls
:func:`finalize`, which writes ``manifest.json`` (the SHA-256 of every file, plus the caller's
metadata), fsyncs everything and renames the staging folder to ``step_<N>`` in one ``rename``.
So a crash in the middle of a save never touches an earlier checkpoint, and a folder without a
manifest (or under a staging name) is never taken for one. Old checkpoints are pruned to
``checkpoint.keep``; ``final/`` is sealed by a manifest once every replica wrote there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sdpipe_cli.checkpoint.layout import (
    DELETING_PREFIX,
    FINAL,
    MANIFEST,
    STAGING_PREFIX,
    checkpoints_dir,
    final_dir,
    final_name,
    free_name,
    sha256,
    shard_name,
    staging_dir,
)
from sdpipe_cli.checkpoint.reading import complete_checkpoints
from sdpipe_cli.runtime.errors import CheckpointError, WriteFailed, os_error

log = logging.getLogger("sdpipe.checkpoint")


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
        # torch wraps a failed write in a RuntimeError ("file write failed", or a position in
        # its zip file, with the write's OSError as its context)
        if os_error(err) is not None or any(t in str(err) for t in ("No space left", "write failed")):
            raise SaveFailed(path, err) from err
        raise
    return path


class SaveFailed(WriteFailed):
    """A checkpoint that could not be written (a full disk, a lost mount, a shard that never
    came): names the file and the latest complete checkpoint, which the failed save left as it
    was (:class:`~sdpipe_cli.runtime.errors.WriteFailed`, for a file in a checkpoint's folder)."""

    def __init__(self, path: Path, err: BaseException | str):
        folder = path if path.name.startswith((STAGING_PREFIX, "step_", FINAL)) else path.parent
        # <run>/checkpoints/<folder>, or the run's final weights, <run>/final
        super().__init__(path, err, folder.parent if folder.name == FINAL else folder.parent.parent)


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


def seal_final(run_dir: os.PathLike | str, meta: dict[str, Any], pipelines: int,
               stages: int) -> Path | None:
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
