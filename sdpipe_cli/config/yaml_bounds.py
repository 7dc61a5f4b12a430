"""A user's config folder (``--config-dir``) read within bounds, before Hydra reads it.

YAML's anchors and aliases let a file of a few hundred bytes stand for billions of values (each
alias repeats a node that itself repeats others: the "billion laughs"). Hydra hands a config file
to PyYAML and OmegaConf, which expand every alias into a copy: the composition then takes
minutes and gigabytes before it fails or the machine kills it. A plain file can be as costly:
OmegaConf spends about a millisecond on each entry of a typed list, so 60,000 entries of
``cluster.changes`` take a minute to compose. So every YAML file Hydra could read from a user's
folder is first read as a stream of parser events, which builds nothing: a list past
:data:`MAX_ENTRIES`, a file past :data:`MAX_VALUES` values or nested past
:data:`~sdpipe_cli.config.saved.MAX_DEPTH` levels is refused there, with one line naming it,
after parsing no more of the file than the bound. Only a file that has aliases is then composed
as a graph (``yaml.compose`` shares an aliased node instead of copying it) and the size of its
expansion counted without expanding it. A file past :data:`MAX_BYTES` is not read at all.
sdpipe's own ``configs/`` are not checked: they ship with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sdpipe_cli.config.saved import MAX_DEPTH
from sdpipe_cli.config.schema import ConfigError

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "MAX_VALUES", "check_folder", "check_file", "load"]

MAX_VALUES = 100_000  # values in a file once its aliases are expanded; sdpipe's largest has ~200
# entries of one list: a schedule of cluster.changes is the longest a config holds (an entry of
# it is 9 values: 10,000 of them stay within MAX_VALUES)
MAX_ENTRIES = 10_000
MAX_BYTES = 4 << 20
# libyaml's parser and composer where PyYAML has them: the same events and nodes, ten times faster
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
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
        if not _scanned(path, key):
            return  # no aliases: what the scan counted is what Hydra reads
        with open(path, "rb") as f:
            root = yaml.compose(f, Loader=_LOADER)  # nested at most MAX_DEPTH: the scan said
    except yaml.YAMLError:
        return  # a syntax error: composition reports it with its line and column
    if root is not None and _expanded(root, {}) > MAX_VALUES:
        raise ConfigError(str(path), f"expands to more than {MAX_VALUES:,} values through YAML "
                          f"aliases (*name); a config needs no such thing (given by {key})")


def load(path: Path, key: str) -> Any:
    """A YAML file anyone may have written (a run folder's ``config.yaml``), given by ``key``,
    read as a config once :func:`check_file` found it bounded; a YAML error propagates."""
    from omegaconf import OmegaConf

    check_file(path, key)
    return OmegaConf.load(path)


def _scanned(path: Path, key: str) -> bool:
    """One pass over the parser's events of ``path``, building nothing: its depth, its lists'
    entries and its values (an alias counts as one) within their bounds, else a
    :class:`ConfigError` naming the list or the file as soon as one is past; whether the file
    has aliases (then only its expansion is left to count)."""
    values, aliased = 0, False
    open_nodes: list[_Open] = []  # the collections being read, outermost first
    with open(path, "rb") as f:
        for event in yaml.parse(f, Loader=_LOADER):
            if isinstance(event, yaml.CollectionEndEvent):
                open_nodes.pop()
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue
            values += 1
            aliased = aliased or isinstance(event, yaml.AliasEvent)
            name = open_nodes[-1].child(event, path, key) if open_nodes else ""
            if values > MAX_VALUES:
                raise ConfigError(str(path), f"holds more than {MAX_VALUES:,} values; a config "
                                  f"needs far fewer (given by {key})")
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_nodes) >= MAX_DEPTH:
                    raise ConfigError(str(path), f"nests too deeply (more than {MAX_DEPTH} "
                                      f"levels; a config needs a few) (given by {key})")
                open_nodes.append(_Open(name, isinstance(event, yaml.SequenceStartEvent)))
    return aliased


@dataclass
class _Open:
    """A list or a mapping being read by :func:`_scanned`."""

    name: str  # where it is: "changes", "nodes[1].devices"
    is_list: bool
    entries: int = 0
    key: str | None = None  # a mapping's key whose value comes next (None: a key comes next)

    def child(self, event: yaml.NodeEvent, path: Path, given_by: str) -> str:
        """The name of the node ``event`` starts in this one (a mapping's key has none), counted
        as an entry of a list."""
        if self.is_list:
            self.entries += 1
            if self.entries > MAX_ENTRIES:
                raise ConfigError(str(path), f"{self.name or 'its list'}: has more than "
                                  f"{MAX_ENTRIES:,} entries; a list in a config has at most "
                                  f"{MAX_ENTRIES:,} (given by {given_by})")
            return f"{self.name}[{self.entries - 1}]"
        if self.key is None:
            self.key = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            return ""
        name, self.key = f"{self.name}.{self.key}" if self.name else self.key, None
        return name


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
