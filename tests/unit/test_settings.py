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


def test_an_int_where_a_float_goes_is_made_one_as_typing_makes_it():
    check({"sync": {"name": "sdpipe", "wire_share": 1}, "train": {"lr": 1},
           "cluster": {"slowdown": [1, 2]}})


# A file written by hand, not the launcher: values of another type than their fields'
HAND_WRITTEN = [{"train": {"steps": "3"}}, {"train": {"steps": 3.0}}, {"train": {"steps": None}},
                {"train": {"steps": True}}, {"metrics": {"mlflow": 1}}, {"run": {"id": 7}},
                {"run": {"id": True}}, {"cluster": {"stragglers": {"devices": "n:1"}}},
                {"cluster": {"placement": ["ab"]}}, {"pipeline": {"partitions": {"1": [2]}}},
                {"fault": {"slowed": [1]}}, {"train": 3}, {"train": {"stepz": 3}}]


@pytest.mark.parametrize("values", HAND_WRITTEN, ids=str)
def test_values_of_another_type_are_typed_instead_converted_or_refused_as_before(values, tmp_path,
                                                                                  monkeypatch):
    values = {"sync": {"name": "sdpipe"}, **values}
    with pytest.raises(TypeError):
        settings_from(values)
    try:
        expected: Any = OmegaConf.to_object(run_file.typed(values, "sdpipe"))
    except Exception as err:  # noqa: BLE001 - whatever typing raises, reading them raises too
        expected = type(err)
    got: Any
    try:
        got = settings_of(OmegaConf.create(values))
    except Exception as err:  # noqa: BLE001
        got = type(err)
    assert got == expected
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    monkeypatch.setenv("SDPIPE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SDPIPE_CONFIG", raising=False)
    if isinstance(expected, type):
        with pytest.raises(expected):
            run_file.load_child_config()
    else:  # typed by the schema, and the settings the child reads the same as the record's
        child = run_file.load_child_config()
        same(OmegaConf.to_container(child.cfg), OmegaConf.to_container(run_file.typed(values, "sdpipe")))
        assert child.settings == settings_of(child.cfg)


def test_a_childs_record_is_read_only_and_built_from_the_file(tmp_path, monkeypatch):
    run_file.save_run_config(compose(["sync=sdpipe", *ODD]), tmp_path / "config.yaml")
    monkeypatch.setenv("SDPIPE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SDPIPE_CONFIG", raising=False)
    _, cfg, settings = run_file.load_child_config()
    assert OmegaConf.is_readonly(cfg)
    assert settings == settings_of(cfg)  # built once, with the record, and the same
    same(OmegaConf.to_container(cfg), OmegaConf.to_container(
        run_file.load_run_config(tmp_path / "config.yaml")))


@pytest.mark.parametrize("overrides", [["sync=sdpipe"], ["sync=allreduce", "pipeline.schedule=zb_h1"],
                                       ["sync=diloco"], ["cluster=slow_links", "sync=sdpipe"],
                                       ["cluster=hetero_mixed", "pipeline.balance=speed"]], ids=str)
def test_a_prepared_configs_file_is_read_without_typing(tmp_path, overrides):
    """What a launch writes (a prepared config, with its plan, resolved meetings and data) holds
    values of their fields' types only: its children never take the typing path."""
    from sdpipe_cli.cli.preparing import prepare

    prepared = prepare(compose(["model=mlp", "data=synthetic", *overrides]))[0]
    path = tmp_path / "config.yaml"
    run_file.save_run_config(prepared, path)
    check(yaml.safe_load(path.read_text()))
