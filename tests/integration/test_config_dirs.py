"""Config files of one's own, in a folder outside the repository (``--config-dir DIR``, Hydra's
way), and the errors a broken one gets: the file, line and column of a YAML mistake; the key's
full path, the value and the whole reason for a wrong type; the nearest valid key for a
misspelled one; the fix for the two usual override mistakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import one_error_line, sdpipe

pytestmark = pytest.mark.multiprocess

MINE = """\
# a cluster of one's own: 2 pipelines, the second three times slower
pipelines: 2
device: cpu
compute_ms: 5
slowdown: [1, 3]
"""
TINY = ("model=mlp", "data=synthetic", "pipeline.stages=2", "train.steps=4", "train.batch_size=8",
        "train.eval_every=0")
# a sweep's jobs are checked for what they keep of the config folder, not for their shape: the
# cluster file's 2 pipelines, of one stage each (half the workers of TINY's)
SWEPT = tuple("pipeline.stages=1" if o.startswith("pipeline.stages=") else o for o in TINY)


@pytest.fixture
def config_dir(tmp_path) -> Path:
    folder = tmp_path / "my-configs"
    (folder / "cluster").mkdir(parents=True)
    (folder / "cluster" / "mine.yaml").write_text(MINE)
    (folder / "cluster" / "broken.yaml").write_text("pipelines: 2\nnodes: [a, b\n")
    (folder / "cluster" / "badtype.yaml").write_text("pipelines: three\n")
    (folder / "cluster" / "unknown.yaml").write_text("pipelinez: 2\n")
    (folder / "experiment").mkdir()
    (folder / "experiment" / "quick.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /cluster: mine\n  - override /model: mlp\n"
        "train:\n  steps: 7\n  lr: 0.002\n")
    return folder


def test_an_experiment_file_sets_a_whole_run(config_dir):
    """Hydra's experiment pattern: one file of the config folder picks groups and sets values."""
    import yaml

    out = sdpipe("train", "-cd", str(config_dir), "+experiment=quick", "data=synthetic", "--cfg")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert (cfg["cluster"]["slowdown"], cfg["model"]["arch"], cfg["train"]["steps"],
            cfg["train"]["lr"]) == ([1, 3], "mlp", 7, 0.002)


def test_a_cluster_file_of_ones_own_drives_train_resume_simulate_profile_and_a_sweep(config_dir, tmp_path):
    run = tmp_path / "run"
    out = sdpipe("train", "--config-dir", str(config_dir), "cluster=mine", *TINY,
                 "checkpoint.every=2", "sync=allreduce", f"run.dir={run}")
    assert out.returncode == 0, out.stderr
    saved = (run / "config.yaml").read_text()
    copied = run / "config-dirs" / f"0-{config_dir.name}" / "cluster" / "mine.yaml"
    assert copied.read_text() == MINE  # the run folder keeps the files it was described by
    assert "slowdown:\n  - 1\n  - 3" in saved.replace("- 1.0", "- 1").replace("- 3.0", "- 3")
    resumed = sdpipe("resume", str(run / "checkpoints" / "step_2"))
    assert resumed.returncode == 0, resumed.stderr
    sim = sdpipe("simulate", "-cd", str(config_dir), "cluster=mine", *TINY,
                 f"run.dir={tmp_path / 'sim'}", "--compare", "none")
    assert sim.returncode == 0, sim.stderr
    doc = json.loads((tmp_path / "sim" / "simulation.json").read_text())
    assert doc["pipelines"] == 2 and doc["config"]["cluster"]["slowdown"] == [1, 3]
    prof = sdpipe("profile", "-cd", str(config_dir), "cluster=mine", "model=mlp", "data=synthetic",
                  "pipeline.stages=2", f"run.dir={tmp_path / 'prof'}")
    assert prof.returncode == 0, prof.stderr
    assert json.loads((tmp_path / "prof" / "profile.json").read_text())["cluster"]["pipelines"] == 2
    sweep = sdpipe("train", "-m", "-cd", str(config_dir), "cluster=mine", *SWEPT,
                   "train.lr=1e-3,3e-3", f"run.dir={tmp_path / 'sweep'}")
    assert sweep.returncode == 0, sweep.stderr
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [r["status"] for r in rows] == ["done", "done"]
    for row in rows:
        assert (tmp_path / "sweep" / row["run"] / "config-dirs" / f"0-{config_dir.name}" /
                "cluster" / "mine.yaml").read_text() == MINE


BAD = [
    (["cluster=broken"], "{dir}/cluster/broken.yaml:3:1",
     "YAML syntax: while parsing a flow sequence expected ',' or ']'"),
    (["cluster=badtype"], "cluster.pipelines",
     "Value 'three' of type 'str' could not be converted to Integer (in config file "
     "cluster/badtype.yaml)"),
    (["cluster=unknown"], "cluster.pipelinez",
     "is not a setting of sdpipe; did you mean 'cluster.pipelines'? (in config file "
     "cluster/unknown.yaml)"),
    (["train.stepz=5"], "train.stepz", "did you mean 'train.steps'?"),
    (["+train.stepz=5"], "train.stepz", "did you mean 'train.steps'?"),
    (["train.steps", "10"], "train.steps", "an override is KEY=VALUE in one word: write "
                                           "train.steps=VALUE"),
    (["train.lr=1e-3,3e-3"], "train.lr", "a comma-separated value is a sweep: run it with -m"),
    (["cluster=nope"], "cluster", "no option 'nope' in config group 'cluster' (choices: "),
]


@pytest.mark.parametrize("args,key,reason", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_a_mistake_is_named_where_it_is(config_dir, args, key, reason):
    out = sdpipe("train", "--config-dir", str(config_dir), *args, "--cfg")
    assert out.returncode == 2
    line = one_error_line(out.stderr, key.format(dir=config_dir))
    assert reason in line, line


def test_a_config_dir_that_is_not_there_is_named(tmp_path):
    out = sdpipe("train", "-cd", str(tmp_path / "absent"), "--cfg")
    assert out.returncode == 2
    one_error_line(out.stderr, "--config-dir")
