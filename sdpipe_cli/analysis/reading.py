"""Reading ``metrics.jsonl``: the one reader (checking lines against :mod:`.records`, the
schema), the lines' kinds and the run's clocks.

Part of :mod:`sdpipe_cli.analysis` (import from there)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdpipe_cli.analysis.records import CHECKED, REQUIRED, SCHEMA

Line = dict[str, Any]

_MEANING = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
            "list": "a list", "dict": "an object", "any": "a value"}
_TYPES = {"int": (int,), "number": (int, float), "str": (str,), "bool": (bool,), "list": (list,),
          "dict": (dict,), "any": (object,)}


def _bad(where: str, reason: str) -> Exception:
    from sdpipe_cli.config.schema import ConfigError  # the CLI's one line and exit 2

    return ConfigError(where, reason)


def conforms(kind: str, name: str, value: Any) -> bool:
    """Whether ``value`` has the type :data:`SCHEMA` gives field ``name`` of a ``kind`` line."""
    spec = SCHEMA.get(kind, {}).get(name, "any?")
    if value is None:
        return spec.endswith("?")
    types = _TYPES[spec.rstrip("?")]
    if float in types and _unbounded(value):  # NaN, Infinity, past a float: never written
        return False
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def read_metrics(path: str | Path, check: bool = True) -> list[Line]:
    """The lines of ``metrics.jsonl`` (or of a run folder's), the only reader of it. A line cut
    short is left out: the last one may be being written while we read, and a process killed
    mid-line (then restarted, appending) leaves one inside the file. With ``check``, a JSON value
    that is not an object, a line without a :data:`REQUIRED` field or a :data:`CHECKED` field of
    the wrong type is a ConfigError naming ``file:line``."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    try:
        texts = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise _bad(str(path), f"cannot be read: {err}") from None
    lines = []
    for number, text in enumerate(texts, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            continue
        except RecursionError:  # nested deeper than any line sdpipe writes
            if check:
                raise _bad(f"{path}:{number}", "a metrics line nested too deeply to be one "
                                               "sdpipe wrote") from None
            continue
        if check:
            _check(line, f"{path}:{number}")
        lines.append(line)
    return lines


def _check(line: Any, where: str) -> None:
    if not isinstance(line, dict):
        raise _bad(where, f"a metrics line is a JSON object, not {type(line).__name__}")
    kind = line.get("kind")
    if not isinstance(kind, str):
        if "kind" in line:
            raise _bad(where, f"'kind' of a metrics line should be a string, not {_show(kind)}")
        return
    for name in REQUIRED.get(kind, ()):
        if name not in line:
            raise _bad(where, f"a {kind!r} line lacks {name!r}")
    for name in CHECKED.get(kind, ()):
        if name not in line:
            continue
        spec = SCHEMA[kind][name]
        value = line[name]
        if spec.endswith("?") and isinstance(value, float) and not math.isfinite(value):
            line[name] = None  # a diverged loss, as strict JSON writes it (older runs wrote NaN)
        elif not conforms(kind, name, value):
            meaning = _MEANING[spec.rstrip("?")]
            raise _bad(where, f"{name!r} of a {kind!r} line should be "
                              f"{'a finite number' if spec.startswith('number') and _unbounded(value) else meaning}"
                              f"{' or null' if spec.endswith('?') else ''}, not {_show(value)}")


def _unbounded(value: Any) -> bool:
    """A number no figure can hold: NaN, infinite, or an integer beyond a float."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, int) and abs(value) > 2 ** 63


def _show(value: Any) -> str:
    """``value`` in a message: a scalar as JSON (cut short), a container by its kind alone (it may
    be nested deep, or be long)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return json.dumps(value)[:30]


def of_kind(lines: Iterable[Line], kind: str) -> list[Line]:
    return [m for m in lines if m.get("kind") == kind]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def by_time(lines: Iterable[Line]) -> list[Line]:
    return sorted(lines, key=lambda m: m["time"])


def pipelines(lines: Iterable[Line]) -> list[int]:
    """The pipelines that reported a train line."""
    return sorted({int(m["pipeline"]) for m in of_kind(lines, "train")})


# -- clocks ----------------------------------------------------------------------------------
def first_train_time(lines: Iterable[Line]) -> float | None:
    """The earliest train line's time: the end of the run's first iteration."""
    return min((m["time"] for m in of_kind(lines, "train")), default=None)


def first_iteration_began(lines: Iterable[Line]) -> float | None:
    """When the run's first iteration began: the first train line's time less its ``step_s``."""
    return min((m["time"] - (m.get("step_s") or 0.0) for m in of_kind(lines, "train")
                if _number(m.get("time"))), default=None)


def from_first_iteration(lines: list[Line]) -> list[Line]:
    """``lines`` with their clock (``time``, ``at``) starting when the run's first iteration
    began. A run's own clock starts at its launch, and the start-up before the first iteration
    differs between runs (the first run of a sweep in one process also starts the fork server):
    compared on that clock, equal runs look unequal."""
    origin = first_iteration_began(lines)
    if origin is None:
        return lines
    return [{**m, **{k: m[k] - origin for k in ("time", "at") if _number(m.get(k))}}
            for m in lines]


def timelines(lines: list[Line]) -> list[tuple[Line | None, list[Line]]]:
    """The timelines ``lines`` hold, as (the ``resume`` line that began it or None, its lines).
    Resuming a checkpoint older than the run's progress branches the run: each ``resume`` line
    whose ``steps`` are behind a ``train`` line before it starts a timeline of the lines up to
    the checkpoint's moment (``at``, its past) and the lines after it; the lines it left behind
    stay in the timeline before."""
    cuts = []
    reached: dict[int, int] = {}  # pipeline -> the furthest iteration a train line reported
    for i, m in enumerate(lines):
        if m.get("kind") == "resume" and _number(m.get("time")) and isinstance(
                m.get("steps"), dict) and any(
                reached.get(int(p), -1) > k for p, k in m["steps"].items()
                if str(p).isdigit() and isinstance(k, int)):
            cuts.append(i)
        if m.get("kind") == "train" and isinstance(m.get("step"), int):
            reached[m["pipeline"]] = max(reached.get(m["pipeline"], -1), m["step"])
    starts = [0, *cuts]
    out: list[tuple[Line | None, list[Line]]] = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        if not start:
            out.append((None, lines[:end]))
            continue
        branch = lines[start]
        at = branch["at"] if _number(branch.get("at")) else branch["time"]
        past = [m for m in lines[:start] if not _number(m.get("time")) or m["time"] <= at]
        out.append((branch, past + lines[start:end]))
    return out
