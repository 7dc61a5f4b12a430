"""A device that slows down mid-run is named (``fault.on_slowdown=warn``): in metrics.jsonl, on the
console, and nowhere else. The slowdown is emulated (``cluster.changes``) on modelled compute."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers import metrics, sdpipe

pytestmark = pytest.mark.multiprocess

WARMUP, WINDOW = 3, 5  # the detector's warm-up and fault.slowdown_window
CONFIRM = WINDOW // 2 + 1


def test_a_device_that_slows_mid_run_is_named_once(tmp_path):
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", "model=gpt_tiny", "data=stdlib", "cluster.pipelines=2",
                 "pipeline.stages=2", "train.steps=50", "cluster.compute_ms=5",
                 "train.eval_every=0", "cluster.changes=[{device: 'local:3', speed: 0.25, start: 4.0}]")
    assert out.returncode == 0, out.stderr[-3000:]
    # pipeline 1's last stage (rank 3, device local:3) reports its compute in its train lines
    busy = {m["step"]: m["busy_s"] for m in metrics(run, "train") if m["pipeline"] == 1}
    steps = sorted(busy)
    start = statistics.median(busy[k] for k in steps[WARMUP:WARMUP + WINDOW])
    slow = [k for k in steps if busy[k] > 2 * start]
    named = metrics(run, "straggler")
    if not slow or slow[0] <= WARMUP + WINDOW:
        # on a loaded machine the slowdown may come before the device's start was measured:
        # then it is the device's plan, and nothing may be named
        assert named == [], named
        return
    assert [(m["device"], m["node"], m["pipeline"], m["stage"], m["rank"]) for m in named] == [
        ("local:3", "local", 1, 1, 3)]
    assert slow[0] <= named[0]["iteration"] <= slow[0] + 2 * CONFIRM - 2
    assert 3.0 < named[0]["slower"] < 5.0  # speed 0.25, against an unchanged peer
    assert "slow device: local:3 (node local, pipeline 1, stage 1, rank 3)" in out.stderr
    assert metrics(run, "recovered") == []
