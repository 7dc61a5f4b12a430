"""`sdpipe train -m`: a 2 x 2 sweep in one folder, its table, and `sdpipe report` on the folder;
the same through a Hydra launcher plug-in (submitit's local launcher: each job its own process,
as submitit_slurm makes each a SLURM job)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import kill_leftovers, one_error_line, sdpipe

pytestmark = pytest.mark.multiprocess

SMALL = ("model=mlp", "data=synthetic", "cluster.pipelines=2", "pipeline.stages=1",
         "train.steps=4", "train.batch_size=8", "train.eval_every=2")


def test_a_two_by_two_sweep_runs_compares_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    out = sdpipe("train", "-m", "sync=allreduce,sdpipe", "train.lr=1e-3,3e-3", *SMALL,
                 f"run.dir={sweep}")
    assert out.returncode == 0, out.stderr
    names = ["0-sync-allreduce_train.lr-0.001", "1-sync-allreduce_train.lr-0.003",
             "2-sync-sdpipe_train.lr-0.001", "3-sync-sdpipe_train.lr-0.003"]
    rows = json.loads((sweep / "sweep.json").read_text())["runs"]
    assert [r["run"] for r in rows] == names
    for row in rows:
        assert row["status"] == "done" and row["loss"] < 5.6 and row["samples_per_s"] > 0
        assert 0 < row["best_loss_s"] < 60
        assert not kill_leftovers(sweep / row["run"])
        assert (sweep / row["run"] / "summary.json").exists()
    assert f"sweep {sweep}" in out.stderr and all(n in out.stderr for n in names)  # the table
    figures = tmp_path / "figures"
    out = sdpipe("report", str(sweep), "--out", str(figures))
    assert out.returncode == 0, out.stderr
    assert (figures / "loss.png").exists() and (figures / "groups.png").exists()


def test_a_sweep_with_one_bad_combination_starts_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    out = sdpipe("train", "-m", "train.steps=4,-1", *SMALL[:3], f"run.dir={sweep}")
    assert out.returncode == 2
    one_error_line(out.stderr, "train.steps")
    assert not sweep.exists()


def test_a_hydra_launcher_plugin_runs_the_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    # one job: the combinations themselves are the 2 x 2 test's; this one is the plug-in's path
    out = sdpipe("train", "-m", "sync=sdpipe", *SMALL, f"run.dir={sweep}",
                 "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5")
    assert out.returncode == 0, out.stderr
    rows = json.loads((sweep / "sweep.json").read_text())["runs"]
    assert [(r["run"], r["status"]) for r in rows] == [("0-run", "done")]  # nothing varies
    logs = list((sweep / ".submitit").rglob("*_log.out"))
    assert len(logs) == 1  # the job ran in a process of submitit's
    for row in rows:
        assert not kill_leftovers(sweep / row["run"])
