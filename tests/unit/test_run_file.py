"""A run's config.yaml read back by its children (config/run_file.py): libyaml's parser and a
schema built once give what OmegaConf's own loader and a schema built anew gave."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from sdpipe_cli.config import run_file
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import SYNC_MODES, schema_for


@pytest.mark.parametrize("sync", SYNC_MODES)
def test_a_saved_config_reads_back_as_omegaconfs_loader_and_a_fresh_schema_read_it(tmp_path, sync):
    cfg = compose([f"sync={sync}", "train.lr=1e-05", "pipeline.partitions={1: [2]}",
                   "+fault.slowed.p0s1=4.0", "run.id='007'", "model.name='1e-3'"])
    path = tmp_path / "config.yaml"
    run_file.save_run_config(cfg, path)
    got = run_file.load_run_config(path)
    before = OmegaConf.merge(schema_for(sync), OmegaConf.load(path))
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(before)
    assert OmegaConf.get_type(got.sync) is OmegaConf.get_type(before.sync)
    assert got.train.lr == 1e-05 and dict(got.pipeline.partitions) == {1: [2]}
    assert got.run.id == "007" and got.model.name == "1e-3"  # strings stay strings
    got.train.lr = 0.5  # a config read back is a copy of its own (a child's: read-only, below)
    again = run_file.load_run_config(path)  # the shared schema was not changed by either
    assert again.train.lr == 1e-05 and OmegaConf.is_readonly(run_file.frozen_schema(sync))
    with pytest.raises(ReadonlyConfigError):
        run_file.frozen_schema(sync).train.lr = 1.0


def test_a_childs_config_is_read_only_and_what_it_derives_is_a_new_one(tmp_path, monkeypatch):
    from sdpipe_cli.config import derived

    saved = compose(["sync=sdpipe", "cluster.pipelines=3", "pipeline.partition=[3]"])  # resolved
    run_file.save_run_config(saved, tmp_path / "config.yaml")
    monkeypatch.setenv("SDPIPE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SDPIPE_CONFIG", raising=False)
    cfg = run_file.load_child_config().cfg
    with pytest.raises(ReadonlyConfigError):
        cfg.pipeline.partition = [1]
    moved = derived.resplit(cfg, {1: [1]}, {"p1s0": 2.0})
    assert dict(moved.pipeline.partitions) == {1: [1]} and dict(moved.fault.slowed) == {"p1s0": 2.0}
    assert list(cfg.pipeline.partition) == [3] and dict(cfg.pipeline.partitions) == {}
    assert dict(cfg.fault.slowed) == {}  # the child's own config is as it was read


@pytest.mark.parametrize("sync", SYNC_MODES)
def test_a_child_and_the_launcher_read_the_same_typed_sections(tmp_path, sync):
    """What a child reads (its config typed when read) and what the launcher reads (its
    prepared config, schema-free) are the same sections, each the schema's dataclass, the sync
    section its mode's; a section is a copy: writing to it changes neither config."""
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config.schema import SYNC_CONFIGS, CheckpointConfig, FaultConfig, TrainConfig
    from sdpipe_cli.config.settings import settings_of

    prepared = prepare(compose([f"sync={sync}", "model=mlp", "data=synthetic", "train.lr=2e-3",
                                "fault.slowdown_window=7", "checkpoint.keep=5"]))[0]
    path = tmp_path / "config.yaml"
    run_file.save_run_config(prepared, path)
    child = run_file.load_run_config(path)
    launcher, read = settings_of(prepared), settings_of(child)
    assert launcher == read
    assert isinstance(read.train, TrainConfig) and read.train.lr == 2e-3
    assert isinstance(read.fault, FaultConfig) and read.fault.slowdown_window == 7
    assert isinstance(read.checkpoint, CheckpointConfig) and read.checkpoint.keep == 5
    assert type(read.sync) is SYNC_CONFIGS[sync] and read.sync.name == sync
    read.train.lr = 1.0
    assert child.train.lr == 2e-3 and prepared.train.lr == 2e-3 and settings_of(child).train.lr == 2e-3
