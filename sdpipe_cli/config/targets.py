"""Users' code named in a config: ``model._target_``, ``model.loss``, ``data._target_``.

Hydra's convention (a dotted path to a callable) resolved the way ``python -m`` would: from
``PYTHONPATH`` or the current folder. Run processes are forks of a server whose import path was
fixed before the user's folder was known, so the folders are added here, where the name is
looked up. A name that does not import is bad input: one line naming the key, even where the
module's own code fails or calls ``sys.exit()`` as it is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from sdpipe_cli.config.schema import ConfigError

__all__ = ["import_callable"]


def import_callable(target: Any, key: str) -> Any:
    """The callable ``target`` names; :class:`ConfigError` on ``key`` when it cannot be had."""
    if not target or not isinstance(target, str):
        raise ConfigError(key, "name an importable callable, e.g. mypkg.module.build")
    for folder in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), os.getcwd()]:
        if folder and folder not in sys.path:
            sys.path.append(folder)
    try:
        obj = _locate(target)
    except SystemExit as exit_:  # the module's sys.exit() is not sdpipe's exit (Ctrl-C stays one)
        raise ConfigError(key, f"cannot import {target!r}: importing it called "
                          f"sys.exit({exit_.code!r})") from None
    except Exception as err:  # ImportError, AttributeError, or the module's own failure
        cause = err.__cause__ or err
        raise ConfigError(key, f"cannot import {target!r}: {' '.join(str(cause).split())[:200]}") from None
    if not callable(obj):
        raise ConfigError(key, f"{target!r} is not callable")
    return obj


def _locate(path: str) -> Any:
    """What the dotted ``path`` names, found as Hydra's ``get_object`` finds it (import the
    longest module, then attributes), without it: that one logs its failure on stderr, and a
    bad name would print Hydra's lines besides sdpipe's one."""
    parts = path.split(".")
    if not all(parts):
        raise ImportError("not a dotted path (relative imports are not supported)")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            module = ".".join(parts[:i + 1])
            try:
                obj = importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name != module:  # a module found, that failed importing another
                    raise
                raise ImportError(f"{'.'.join(parts[:i])!r} has no attribute {part!r}") from None
    return obj
