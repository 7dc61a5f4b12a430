"""What a run shows besides metrics.jsonl, on one shared run: the timeline (``run.trace=true``,
``<run>/trace.json`` in the Chrome trace format), TensorBoard scalars
(``metrics.tensorboard=true``, ``<run>/tb``) and the same scalars in MLflow
(``metrics.mlflow=true``, ``<run>/mlruns``) and in an offline W&B run
(``metrics.wandb=offline``, ``<run>/wandb``)."""

from __future__ import annotations

import json

import psutil
import pytest

from sdpipe_cli.core.schedule import get_schedule
from tests.helpers import kill_leftovers, metrics, sdpipe
from tests.trackers_read import mlflow_run, series, wandb_run

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """sdpipe, P = S = 2, 4 micro-batches, 4 steps, evaluations and checkpoints, every output on."""
    run_dir = tmp_path_factory.mktemp("observed") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "model=mlp", "data=synthetic", "train.steps=4",
                 "train.batch_size=8", "pipeline.microbatches=4", "train.eval_every=2",
                 "checkpoint.every=2", "sync.global_every=2", "run.trace=true",
                 "metrics.tensorboard=true", "metrics.mlflow=true", "metrics.wandb=offline")
    assert not kill_leftovers(run_dir)
    assert out.returncode == 0, out.stderr
    return run_dir, out


def test_a_traced_run_shows_every_worker_and_the_1f1b_order(observed):
    run_dir, out = observed
    assert f"trace: {run_dir / 'trace.json'}" in out.stderr
    doc = json.loads((run_dir / "trace.json").read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {**{r: f"rank {r} (pipeline {r // 2}, stage {r % 2})" for r in range(4)},
                     4: "scheduler"}
    steps = {d["rank"]: d["steps"] for d in metrics(run_dir, "done")}
    assert sum(steps[r] for r in (0, 2)) == 2 * 4  # sdpipe's budget: P x train.steps in all
    for rank in range(4):
        mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
        assert all(e["ph"] in ("X", "i") and e["ts"] >= 0 for e in mine)
        compute = [e["name"] for e in mine if e["cat"] == "compute"]
        one = [str(a) for a in get_schedule("1f1b")(2, 4, rank % 2)]
        assert compute[:len(one)] == one  # the first iteration, in 1F1B order
        assert len(compute) == steps[rank] * len(one)  # every iteration's (evaluation untraced)
        cats = {e["cat"] for e in mine}
        assert {"compute", "update", "eval", "checkpoint"} <= cats, cats
        assert any(e["name"] == "group all-reduce" for e in mine)  # sdpipe's rounds
    assert any(e["name"] == "wait input" for e in events if e["pid"] % 2 == 1)  # stage 1 waits
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)


def test_the_scheduler_track_shows_each_ready_signal_and_each_round(observed):
    """Row 1 + s of the scheduler's track: an instant per ready signal it took, and a span per
    round of stage s, as metrics.jsonl's group lines list them, ending after its members'
    ready signals were taken."""
    run_dir, _ = observed
    events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
              if e["pid"] == 4]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {0: "events", 1: "stage 0", 2: "stage 1"}
    assert sum(e["args"]["events"] for e in events if e.get("cat") == "scheduler") > 0
    groups = metrics(run_dir, "group")
    for s in (0, 1):
        ready = {(e["args"]["pipeline"], e["args"]["iteration"]): e["ts"] for e in events
                 if e.get("cat") == "ready" and e["tid"] == 1 + s}
        rounds = [e for e in events if e.get("cat") == "round" and e["tid"] == 1 + s]
        mine = [g for g in groups if g["stage"] == s]
        assert [(r["name"], r["args"]["members"], r["args"]["iterations"]) for r in rounds] == [
            (f"{g['group']} {g['round']}", g["members"], g["iterations"]) for g in mine]
        assert len(ready) == sum(len(g["members"]) for g in mine)
        for r in rounds:
            assert all(ready[(p, k)] <= r["ts"] + r["dur"] + 1.0  # (rounded to 0.1 us)
                       for p, k in zip(r["args"]["members"], r["args"]["iterations"]))


def test_tensorboard_scalars_read_back_as_the_metrics_say(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = observed
    board = EventAccumulator(str(run_dir / "tb"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"pipeline0/loss", "pipeline1/loss", "pipeline0/val_loss", "pipeline0/lr",
            "pipeline0/samples_per_s", "pipeline0/stage0/wait_s", "stage0/group_size",
            "stage1/group_size", "stage0/consensus"} <= tags, tags
    for p in (0, 1):
        lines = {m["step"]: m["loss"] for m in metrics(run_dir, "train") if m["pipeline"] == p}
        board_loss = {e.step: e.value for e in board.Scalars(f"pipeline{p}/loss")}
        assert board_loss.keys() == lines.keys()
        assert all(board_loss[k] == pytest.approx(lines[k], rel=1e-6) for k in lines)
    groups = metrics(run_dir, "group")
    assert len(board.Scalars("stage0/group_size")) == sum(g["stage"] == 0 for g in groups)


def test_mlflow_and_wandb_hold_the_same_scalars(observed):
    run_dir, out = observed
    losses = {m["step"]: m["loss"] for m in metrics(run_dir, "train") if m["pipeline"] == 1}
    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "4" and run.data.params["sync.name"] == "sdpipe"
    history = client.get_metric_history(run.info.run_id, "pipeline1/loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    wandb = wandb_run(run_dir)
    assert wandb["run"].display_name == "run" and wandb["exit"] == 0
    assert wandb["config"]["train"]["steps"] == 4
    assert series(wandb["history"], "pipeline1/loss", "pipeline1/iteration") == pytest.approx(losses)
    # the scheduler's wandb-core service ended with it, and W&B said nothing on the console
    scheduler = int((run_dir / "logs" / "scheduler.pid").read_text().split()[0])
    assert not [p for p in psutil.process_iter(["cmdline"])
                if "wandb-core" in " ".join(p.info["cmdline"] or ())
                and str(scheduler) in (p.info["cmdline"] or ())]
    assert "wandb" not in out.stderr.lower()
