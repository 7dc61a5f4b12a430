"""``run.trace=true``: every worker's timeline in ``<run>/trace.json``, the Chrome trace format."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.core.schedule import get_schedule
from tests.helpers import metrics, sdpipe

pytestmark = pytest.mark.multiprocess


def test_a_traced_run_shows_every_worker_and_the_1f1b_order(run_dir):
    out = sdpipe("train", f"run.dir={run_dir}", "model=mlp", "data=synthetic", "train.steps=4",
                 "train.batch_size=8", "pipeline.microbatches=4", "train.eval_every=2",
                 "checkpoint.every=2", "run.trace=true")
    assert out.returncode == 0, out.stderr
    assert f"trace: {run_dir / 'trace.json'}" in out.stderr
    doc = json.loads((run_dir / "trace.json").read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (pipeline {r // 2}, stage {r % 2})" for r in range(4)}
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
