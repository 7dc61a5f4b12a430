"""End-to-end ``sdpipe train`` runs: real processes, real gloo groups, a real TCPStore and files."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import digests, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

FAST = ("model=mlp", "data=synthetic", "train.batch_size=8", "pipeline.microbatches=4")
# the baselines on three pipelines: gossip leaves one replica unpaired each round
THREE = ("model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
         "train.eval_every=0")


def test_default_model_learns_on_stdlib_text(run_dir):
    """A short version of the default run: gpt_tiny on the stdlib corpus, sdpipe sync, P=2, S=2."""
    out = sdpipe("train", f"run.dir={run_dir}", "train.steps=40", "train.eval_every=20")
    assert out.returncode == 0, out.stderr
    train = metrics(run_dir, "train")
    first = [m["loss"] for m in train if m["step"] == 1]
    assert len(first) == 2 and all(5.0 < loss < 6.0 for loss in first)
    for line in train:
        assert {"step", "time", "pipeline", "loss", "samples", "samples_per_s", "lr"} <= set(line)
    done = {d["pipeline"]: d["steps"] for d in metrics(run_dir, "done") if d["stage"] == 0}
    assert sum(done.values()) == 80  # P x steps pipeline-iterations, however they were shared
    evals = metrics(run_dir, "eval")
    for p, steps in done.items():  # every eval_every iterations, and once at the very end
        expected = sorted({*range(20, steps + 1, 20), steps})
        assert sorted(m["step"] for m in evals if m["pipeline"] == p) == expected
    final = [m["val_loss"] for m in evals if m["step"] == done[m["pipeline"]]]
    assert len(final) == 2 and final[0] == final[1]  # the run ends on a global sync
    assert final[0] < 3.6, final
    # The run folder documents itself: resolved config, per-worker logs, summary.
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["cluster"]["device"] == "cpu" and cfg["pipeline"]["partition"] == [3]
    assert cfg["sync"]["name"] == "sdpipe"
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {"0.log", "1.log", "2.log",
                                                                  "3.log", "scheduler.log"}
    # the workers took the model's layout from the plan; none traced the model again
    assert not [p for p in (run_dir / "logs").glob("*.log") if "traced it here" in p.read_text()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 80 and summary["done"] == 4
    assert "sdpipe train: done" in out.stderr


def test_allreduce_keeps_the_replicas_identical(allreduce_2x2_run):
    """All-reduce keeps the replicas of every stage bit-identical (sync=none lets them drift apart:
    test_hetero_runs.py::test_hetero_static_slow_pipeline_runs_at_a_third)."""
    d = digests(allreduce_2x2_run)
    assert len(d) == 4
    for stage in (0, 1):
        assert d[(0, stage)] == d[(1, stage)]
    assert {m["step"] for m in metrics(allreduce_2x2_run, "train")} == set(range(1, 21))


def test_four_stage_gpipe_allreduce(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "sync=allreduce", "pipeline=deep",
                 "pipeline.schedule=gpipe", "train.steps=10", "train.batch_size=8", "model=mlp",
                 "data=synthetic")
    assert out.returncode == 0, out.stderr
    d = digests(run_dir)
    assert len(d) == 8
    assert all(d[(0, s)] == d[(1, s)] for s in range(4))
    assert {m["step"] for m in metrics(run_dir, "train")} == set(range(1, 11))


def test_time_limit_stops_every_pipeline_at_the_same_iteration(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "sync=allreduce", "train.steps=100000",
                 "train.time_limit=4", "cluster.compute_ms=5", *FAST)
    assert out.returncode == 0, out.stderr
    done = metrics(run_dir, "done")
    steps = {d["steps"] for d in done}
    assert len(done) == 4 and len(steps) == 1 and 0 < steps.pop() < 100000


def test_time_limit_with_group_sync_ends_on_a_global_sync(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "train.steps=100000",
                 "train.time_limit=4", "cluster.compute_ms=5", *FAST)
    assert out.returncode == 0, out.stderr
    done = metrics(run_dir, "done")
    per_pipeline = {p: {d["steps"] for d in done if d["pipeline"] == p} for p in (0, 1)}
    assert all(len(steps) == 1 for steps in per_pipeline.values())  # stages of a pipeline agree
    last = [g for g in metrics(run_dir, "group") if g["stop"]]
    assert len(last) == 2 and all(g["group"] == "global" and g["members"] == [0, 1] for g in last)
    assert digests(run_dir)[(0, 0)] == digests(run_dir)[(1, 0)]


def test_adpsgd_trains(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "sync=adpsgd", "train.steps=20", *THREE)
    assert out.returncode == 0, out.stderr
    train = metrics(run_dir, "train")
    first = min(m["loss"] for m in train if m["step"] == 1)
    assert max(m["loss"] for m in train if m["step"] == 20) < first - 0.5
    sizes = {m["group_size"] for m in metrics(run_dir, "sync")}
    assert sizes and sizes <= {1, 2}, sizes  # pairs or alone, and some sync lines at all


def test_parameter_server_trains_and_owns_the_run_length(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "sync=ps", "sync.staleness=1", "train.steps=20",
                 *THREE)
    assert out.returncode == 0, out.stderr
    done = [d for d in metrics(run_dir, "done") if d["stage"] == 0]
    total = sum(d["steps"] for d in done)
    assert 3 * 20 <= total < 3 * 20 + 3  # the server stops each pipeline at its next reply
    train = metrics(run_dir, "train")
    first = min(m["loss"] for m in train if m["step"] == 1)
    assert max(e["val_loss"] for e in metrics(run_dir, "eval")) < first - 0.5
    assert (run_dir / "logs" / "ps0.log").exists() and (run_dir / "logs" / "ps1.log").exists()
