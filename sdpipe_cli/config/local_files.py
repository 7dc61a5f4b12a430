"""The files a setting names on this machine (``data.path``, ``profile``), before anything reads them.

A named pipe, a device or a socket where a file or a folder belongs would block its reader
forever (a FIFO with no writer) or never end (``/dev/zero``); :func:`refuse_special` refuses it
with one :class:`~sdpipe_cli.config.schema.ConfigError` naming the key and what the path is, and
:func:`special_kind` says what such a file is, for every reader of local files. An output that
fails leaves nothing behind: :func:`remove_empty_folders` takes back the folders made for it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from sdpipe_cli.config.schema import ConfigError

__all__ = ["refuse_special", "remove_empty_folders", "special_kind"]


def refuse_special(path: Path, key: str, wanted: str) -> None:
    """``path`` (given by ``key``) is absent, a regular file or a folder; else a ConfigError
    saying it is not ``wanted``."""
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise ConfigError(key, f"'{path}' is {_special(path)}, not {wanted}")


_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(mode: int) -> str | None:
    """What a file of ``mode`` (``st_mode``) that is neither a regular file nor a folder is, in
    words; None for those two."""
    return next((what for test, what in _SPECIAL if test(mode)), None)


def _special(path: Path) -> str:
    """What kind of special file ``path`` is, in words."""
    return special_kind(path.stat().st_mode) or "a special file"


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (made top down for an output) from the deepest up, as long as each is
    empty: an output that failed leaves no folder it made."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return
