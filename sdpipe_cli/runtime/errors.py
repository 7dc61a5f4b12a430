"""Failures travel as data: bad input as typed errors, a child's crash as an error file.

Bad input (:class:`DataError`, :class:`CheckpointError`, like ``config.ConfigError``, a
:class:`~sdpipe_cli.core.errors.BadInput`) names the key or file at fault; the CLI prints it in one
line and exits 2. They live here, free of torch, so that the CLI reports bad input before the heavy
imports. A child's error file says whether its failure was bad input, and the launcher then exits 2
too.

Like torchrun's ``record``, each scheduler or worker process wraps its main in :func:`record`;
on an exception it writes ``<run>/logs/<name>.error.json`` (message, type, traceback, time, and
who it was) before exiting non-zero, so that the launcher can name the first failure in one line
instead of leaving the user to dig through every log.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sdpipe_cli.core.errors import BadInput


class DataError(BadInput):
    """A data problem: ``key`` is the config key or file path at fault, ``reason`` what to do."""


class Diverged(RuntimeError):
    """Training produced a loss or gradient that is not finite; the message says where, and
    which checkpoint to go on from."""


class CheckpointError(BadInput):
    """A checkpoint that cannot be found, written or trusted; ``path`` names the culprit."""

    def __init__(self, path: os.PathLike | str, reason: str):
        super().__init__(str(path), reason)
        self.path = str(path)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, or none in the user's quota


def os_error(err: BaseException) -> OSError | None:
    """The :class:`OSError` behind ``err``: itself, or one it was raised from or while handling
    (``torch.save`` on a full disk raises a ``RuntimeError`` about a position in its zip file,
    with the ``OSError`` of the write that failed as its context), or the one that Rust's
    ``(os error N)`` names in its message (safetensors, tokenizers); None if there is none."""
    seen: set[int] = set()
    first = err
    link: BaseException | None = err  # err, then what it was raised from or while handling
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    named = re.search(r"\(os error (\d+)\)", str(first))
    return OSError(int(named.group(1)), os.strerror(int(named.group(1)))) if named else None


def os_reason(err: OSError) -> str:
    """An OSError's reason, with its errno's name (ENOSPC, EFBIG, EACCES...): what a user looks
    up."""
    name = errno.errorcode.get(err.errno or 0)
    return f"{err.strerror or err} ({name})" if name else str(err.strerror or err)


def refused(err: OSError) -> str:
    """Why the system refused a write, in words: ``the disk is full: `` before the reason where
    it is, the reason with its errno's name (:func:`os_reason`)."""
    return f"{'the disk is full: ' if err.errno in DISK_FULL else ''}{os_reason(err)}"


def failed_write(err: BaseException) -> str:
    """What the machine refused, reaching the command's top (an OSError of a file sdpipe touches
    outside a run's own files: a resumed run's config, a final seal), in one line: the file, and
    the disk being full where it is."""
    cause = os_error(err)
    if cause is None:
        return str(err)
    return f"{str(cause.filename) + ': ' if cause.filename else ''}{refused(cause)}"


class WriteFailed(RuntimeError):
    """A file of the run ``run_dir`` that could not be written (a full disk, a lost mount): names
    the file and why (``the disk is full`` where it is). Not bad input: the run may be resumed,
    from its latest complete checkpoint, which a failed write never touches; whoever reports the
    failure to the user says which (``checkpoint.go_on_from``: the checkpoints are a layer
    above this one)."""

    def __init__(self, path: os.PathLike | str, err: BaseException | str, run_dir: Path):
        cause = None if isinstance(err, str) else os_error(err)
        if cause is not None and cause.errno in DISK_FULL:
            what = f": the disk is full ({cause.strerror}); free space"
        else:
            why = (err if isinstance(err, str) else
                   getattr(cause, "strerror", None) or str(err).splitlines()[0])
            what = f" ({why})"
        self.path, self.run_dir = str(path), Path(run_dir)
        self.reason = f"cannot be written{what}"
        super().__init__(f"{self.path}: {self.reason}")


def error_file(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"{name}.error.json"


RESERVE_BYTES = 16 << 10  # room kept for a child's error file on a disk that may fill up


def _reserve_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f".{name}.error.reserve"


def _reserve(run_dir: Path, name: str) -> Path | None:
    """Room for ``name``'s error file, taken now (None if the disk has none, or an outer block
    holds it already): a process that fails because the disk filled up can still say why."""
    path = _reserve_path(run_dir, name)
    if path.exists():
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(RESERVE_BYTES))  # written, not sparse: a full disk takes none
        return path
    except OSError:
        path.unlink(missing_ok=True)
        return None


def discard_reserves(run_dir: Path) -> None:
    """Remove the room children kept for their error files (a child stopped by a signal leaves
    its own), once none of them is left to need it."""
    for path in (Path(run_dir) / "logs").glob(".*.error.reserve"):
        try:
            path.unlink()
        except OSError:
            pass


@contextmanager
def record(run_dir: Path, name: str, **identity: Any) -> Iterator[None]:
    """Write an error file for any exception escaping the block, then re-raise it.

    Blocks may nest: the innermost writes the file and the outer ones leave it (its time is the
    failure's). A worker records inside its process group, before tearing it down: its peers see
    their connections close, fail, and write their own error files, and those must come later.
    The outermost block keeps room on the disk for the file (:data:`RESERVE_BYTES`), given up
    to write it: on a disk that filled up, the file still says which file could not be written.
    """
    reserve = _reserve(run_dir, name)
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:
        if getattr(err, "_sdpipe_recorded", False):
            raise
        cast(Any, err)._sdpipe_recorded = True  # our mark, on an exception of any class
        payload = {
            "message": f"{type(err).__name__}: {err}",
            "bad_input": isinstance(err, BadInput),  # the launcher then exits 2, as for its own
            "traceback": traceback.format_exc(),
            "time": time.time(),
            "pid": os.getpid(),
            **identity,
        }
        _write_error(error_file(run_dir, name), payload, _reserve_path(run_dir, name))
        raise
    finally:
        if reserve is not None:
            reserve.unlink(missing_ok=True)


def _write_error(path: Path, payload: dict[str, Any], reserve: Path) -> None:
    """The error file, in the room kept for it; without the traceback if even that is too
    much, and not at all (never a cut-short file) if nothing fits."""
    reserve.unlink(missing_ok=True)
    for fields in (payload, {k: v for k, v in payload.items() if k != "traceback"}):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(fields, indent=1))
            return
        except OSError:
            path.unlink(missing_ok=True)


def read_error(run_dir: Path, name: str) -> dict[str, Any] | None:
    path = error_file(run_dir, name)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
