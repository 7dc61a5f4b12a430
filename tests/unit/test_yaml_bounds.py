"""A user's config folder is read within bounds: an alias bomb, a self-holding node or a nest
too deep is one line naming the file, before Hydra expands anything."""

from __future__ import annotations

import time

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config import yaml_bounds
from sdpipe_cli.config.schema import ConfigError


def bomb(levels: int) -> str:
    lines = ["pipelines: 2", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nall: *a{levels}\n"


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "cluster").mkdir()
    return tmp_path


def test_a_billion_laughs_is_refused_at_once_naming_the_file(folder, capsys):
    (folder / "cluster" / "bomb.yaml").write_text(bomb(9))  # 10**10 values
    started = time.monotonic()
    rc = main(["train", "--config-dir", str(folder), "cluster=bomb", f"run.dir={folder / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"sdpipe: error: {folder / 'cluster' / 'bomb.yaml'}: expands to more")
    assert time.monotonic() - started < 10 and not (folder / "run").exists()


def test_a_node_that_holds_itself_and_a_nest_too_deep_are_refused(folder):
    (folder / "cluster" / "self.yaml").write_text("a: &x [1, *x]\n")
    with pytest.raises(ConfigError, match="expands to more"):
        yaml_bounds.check_folder(folder)
    (folder / "cluster" / "self.yaml").unlink()
    (folder / "cluster" / "deep.yaml").write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        yaml_bounds.check_folder(folder)


def test_shared_nodes_below_the_bound_and_sdpipes_own_clusters_pass(folder):
    (folder / "cluster" / "shared.yaml").write_text(bomb(3))  # ~11,000 values
    (folder / "cluster" / "broken.yaml").write_text("a: [\n")  # composition names line and column
    yaml_bounds.check_folder(folder)
    from sdpipe_cli.config.composition import config_dir

    yaml_bounds.check_folder(config_dir())


def test_a_file_too_large_is_refused(folder):
    (folder / "cluster" / "huge.yaml").write_text("# " + "x" * yaml_bounds.MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match="bytes; a config file has at most"):
        yaml_bounds.check_folder(folder)


def changes(n: int) -> str:
    return "changes:\n" + "".join(f"  - {{device: 'a:0', speed: 0.5, start: {i}}}\n" for i in range(n))


def test_a_list_past_its_bound_is_refused_naming_it_and_one_within_passes(folder):
    (folder / "cluster" / "many.yaml").write_text(changes(yaml_bounds.MAX_ENTRIES))
    yaml_bounds.check_folder(folder)
    (folder / "cluster" / "many.yaml").write_text(changes(yaml_bounds.MAX_ENTRIES + 1))
    with pytest.raises(ConfigError, match=r"many.yaml: changes: has more than 10,000 entries"):
        yaml_bounds.check_folder(folder)
    devices = "".join(f"{{speed: {i}}}, " for i in range(yaml_bounds.MAX_ENTRIES + 1))
    (folder / "cluster" / "many.yaml").write_text(f"nodes:\n  - {{name: a}}\n  - {{name: b, "
                                                  f"devices: [{devices}]}}\n")
    with pytest.raises(ConfigError, match=r"nodes\[1\]\.devices: has more than 10,000 entries"):
        yaml_bounds.check_folder(folder)


def test_a_plain_file_of_too_many_values_is_not_called_an_alias_bomb(folder):
    keys = "".join(f"k{i}: {i}\n" for i in range(yaml_bounds.MAX_VALUES // 2 + 1))
    (folder / "cluster" / "wide.yaml").write_text(keys)
    with pytest.raises(ConfigError, match="holds more than 100,000 values") as err:
        yaml_bounds.check_folder(folder)
    assert "alias" not in err.value.reason


_trees = st.recursive(st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none()),
                      lambda inner: st.one_of(st.lists(inner, max_size=4),
                                              st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                      max_leaves=30)


@settings(max_examples=50, deadline=None)
@given(tree=_trees)
def test_the_count_without_aliases_is_the_number_of_nodes(tree):
    def count(value) -> int:
        if isinstance(value, list):
            return 1 + sum(count(v) for v in value)
        if isinstance(value, dict):
            return 1 + sum(1 + count(v) for v in value.values())  # a key is a value too
        return 1

    node = yaml.compose(yaml.safe_dump(tree), Loader=yaml.SafeLoader)
    assert yaml_bounds._expanded(node, {}) == count(tree)
