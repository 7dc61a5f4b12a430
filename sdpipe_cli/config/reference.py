"""The configuration reference (docs/CONFIG.md), generated from the schema so that it cannot drift.

Usage::

    python -m sdpipe_cli.config.reference > docs/CONFIG.md

The schema's dataclasses already say everything a reader needs: each field's key, type and default,
and its meaning and unit in the comment beside it or in the comment block right above it. Comments
are not kept at run time, so this module reads them from the schema's source (``tokenize`` for the
comments, ``ast`` for the lines each field spans) and pairs them with the runtime view of the same
classes (``dataclasses.fields`` for defaults, ``typing.get_type_hints`` for the types to walk).

It walks the tree generically rather than naming sections: every dataclass reachable from the root
``Config`` (nested ones, and list elements as ``key[].field``), then every dataclass that the schema
offers as an option of a config group (a ``ConfigStore.store(group=..., name=..., node=...)`` call, or
a module-level dict/list/tuple of dataclasses, such as one class per sync mode), then any other
dataclass the module defines. A schema change therefore only needs the file regenerated, and
``tests/unit/test_config_reference.py`` fails until it is.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

COMMAND = "python -m sdpipe_cli.config.reference > docs/CONFIG.md"


@dataclass
class Row:
    """One documented setting: ``key`` is the full dotted path (``cluster.nodes[].host``)."""

    key: str
    type: str
    default: str
    meaning: str


# -- comments from the source -----------------------------------------------------------------
def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Comment text per line, and the lines that hold nothing but a comment."""
    text: dict[int, str] = {}
    alone: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            text[row] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                alone.add(row)
    return text, alone


class _Source:
    """Per class of one module: each field's annotation as written and its comment text."""

    def __init__(self, module: ModuleType):
        source = inspect.getsource(module)
        self.tree = ast.parse(source)
        comments, alone = _comments(source)
        self.fields: dict[str, dict[str, tuple[str, str]]] = {}
        self.docs: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            self.docs[node.name] = ast.get_docstring(node) or ""
            per: dict[str, tuple[str, str]] = {}
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                above = []
                row = item.lineno - 1
                while row in alone:
                    above.append(comments[row])
                    row -= 1
                beside = [comments[r] for r in range(item.lineno, (item.end_lineno or item.lineno) + 1)
                          if r in comments and r not in alone]
                text = " ".join([*reversed(above), *beside])
                per[item.target.id] = (ast.unparse(item.annotation), text)
            self.fields[node.name] = per

    def options(self, module: ModuleType) -> Iterator[tuple[str | None, str, type, tuple]]:
        """(group or None, option name, class, its registry) for every dataclass offered as a group
        option; the registry (the other classes offered beside it) lets the caller find the group."""
        for node in ast.walk(self.tree):  # ConfigStore.instance().store(group=..., name=..., node=...)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "store"):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            group, name, target = kw.get("group"), kw.get("name"), kw.get("node")
            if not (isinstance(group, ast.Constant) and isinstance(name, ast.Constant)
                    and isinstance(target, ast.Name)):
                continue
            cls = getattr(module, target.id, None)
            if _is_dataclass_type(cls):
                yield str(group.value), str(name.value), cls, (cls,)
        for value in vars(module).values():  # registries: {"sdpipe": SdpipeSync, ...} or (A, B)
            if isinstance(value, dict):
                items = [(str(k), v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                items = [(getattr(v, "__name__", "?"), v) for v in value]
            else:
                continue
            if items and all(_is_dataclass_type(v) for _, v in items):
                peers = tuple(v for _, v in items)
                for option, cls in items:
                    yield None, option, cls, peers


def _is_dataclass_type(obj: Any) -> typing.TypeGuard[type]:
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


# -- values and types -------------------------------------------------------------------------
def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _show(value: Any) -> str:
    """A default as it would be written in an override (YAML's null/true, lists as JSON)."""
    if value is dataclasses.MISSING or value == "???":  # OmegaConf's MISSING: a group sets it
        return "(required)"
    value = _plain(value)
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value)
    return str(value)


def _dataclass_in(hint: Any) -> tuple[type | None, bool]:
    """(the dataclass a type holds, whether it is a list of them), else (None, False)."""
    if _is_dataclass_type(hint):
        return hint, False
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, tuple, list, typing.Sequence) and args:
        inner, _ = _dataclass_in(args[0])
        return inner, inner is not None
    if origin is typing.Union:  # Optional[SomeConfig]
        found = [a for a in args if _is_dataclass_type(a)]
        if len(found) == 1:
            return found[0], False
    return None, False


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


