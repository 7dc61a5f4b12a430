"""A config that a run saved (a checkpoint's manifest, ``final/``'s, an export's), read back as data.

A saved config comes from a file anyone may have written. Before anything reads a key of it, it
is typed by the schema of its sync mode (an unknown key, a wrong type or a missing section is
one :class:`ConfigError` naming the file, not a traceback deep in a reader), and its size and
depth are bounded. Whether code it names may run is :mod:`~sdpipe_cli.config.trust`'s question.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdpipe_cli.config.schema import ConfigError, schema_for

__all__ = ["typed"]

MAX_DEPTH = 64  # a run's config nests a few levels; a deeper one was not written by a run


def typed(config: Any, where: str) -> DictConfig:
    """``config`` (a plain mapping read from ``where``) merged into its schema."""
    if not isinstance(config, Mapping):
        raise ConfigError(where, f"holds a config that is a {type(config).__name__}, not a mapping")
    if _depth(config) > MAX_DEPTH:
        raise ConfigError(where, f"holds a config nested over {MAX_DEPTH} levels deep")
    sync = config.get("sync")
    name = sync.get("name") if isinstance(sync, Mapping) else None
    if not isinstance(name, str):
        raise ConfigError(where, "its config lacks sync.name: not an sdpipe run's")
    try:
        schema = schema_for(name)
        return cast(DictConfig, OmegaConf.merge(schema, _int_keys(config, schema)))
    except (ConfigError, OmegaConfBaseException, ValueError, TypeError) as err:
        raise ConfigError(where, f"its config does not fit this sdpipe: "
                          f"{str(err).splitlines()[0]}") from None


def _int_keys(config: Mapping, schema: DictConfig) -> Mapping:
    """``config`` with the keys of the schema's int-keyed mappings (``pipeline.partitions``)
    made ints again where they are written as digits: JSON (a manifest) keeps keys as strings."""
    out = dict(config)
    for key, value in config.items():
        node = schema._get_node(key) if isinstance(key, str) and key in schema else None
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing() or \
                not isinstance(value, Mapping):
            continue
        if node._metadata.key_type is int:
            out[key] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                        for k, v in value.items()}
        else:
            out[key] = _int_keys(value, node)
    return out


def _depth(node: Any, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    items = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
    return max((_depth(v, level + 1) for v in items), default=level)
