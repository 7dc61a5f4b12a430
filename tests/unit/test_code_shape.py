"""The shape the package keeps so that a reader finds each fact in one place.

- Small parts: no module over 500 lines, no function over 80 (a reader holds either at once).
- One owner per fact: the cluster is built by ``core.plan`` alone; a sync mode's behaviour is a
  property of the mode (``core.modes``) or of its strategy class (``sync``), never a comparison
  of its name somewhere else, nor a table keyed by its names.

Read from the source with ``ast``, like ``test_layers.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sdpipe_cli
from sdpipe_cli.core.modes import MODES

PACKAGE = Path(sdpipe_cli.__file__).parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
MODE_OWNERS = {"core/modes.py"}  # where modes are told apart by name (the strategy table reads
#                                  each class's own ``name``, which is not a comparison)
CLUSTER_BUILDER = "core/plan.py"


def sources() -> dict[str, tuple[str, ast.Module]]:
    return {str(p.relative_to(PACKAGE)): (p.read_text(), ast.parse(p.read_text()))
            for p in sorted(PACKAGE.rglob("*.py"))}


SOURCES = sources()


def test_no_module_is_over_500_lines():
    long = {name: text.count("\n") for name, (text, _) in SOURCES.items()
            if text.count("\n") > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, (_, tree) in SOURCES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_cluster_is_built_by_the_run_plan_alone():
    calls = [f"{name}:{node.lineno}" for name, (_, tree) in SOURCES.items()
             for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "from_config"
             and isinstance(node.value, ast.Name) and node.value.id == "Cluster"]
    assert len(calls) == 1 and calls[0].startswith(CLUSTER_BUILDER + ":"), calls


def _mode_names(node: ast.AST) -> set[str]:
    """Mode names that ``node`` spells as string constants (alone or in a tuple, list or set)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in MODES}


def _about_modes(text: str, node: ast.AST) -> bool:
    segment = (ast.get_source_segment(text, node) or "").lower()
    return any(word in segment for word in ("sync", "mode", "name"))


def mode_comparisons() -> list[str]:
    found = []
    for name, (text, tree) in SOURCES.items():
        if name in MODE_OWNERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                named = [o for o in operands if _mode_names(o)]
                if named and any(_about_modes(text, o) for o in operands if o not in named):
                    found.append(f"{name}:{node.lineno} {ast.get_source_segment(text, node)}")
            elif isinstance(node, ast.Dict):
                keys = [k for k in node.keys if k is not None and _mode_names(k)]
                if len(keys) >= 2:
                    found.append(f"{name}:{node.lineno} a table keyed by mode names")
    return found


def test_no_sync_mode_is_told_apart_by_its_name_outside_the_registry():
    found = mode_comparisons()
    assert not found, "ask core.modes.mode(name) for a property instead:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet, caught", [
    ('if cfg.sync.name == "sdpipe":\n    pass\n', True),
    ('x = mode in ("none", "ps")\n', True),
    ('t = {"sdpipe": 1, "diloco": 3}\n', True),
    ('if kind != "none":\n    pass\n', False),  # not about a mode
    ('name = "sdpipe"\n', False),  # a class's own name is not a comparison
])
def test_the_comparison_check_catches_what_it_should(snippet, caught, monkeypatch):
    monkeypatch.setitem(SOURCES, "probe.py", (snippet, ast.parse(snippet)))
    assert any(f.startswith("probe.py") for f in mode_comparisons()) is caught
