"""Meetings settled from the measured wire: a run whose stage replicas span two nodes, with no
link described, measures its links and its first iteration, and meets as the scheduler then
decides (sdpipe_cli.sync.wire_probe), workers and scheduler alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import digests, losses, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

TWO_NODES = ("model=mlp", "data=synthetic", "cluster.pipelines=2", "pipeline.stages=2",
             "cluster.device=cpu", "cluster.nodes=[{name: a, devices: [{}, {}]},"
             " {name: b, devices: [{}, {}]}]", "train.steps=6", "train.batch_size=8",
             "train.eval_every=0", "data.eval_batches=1")


def test_replicas_on_two_nodes_measure_their_wire_and_meet_as_it_asks(tmp_path):
    """A wire share so small that no link fits it: the run chooses int8 changes and meetings
    as far apart as its budget allows, from what it measured (one node's loopback here), and
    every worker and the scheduler's policy meet by that choice: group lines every H steps,
    the budget exact, the replicas identical after the final global sync."""
    run_dir = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "sync.wire_share=0.0001",
                 *TWO_NODES)
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert "the run measures them before its first meeting" in said
    assert "links: measured" in said and "sync.every=6 sync.precision=int8" in said
    [wire] = metrics(run_dir, "wire")
    assert (wire["every"], wire["precision"]) == (6, "int8")  # capped at train.steps
    assert [s["stage"] for s in wire["stages"]] == [0, 1]
    assert all(s["members"] == 2 and s["mbit_s"] > 0 for s in wire["stages"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wire"]["every"] == 6 and "describe" in summary["wire"]
    groups = metrics(run_dir, "group")
    assert groups and all(g["every"] == 6 for g in groups)
    # the blocks follow the wire, cut where the budget ends (here at once: 6 steps, H = 6)
    assert all(len(g["nexts"]) == g["size"] and max(g["nexts"]) <= 6 for g in groups)
    done = metrics(run_dir, "done")
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 2 * 6
    for s in (0, 1):
        assert len({d["param_digest"] for d in done if d["stage"] == s}) == 1
    # a replay meets as the recording did, without measuring: the same losses and weights
    again = tmp_path / "again"
    out = sdpipe("train", f"run.dir={again}", "sync=sdpipe", "sync.wire_share=0.0001",
                 f"sync.replay={run_dir}", *TWO_NODES)
    assert out.returncode == 0, out.stderr
    assert not metrics(again, "wire")
    assert losses(metrics(again)) == losses(metrics(run_dir))
    assert digests(again) == digests(run_dir)


def test_checkpoints_name_the_steps_done_and_a_resumed_run_measures_again(tmp_path):
    """Blocks that follow the wire: a checkpoint's steps are what each pipeline did, its
    manifest keeps the meetings unresolved, and a resume from it (the run made longer)
    measures its links anew (a second ``wire`` line) and goes on from those steps."""
    import yaml

    run_dir = tmp_path / "run"
    # a share no link fits, so that the meetings are apart (and follow the wire) however fast
    # this machine's loopback and compute are at the moment
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "sync.wire_share=0.0001",
                 *TWO_NODES, "run.save_final=false", "checkpoint.on_exit=true")
    assert out.returncode == 0, out.stderr
    [wire] = metrics(run_dir, "wire")
    assert wire["adapt"] is True
    done = {d["pipeline"]: d["steps"] for d in metrics(run_dir, "done")}
    last = metrics(run_dir, "checkpoint")[-1]
    assert {int(p): k for p, k in last["steps"].items()} == done
    manifest = yaml.safe_load((run_dir / "checkpoints" / Path(last["path"]).name
                               / "manifest.json").read_text())
    assert (manifest["config"]["sync"]["every"], manifest["config"]["sync"]["precision"]) == (
        0, "auto")
    out = sdpipe("resume", last["path"], "train.steps=12")
    assert out.returncode == 0, out.stderr
    assert len(metrics(run_dir, "wire")) == 2
    resumed = [d for d in metrics(run_dir, "done")][len(done) * 2:]
    assert resumed and all(d["steps"] > done[d["pipeline"]] for d in resumed)