# -- the walk ---------------------------------------------------------------------------------
def rows(cls: type, source: _Source, module: ModuleType, prefix: str = "",
         seen: set[type] | None = None) -> Iterator[Row]:
    """Every setting under ``cls``, nested dataclasses in place (depth first, in field order)."""
    seen = set() if seen is None else seen
    seen.add(cls)
    try:
        hints = typing.get_type_hints(cls, vars(module))
    except Exception:  # a name only importable under TYPE_CHECKING: walk by the defaults alone
        hints = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        # the class that declares the field (a subclass inherits its base's fields and comments)
        written = [source.fields[c.__name__][f.name] for c in cls.__mro__
                   if f.name in source.fields.get(c.__name__, {})]
        annotation = written[0][0] if written else str(hints.get(f.name, f.type))
        meaning = next((text for _, text in written if text), "")  # an override may not repeat it
        default = _default(f)
        nested, is_list = _dataclass_in(hints.get(f.name))
        if not is_list and _is_dataclass_type(type(default)):
            nested = type(default)  # the option a base-typed (or Any) field starts with
        if nested is not None and not is_list:
            yield Row(key, annotation, "(group)", meaning)
            yield from rows(nested, source, module, f"{key}.", seen)
            continue
        yield Row(key, annotation, _show(default), meaning)
        if nested is not None:
            yield from rows(nested, source, module, f"{key}[].", seen)


def _table(found: list[Row]) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in found:
        out.append(f"| `{r.key}` | `{_escape(r.type)}` | `{_escape(r.default)}` | {_escape(r.meaning)} |")
    return out


