"""docs/CONFIG.md is generated from the schema: it must be current and name every setting."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
import typing
from pathlib import Path

from sdpipe_cli.config import reference, schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"


def test_config_md_is_current():
    assert DOC.read_text() == reference.reference(), (
        f"docs/CONFIG.md is out of date with the schema (sdpipe_cli/config/schema.py); "
        f"regenerate it from the repository root: {reference.COMMAND}")


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every key under a dataclass, written independently of the generator's walk."""
    out = []
    hints = typing.get_type_hints(cls, vars(schema))
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        out.append(key)
        if dataclasses.is_dataclass(hint):
            out += _keys(hint, key + ".")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            out += _keys(typing.get_args(hint)[0], key + "[].")
        elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
                type(default := f.default_factory())):
            out += _keys(type(default), key + ".")
    return out


def test_every_schema_field_appears():
    text = reference.reference()
    lines = text.splitlines()
    missing = [k for k in _keys(schema.Config)
               if not any(line.startswith((f"| `{k}` |", f"## `{k}`")) for line in lines)]
    assert not missing, f"not in the reference: {missing}"
    # and every field of every dataclass the schema defines, wherever it is reached from
    documented = {line.split("`")[1].rsplit(".", 1)[-1].removeprefix("[]")
                  for line in lines if line.startswith(("| `", "## `"))}
    for cls in vars(schema).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__:
            for f in dataclasses.fields(cls):
                assert f.name in documented, f"{cls.__name__}.{f.name} is not in the reference"


def test_comments_are_the_meaning():
    text = reference.reference()
    assert "| `train.lr` | `float` | `0.003` | peak learning rate |" in text
    # a comment block above a field, joined into one line
    assert "Nodes and their devices; empty: one node" in text
    assert "| `cluster.nodes[].devices[].speed` | `float` | `1.0` |" in text


TOY = '''
from __future__ import annotations
from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class SyncBase:
    name: str = "?"  # the sync mode


@dataclass
class GossipSync(SyncBase):
    """Gossip with one peer per round."""
    name: str = "gossip"
    # peers per round
    fanout: int = 1


@dataclass
class GroupSync(SyncBase):
    window_ms: float = 5.0  # initial waiting window


SYNC_OPTIONS = {"group": GroupSync, "gossip": GossipSync}


@dataclass
class Part:
    size: Optional[int] = None  # bytes; null: all


@dataclass
class Config:
    sync: SyncBase = field(default_factory=GroupSync)  # how replicas agree
    parts: List[Part] = field(default_factory=list)
    seed: int = 0  # the one seed


@dataclass
class Unused:
    flag: bool = True  # reached from nowhere
'''


def test_nested_and_registered_dataclasses(tmp_path):
    """A schema with one dataclass per option of a group (as the sync modes may become)."""
    path = tmp_path / "toy_schema.py"
    path.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("toy_schema", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_schema"] = module
    try:
        spec.loader.exec_module(module)
        text = reference.reference(module)
    finally:
        del sys.modules["toy_schema"]
    assert "| `sync.window_ms` | `float` | `5.0` | initial waiting window |" in text
    assert "| `parts[].size` | `Optional[int]` | `null` | bytes; null: all |" in text
    assert "| `seed` | `int` | `0` | the one seed |" in text
    assert "### `sync=gossip` (`GossipSync`)" in text
    assert "Gossip with one peer per round." in text
    assert "| `sync.fanout` | `int` | `1` | peers per round |" in text
    assert "| `sync.name` | `str` | `gossip` | the sync mode |" in text  # inherited comment
    assert "| `flag` | `bool` | `true` | reached from nowhere |" in text
