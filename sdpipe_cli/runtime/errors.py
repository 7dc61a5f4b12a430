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

import json
import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

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


def error_file(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"{name}.error.json"


@contextmanager
def record(run_dir: Path, name: str, **identity: Any) -> Iterator[None]:
    """Write an error file for any exception escaping the block, then re-raise it.

    Blocks may nest: the innermost writes the file and the outer ones leave it (its time is the
    failure's). A worker records inside its process group, before tearing it down: its peers see
    their connections close, fail, and write their own error files, and those must come later.
    """
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:
        if getattr(err, "_sdpipe_recorded", False):
            raise
        err._sdpipe_recorded = True
        payload = {
            "message": f"{type(err).__name__}: {err}",
            "bad_input": isinstance(err, BadInput),  # the launcher then exits 2, as for its own
            "traceback": traceback.format_exc(),
            "time": time.time(),
            "pid": os.getpid(),
            **identity,
        }
        path = error_file(run_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1))
        raise


def read_error(run_dir: Path, name: str) -> dict[str, Any] | None:
    path = error_file(run_dir, name)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
