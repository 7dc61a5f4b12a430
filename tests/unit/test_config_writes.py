"""A run's config is written only where a config is made: ``config/`` and each command's
preparing step. Everywhere else it is read; what sdpipe derives during a run is a new config
(:mod:`sdpipe_cli.config.derived`) or run state of its own, never an assignment to a config
that other holders still read (a worker's pipeline split, a re-split, the slowdowns measured, a
launch's run id, folder and seal). Read statically here; at run time the prepared config is
read-only, so a write the reading misses fails where it is made."""

from __future__ import annotations

import ast
from pathlib import Path

import sdpipe_cli

PACKAGE = Path(sdpipe_cli.__file__).resolve().parent

# Where a config may be written, and what makes it there.
PREPARING = {
    "config/": "composing, validating and deriving configs",
    "cli/preparing.py": "preparing a run's config (device, partition, plan, data)",
    "cli/commands.py": "placing a run by its job scheduler's environment (run.node, run.port)",
    "cli/resuming.py": "preparing a resumed leg from its checkpoint's config",
    "cli/sweeping.py": "preparing a sweep job's config from Hydra's",
    "export/evaluation.py": "preparing sdpipe eval's config for other data",
}
CONFIG_NAMES = {"cfg", "run_cfg"}
SECTIONS = {"pipeline", "fault", "train", "data", "model", "sync", "cluster", "checkpoint",
            "metrics", "profile", "plan"}


def _chain(target: ast.expr) -> tuple[str | None, list[str]]:
    """The root name and the attributes (``[]`` for a subscript) of ``a.b["c"].d``."""
    chain = []
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        chain.append(target.attr if isinstance(target, ast.Attribute) else "[]")
        target = target.value
    chain.reverse()
    return (target.id if isinstance(target, ast.Name) else None), chain


def _is_config(root: str | None, chain: list[str], aliases: set[str]) -> bool:
    """``cfg...``, ``self.cfg...``, an alias of a config section, or ``anything.<section>...``."""
    if root == "self" and chain and chain[0] in CONFIG_NAMES:
        return True
    return root in CONFIG_NAMES or root in aliases or (root != "self" and len(chain) >= 1
                                                       and chain[0] in SECTIONS)


def _writes_a_config(target: ast.expr, aliases: set[str]) -> bool:
    """``cfg.x = ``, ``self.cfg.x = ``, ``cfg["x"] = ``, ``anything.<section>.<key> = ``, or
    ``y.x = `` where ``y = cfg.sync`` (an alias of a section)."""
    root, chain = _chain(target)
    if not chain:
        return False
    if root == "self" and chain[0] in CONFIG_NAMES:
        return len(chain) > 1
    if root in CONFIG_NAMES or root in aliases:
        return True
    return root != "self" and len(chain) >= 2 and chain[0] in SECTIONS


def _aliases(tree: ast.AST) -> set[str]:
    """Names bound to a part of a config (``y = cfg.sync``, ``fault = self.cfg.fault``)."""
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            root, chain = _chain(node.value)
            if chain and _is_config(root, chain, set()):
                found.add(node.targets[0].id)
    return found - CONFIG_NAMES


def writes(tree: ast.AST) -> list[int]:
    """Lines that assign into a config, or update one in place (``OmegaConf.update``)."""
    found, aliases = [], _aliases(tree)
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        flat = [t for target in targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if any(_writes_a_config(t, aliases) for t in flat):
            found.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "merge_with")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "OmegaConf"):
            found.append(node.lineno)
    return sorted(found)


def test_the_detector_sees_each_way_of_writing_a_config():
    code = ("cfg.pipeline.partition = [3]\nself.cfg.fault.slowed = {}\nrun_cfg.train.lr += 1\n"
            "moved.pipeline.partition, moved.pipeline.partitions = a, b\ncfg['x'] = 1\n"
            "OmegaConf.update(cfg, 'a', 1)\n"
            "self.run.live = set()\nx.y = 1\ncfg = other\nself.cfg = derived.resplit(cfg)\n"
            "self.sync.stop = True\nconfig.tie_word_embeddings = False\n"
            "y = cfg.sync\ny.every, y.precision = 2, 'bf16'\nz = self.run\nz.x = 1\n")
    assert writes(ast.parse(code)) == [1, 2, 3, 4, 5, 6, 14]


def test_no_config_is_written_outside_where_configs_are_made():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if any(name.startswith(prefix) for prefix in PREPARING):
            continue
        lines = writes(ast.parse(path.read_text()))
        if lines:
            outside[name] = lines
    assert not outside, f"configs written outside config/ and the preparing steps: {outside}"


def test_the_prepared_config_refuses_a_write_and_a_derived_one_leaves_it_as_it_was():
    import pytest
    from omegaconf.errors import ReadonlyConfigError

    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config import derived
    from sdpipe_cli.config.composition import compose

    cfg = prepare(compose(["model=mlp", "data=synthetic"]))[0]
    with pytest.raises(ReadonlyConfigError):
        cfg.train.steps = 7
    opened = derived.with_run(cfg, id="abc", dir="/tmp/elsewhere")
    assert (opened.run.id, opened.run.dir) == ("abc", "/tmp/elsewhere")
    assert cfg.run.id != "abc" and cfg.run.dir != "/tmp/elsewhere"
    with pytest.raises(ReadonlyConfigError):
        opened.run.id = "changed"  # a derived config is as read-only as the one it came from