def _groups_section(config_root: Path | None) -> list[str]:
    """The YAML config groups: each option, the first sentence of its comment, the values it sets."""
    if config_root is None or not config_root.is_dir():
        return []
    from omegaconf import DictConfig, OmegaConf

    primary = config_root / "config.yaml"
    chosen: dict[str, str] = {}
    if primary.exists():
        # Hydra's primary config is a mapping
        for entry in typing.cast(DictConfig, OmegaConf.load(primary)).get("defaults", []):
            if isinstance(entry, dict) or OmegaConf.is_dict(entry):
                chosen.update({str(k): str(v) for k, v in dict(entry).items()})
    out = ["## Config groups", "",
           "Choose an option with `group=option` (`sdpipe train model=mlp`). Options only set values;",
           "the keys are the ones below. The default option is in **bold**. Files: `configs/<group>/<option>.yaml`.",
           "", "| group | option | what it is | values it sets |", "|---|---|---|---|"]
    for group in sorted(p for p in config_root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for path in sorted(group.glob("*.yaml")):
            lines = path.read_text().splitlines()
            about = []
            for line in lines:
                if not line.startswith("#"):
                    break
                about.append(line.lstrip("#").strip())
            values = OmegaConf.load(path)
            sets = []
            for k, v in values.items():
                if k == "defaults":  # Hydra's list: a sync mode's file extends its schema
                    continue
                if OmegaConf.is_config(v):
                    sets.append(f"`{k!s}` (see the file)")
                else:
                    sets.append(f"`{k!s}={_show(v)}`")
            name = f"**{path.stem}**" if chosen.get(group.name) == path.stem else path.stem
            # the first sentence (an "e.g." or "i.e." does not end one)
            first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s", " ".join(about), maxsplit=1)[0]
            shown = ", ".join(sets) or "nothing: the schema's defaults"
            out.append(f"| `{group.name}` | {name} | {_escape(first)} | {_escape(shown)} |")
    return out + [""]


def reference(module: ModuleType | None = None, root: str = "Config",
              config_root: Path | None = None) -> str:
    """The Markdown reference of ``module``'s schema (default: sdpipe's own), rooted at ``root``."""
    if module is None:
        from sdpipe_cli.config import schema as module_
        from sdpipe_cli.config.composition import config_dir

        module = module_
        if config_root is None:
            config_root = config_dir()
    source = _Source(module)
    top = getattr(module, root)
    modname = module.__name__
    out = ["# Configuration reference", "",
           f"<!-- Generated from `{modname}` by `{COMMAND}`; do not edit by hand. -->", "",
           f"Every setting of sdpipe, generated from the schema (`{modname}`: Hydra structured-config",
           "dataclasses; the YAML files under `configs/` only set values). Set a key with",
           "`key=value` (`sdpipe train train.steps=50`); `sdpipe train --cfg` prints the composed",
           "config. Defaults here are the schema's; a config group option (below) may set others",
           "(`sdpipe train --cfg` shows what a run gets). Meaning and unit come from the comment on",
           "each field in the schema.", ""]
    seen: set[type] = set()
    all_rows = list(rows(top, source, module, "", seen))
    groups = {r.key for r in all_rows if r.default == "(group)" and "." not in r.key}
    sections: dict[str, list[Row]] = {}
    for r in all_rows:  # one section per nested dataclass of the root, the rest at the top level
        root = re.split(r"[.\[]", r.key, maxsplit=1)[0]
        sections.setdefault(root if root in groups else "", []).append(r)
    for head, found in sections.items():
        found = [r for r in found if r.default != "(group)" or r.key != head]
        out += [f"## `{head}`" if head else "## Top level", ""]
        cls = next((type(_default(f)) for f in dataclasses.fields(top) if f.name == head), None)
        doc = source.docs.get(getattr(cls, "__name__", ""), "") if head else ""
        said = source.fields.get(top.__name__, {}).get(head, ("", ""))[1]
        doc = " ".join(t for t in (said, doc) if t)
        if doc:
            out += [doc, ""]
        out += _table(found) + [""]

    owner = {type(_default(f)): f.name for f in dataclasses.fields(top)
             if _is_dataclass_type(type(_default(f)))}
    extra, listed = [], set()
    for group, name, cls, peers in source.options(module):
        # A registry without a group name belongs to the root field whose default is one of its
        # classes (Config.sync defaults to the sdpipe option: the registry is the sync group's).
        group = group or next((name_ for c in peers for base, name_ in owner.items()
                               if issubclass(c, base)), None)
        if cls is not top and (group, name) not in listed:
            listed.add((group, name))
            extra.append((group, name, cls))
    if extra:
        out += ["## Config group options defined in the schema", "",
                "Dataclasses that the schema offers as options of a config group; each one's keys",
                "apply when that option is chosen.", ""]
        for group, name, cls in extra:
            head = f"{group}=" if group else ""
            out += [f"### `{head}{name}` (`{cls.__name__}`)", ""]
            if source.docs.get(cls.__name__):
                out += [source.docs[cls.__name__], ""]
            out += _table(list(rows(cls, source, module, f"{group}." if group else "", seen))) + [""]
    others = [c for c in vars(module).values() if _is_dataclass_type(c)
              and c.__module__ == module.__name__ and c not in seen]
    if others:
        out += ["## Other dataclasses of the schema", ""]
        for cls in others:
            out += [f"### `{cls.__name__}`", ""]
            out += _table(list(rows(cls, source, module, "", seen))) + [""]
    out += _groups_section(config_root)
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
