"""The package's layers: what imports what, and no cycles (docs/ARCHITECTURE.md draws it).

Every import is read from the source, including those inside functions, so a lazy import
cannot hide a dependency that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sdpipe_cli

PACKAGE = Path(sdpipe_cli.__file__).parent
# Lowest first: a module may import from its own package and from the ones before it.
LAYERS = ["core", "config", "analysis", "runtime", "checkpoint", "data", "model", "pipeline", "sync",
          "hetero", "training", "export", "cli"]
PURE = {"core", "config"}  # no torch at import: the CLI reports bad input without loading it


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The sdpipe modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sdpipe_cli"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("sdpipe_cli"))
    return out


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "sdpipe_cli":
        return -1  # the package's __init__: its version, nothing else
    if len(parts) < 2 or parts[1] not in LAYERS:
        return len(LAYERS)  # the package itself, __main__: above everything
    return LAYERS.index(parts[1])


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_subpackage_is_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages - {"configs"} == set(LAYERS)


def test_imports_point_down_the_layers():
    wrong = [f"{src} -> {dst}" for src, targets in graph().items() for dst in targets
             if layer(dst) > layer(src)]
    assert not wrong, "imports against the layer order " + str(LAYERS) + ":\n" + "\n".join(wrong)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if nxt not in g:
                continue  # a package's __init__ or a name, not a module of its own
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [])


def test_pure_layers_import_no_torch():
    found = modules()
    heavy = []
    for name, path in found.items():
        if len(name.split(".")) > 1 and name.split(".")[1] in PURE:
            for node in ast.parse(path.read_text()).body:  # what importing the module runs
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                         else [])
                heavy += [f"{name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not heavy, heavy
