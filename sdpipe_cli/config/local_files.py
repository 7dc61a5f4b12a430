"""The files a setting names on this machine (``data.path``, ``profile``), before anything reads them.

A named pipe, a device or a socket where a file or a folder belongs would block its reader
forever (a FIFO with no writer) or never end (``/dev/zero``); :func:`refuse_special` refuses it
with one :class:`~sdpipe_cli.config.schema.ConfigError` naming the key and what the path is.
"""

from __future__ import annotations

import stat
from pathlib import Path

from sdpipe_cli.config.schema import ConfigError

__all__ = ["refuse_special"]


def refuse_special(path: Path, key: str, wanted: str) -> None:
    """``path`` (given by ``key``) is absent, a regular file or a folder; else a ConfigError
    saying it is not ``wanted``."""
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise ConfigError(key, f"'{path}' is {_special(path)}, not {wanted}")


def _special(path: Path) -> str:
    """What kind of special file ``path`` is, in words."""
    mode = path.stat().st_mode
    return ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if
            stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a special file")
