"""A user's config folder (``--config-dir``) read within bounds, before Hydra reads it.

YAML's anchors and aliases let a file of a few hundred bytes stand for billions of values (each
alias repeats a node that itself repeats others: the "billion laughs"). Hydra hands a config file
to PyYAML and OmegaConf, which expand every alias into a copy: the composition then takes
minutes and gigabytes before it fails or the machine kills it. So every YAML file Hydra could
read from a user's folder is first composed as a graph (``yaml.compose`` shares an aliased node
instead of copying it) and the size of its expansion is counted without expanding it; a file
past :data:`MAX_VALUES` values, past :data:`MAX_BYTES`, or nested past what the parser can follow
is refused with one line naming it. sdpipe's own ``configs/`` are not checked: they ship with it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sdpipe_cli.config.schema import ConfigError

__all__ = ["MAX_BYTES", "MAX_VALUES", "check_folder", "check_file"]

MAX_VALUES = 100_000  # values in a file once its aliases are expanded; sdpipe's largest has ~200
MAX_BYTES = 4 << 20
_DEPTH = 3  # <dir>/<group>/<option>.yaml, with one level of nested groups


def check_folder(folder: Path, key: str = "--config-dir") -> None:
    """Every YAML file Hydra could read from ``folder`` (up to :data:`_DEPTH` levels down)."""
    for path in sorted(folder.rglob("*")):
        if path.suffix in (".yaml", ".yml") and len(path.relative_to(folder).parts) <= _DEPTH \
                and path.is_file():
            check_file(path, key)


def check_file(path: Path, key: str = "--config-dir") -> None:
    """``path`` is a YAML file of bounded size once expanded; else a :class:`ConfigError`."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ConfigError(str(path), f"is {size:,} bytes; a config file has at most {MAX_BYTES:,} "
                          f"(given by {key})")
    try:
        with open(path, "rb") as f:
            root = yaml.compose(f, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ConfigError(str(path), f"nests too deeply to read (given by {key})") from None
    except yaml.YAMLError:
        return  # a syntax error: composition reports it with its line and column
    if root is not None and _expanded(root, {}) > MAX_VALUES:
        raise ConfigError(str(path), f"expands to more than {MAX_VALUES:,} values through YAML "
                          f"aliases (*name); a config needs no such thing (given by {key})")


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for once every alias is a copy; a node met again through
    an alias is counted from ``sizes``, not walked again. Iterative: no recursion limit."""
    stack, open_nodes = [(node, False)], set()
    while stack:
        current, children_done = stack.pop()
        if id(current) in sizes:
            continue
        if isinstance(current, yaml.ScalarNode):
            sizes[id(current)] = 1
            continue
        children = ([v for pair in current.value for v in pair]
                    if isinstance(current, yaml.MappingNode) else list(current.value))
        if children_done:
            sizes[id(current)] = min(1 + sum(sizes[id(c)] for c in children), MAX_VALUES + 1)
            open_nodes.discard(id(current))
            continue
        if any(id(c) in open_nodes or c is current for c in children):
            return MAX_VALUES + 1  # a node that holds itself: no end to its expansion
        open_nodes.add(id(current))
        stack.append((current, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(node)]
