"""Settings built from a run file's values (config/settings.py ``settings_from``) are what typing
them by the schema gives, value for value and type for type; so is the record a child builds
from them (config/run_file.py ``load_child_config``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from sdpipe_cli.config import run_file
from sdpipe_cli.config.composition import compose, group_options
from sdpipe_cli.config.schema import SYNC_MODES
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.config.values import settings_from

# values a run file holds that a loader could take for another type
ODD = ["train.lr=1e-05", "run.id='007'", "model.name='1e-3'", "pipeline.partitions={1: [2]}",
       "+fault.slowed.p0s1=4.0", "train.time_limit=1e300", "cluster.slowdown=[1,1.5]",
       "cluster.nodes=[{name: n, devices: [{speed: 2}, {memory: 1.5}, {}, {}]}]",
       "cluster.changes=[{device: 'n:1', speed: 0.25, start_step: 20}]",
       "cluster.stragglers.devices=[n:2]", "cluster.stragglers.probability=0.1"]
OPTIONS = [f"{group}={option}" for group, options in group_options().items() for option in options]


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal, and of the same type at every level (1 == 1.0, but not here)."""
    assert type(a) is type(b), f"{where}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert [(k, type(k)) for k in a] == [(k, type(k)) for k in b], where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def written(tmp_path, overrides: list[str]) -> dict[str, Any]:
    """The values of a run file the launcher would write for ``overrides``."""
    path = tmp_path / "config.yaml"
    run_file.save_run_config(compose(overrides), path)
    return yaml.safe_load(path.read_text())


def check(values: dict[str, Any]) -> None:
    typed = run_file.typed(values, values["sync"]["name"])
    built = settings_from(values)
    same(built, OmegaConf.to_object(typed))
    record = OmegaConf.create(dataclasses.asdict(built))
    same(OmegaConf.to_container(record), OmegaConf.to_container(typed))
    same(settings_of(record), built)  # a child's record read as settings again


@pytest.mark.parametrize("sync", SYNC_MODES)
def test_every_sync_mode_with_values_a_loader_could_mistake(tmp_path, sync):
    check(written(tmp_path, [f"sync={sync}", *ODD]))


@pytest.mark.parametrize("option", OPTIONS)
def test_every_config_groups_option(tmp_path, option):
    check(written(tmp_path, [option]))


def test_values_of_another_type_are_converted_as_the_schemas_nodes_convert_them():
    """A file written by hand, not the launcher: an int where a float goes, numbers as text, a
    number where text goes, each taken as typing them would."""
    check({"sync": {"name": "sdpipe", "wire_share": 1}, "train": {"lr": 1, "steps": "3"},
           "cluster": {"slowdown": [1, "1.5"], "host": 7}, "run": {"id": 7}})


def test_a_childs_record_is_read_only_and_built_from_the_file(tmp_path, monkeypatch):
    run_file.save_run_config(compose(["sync=sdpipe", *ODD]), tmp_path / "config.yaml")
    monkeypatch.setenv("SDPIPE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SDPIPE_CONFIG", raising=False)
    _, cfg = run_file.load_child_config()
    assert OmegaConf.is_readonly(cfg)
    same(OmegaConf.to_container(cfg), OmegaConf.to_container(
        run_file.load_run_config(tmp_path / "config.yaml")))


@pytest.mark.parametrize("values,error", [
    ({"sync": {"name": "sdpipe"}, "train": {"stepz": 3}}, "unknown keys"),
    ({"sync": {"name": "sdpipe"}, "train": {"steps": 2.5}}, "not an integer"),
    ({"sync": {"name": "sdpipe"}, "train": 3}, "expected a mapping"),
])
def test_values_of_another_shape_are_refused(values, error):
    with pytest.raises(TypeError, match=error):
        settings_from(values)
