"""A run file's values as settings, built field by field from the schema's annotations.

The launcher writes a run's config as plain YAML (:func:`~sdpipe_cli.config.run_file.
save_run_config`), every key of the schema, each value of its type; every child reads it back.
Typing it by merging it into the schema (:func:`~sdpipe_cli.config.run_file.typed`) cost each
child about 20-25 ms of CPU here, a tenth of a small worker's start and end; building the
dataclasses from the values directly takes under a millisecond and gives the same settings, value
for value and type for type (``tests/unit/test_settings.py`` compares the two on every config
group's option). It takes values of their fields' types only (and an int where a float goes,
which it makes one, as typing does): anything else is a ``TypeError``, and the caller types the
values instead, which converts what OmegaConf's nodes convert and refuses the rest as before.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, cast

from sdpipe_cli.config.schema import SYNC_CONFIGS, Config

__all__ = ["settings_from", "warm"]


def settings_from(values: Mapping[str, Any]) -> Config:
    """``values``, a whole run config as plain data, as settings."""
    sync = SYNC_CONFIGS[str(values["sync"]["name"])]
    return cast(Config, _build(Config, values, {"sync": sync}))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def warm() -> None:
    """Read every section's annotations once (the fork server does, for the children it forks:
    a child's first :func:`settings_from` then takes 0.4 ms, not 3)."""
    def visit(kind: Any) -> None:
        for arg in typing.get_args(kind):
            visit(arg)
        if dataclasses.is_dataclass(kind):
            for inner in _hints(cast(type, kind)).values():
                visit(inner)

    for kind in (Config, *SYNC_CONFIGS.values()):
        visit(kind)


def _build(cls: type, values: Mapping[str, Any], chosen: Mapping[str, type] | None = None) -> Any:
    if not isinstance(values, Mapping):
        raise TypeError(f"{cls.__name__}: expected a mapping, got {type(values).__name__}")
    hints = _hints(cls)  # a section's fields, by name
    unknown = set(values) - hints.keys()
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    return cls(**{key: _value((chosen or {}).get(key, hints[key]), value)
                  for key, value in values.items()})


def _value(kind: Any, value: Any) -> Any:
    """``value`` as a field annotated ``kind`` holds it in settings: of that type already (an
    int where a float goes is made one, as typing does), else a ``TypeError``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (kind,) = [a for a in args if a is not type(None)]  # the schema's unions are Optional[X]
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return _build(cast(type, kind), value)
    if origin is list and isinstance(value, list):
        return [_value(args[0], item) for item in value]
    if origin is dict and isinstance(value, Mapping):
        return {_value(args[0], k): _value(args[1], v) for k, v in value.items()}
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(kind, type) and origin is None and type(value) is kind:
        return value
    raise TypeError(f"{value!r} is not a {kind}")
