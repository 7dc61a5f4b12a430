"""What the scheduler makes of the detector's verdicts: lines that name the device and its node,
the snapshot the console reads, the trackers' scalar, the report's figure."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.cli import report
from sdpipe_cli.cli.preparing import prepare
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime.metrics import scalars
from sdpipe_cli.runtime.stragglers import StragglerWatch

NODES = ("cluster.nodes=[{name: a, devices: [{speed: 1.0}, {speed: 1.0}]}, "
         "{name: b, devices: [{speed: 1.0}, {speed: 1.0}]}]")


@pytest.fixture(scope="module")
def watch():
    cfg = prepare(compose(["model=mlp", "data=synthetic", "cluster.pipelines=2",
                           "pipeline.stages=2", NODES, "fault.slowdown_window=3"]))[0]
    return StragglerWatch(settings_of(cfg).fault, RunPlan.of(cfg))


def step(p, s, k, busy):
    return {"type": "step", "rank": 2 * p + s, "pipeline": p, "stage": s, "time": float(k),
            "step": k, "busy_s": busy}


def test_a_slow_device_is_named_with_its_node_and_rank(watch):
    lines = []
    for k in range(1, 30):
        for p in (0, 1):
            for s in (0, 1):
                lines += watch.lines(step(p, s, k, 0.4 if (p, s) == (1, 0) and k > 15 else 0.1))
    assert len(lines) == 1
    line = lines[0]
    device = watch.plan.cluster.device(1, 0)
    assert (line["kind"], line["device"], line["node"], line["pipeline"], line["stage"],
            line["rank"]) == ("straggler", device.name, device.node, 1, 0, 2)
    assert line["slower"] == pytest.approx(4.0) and line["baseline_s"] == pytest.approx(0.1)
    assert [(d["device"], d["slower"]) for d in watch.current()] == [(device.name, 4.0)]
    assert watch.lines({"type": "eval", "pipeline": 1, "stage": 0}) == []  # only step reports
    assert scalars(line) == [("pipeline1/stage0/slower", 4.0, line["iteration"], line["time"])]
    watch.reset(1)
    assert watch.current() == []


def test_the_report_draws_the_straggler(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("sync:\n  name: sdpipe\npipeline:\n  stages: 2\n")
    lines = [{"kind": "train", "pipeline": 0, "step": k, "time": float(k), "samples": 8 * k,
              "samples_per_s": 8.0, "loss": 1.0, "busy_s": 0.1 if k < 10 else 0.3}
             for k in range(1, 20)]
    lines.append({"kind": "straggler", "time": 13.0, "pipeline": 0, "stage": 1, "rank": 1,
                  "device": "local:1", "node": "local", "iteration": 13, "slower": 3.0,
                  "busy_s": 0.3, "baseline_s": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    written = report.report([report.load(run)], tmp_path / "figures")
    assert tmp_path / "figures" / "stragglers.png" in written


def test_a_device_slow_before_the_re_plan_is_said_to_be_still_slow():
    """The leg after a re-plan: the device found slow before (``fault.slowed``) is in the
    snapshot from the start, marked carried, and the console says it is still slow, not that
    it just slowed down."""
    import io

    from rich.console import Console

    from sdpipe_cli.cli.display import ProgressDisplay

    cfg = prepare(compose(["model=mlp", "data=synthetic", "cluster.pipelines=2",
                           "pipeline.stages=2", NODES, "+fault.slowed.p1s0=4.0"]))[0]
    carried = StragglerWatch(settings_of(cfg).fault, RunPlan.of(cfg))
    [entry] = carried.current()
    assert (entry["pipeline"], entry["stage"], entry["carried"]) == (1, 0, 4.0)
    out = io.StringIO()
    shown = ProgressDisplay(Console(file=out, width=200), 100, 0)
    shown.update(summary_of(carried))
    assert "still slow: " in out.getvalue() and "slow device" not in out.getvalue()


def summary_of(watch) -> dict:
    """What the scheduler's progress snapshot says of slow devices."""
    return {"stragglers": watch.current(), "straggler_news": watch.news_snapshot()}


def console_lines(snapshots) -> list[str]:
    """The console's lines for a sequence of progress snapshots."""
    import io

    from rich.console import Console

    from sdpipe_cli.cli.display import ProgressDisplay

    out = io.StringIO()
    shown = ProgressDisplay(Console(file=out, width=300), 100, 0)
    for snap in snapshots:
        shown.update(snap)
    return [line for line in out.getvalue().splitlines()
            if line.startswith(("slow device", "still slow", "recovered"))]


def test_the_console_says_each_change_the_scheduler_decided_once():
    """The watch decides what is said: a device named and recovered between two snapshots is
    said to be both, and a restart's fresh start (its pipeline's devices forgotten) is no
    recovery. Each change is said once, however many snapshots repeat it."""
    cfg = prepare(compose(["model=mlp", "data=synthetic", "cluster.pipelines=2",
                           "pipeline.stages=2", NODES, "fault.slowdown_window=3"]))[0]
    watch = StragglerWatch(settings_of(cfg).fault, RunPlan.of(cfg))
    snaps, kinds = [summary_of(watch)], []
    for k in range(1, 40):
        for p in (0, 1):
            for s in (0, 1):
                slow = (p, s) == (1, 0) and 15 < k <= 25
                kinds += [line["kind"] for line in watch.lines(step(p, s, k, 0.4 if slow else 0.1))]
        if k in (10, 39):  # two snapshots: the slowdown came and went between them
            snaps += [summary_of(watch)] * 2
    assert kinds == ["straggler", "recovered"]
    for k in range(40, 60):
        for p in (0, 1):
            for s in (0, 1):
                watch.lines(step(p, s, k, 0.4 if (p, s) == (1, 0) else 0.1))
    snaps.append(summary_of(watch))
    watch.reset(1)  # pipeline 1 restarted after a failure: named once, never "recovered"
    snaps += [summary_of(watch)] * 2
    said = console_lines(snaps)
    assert [line.split(":")[0] for line in said] == ["slow device", "recovered", "slow device"]


def test_a_device_slow_before_a_re_split_is_said_once_while_its_share_wanders():
    """After a re-split in place the slow device holds less of the model: the compute its
    slowdown adds is about the share of the iteration that matters, and wanders around it as
    its neighbours' times do. It is said to be still slow once, not named and recovered by
    turns."""
    cfg = prepare(compose(["model=mlp", "data=synthetic", "cluster.pipelines=2",
                           "pipeline.stages=2", NODES, "+fault.slowed.p1s0=4.0"]))[0]
    watch = StragglerWatch(settings_of(cfg).fault, RunPlan.of(cfg))
    snaps = [summary_of(watch)]
    for k in range(1, 120):
        for p in (0, 1):
            for s in (0, 1):
                record = step(p, s, k, 0.02 if (p, s) == (1, 0) else 0.1)
                # its 15 ms more over an iteration of 140 ms, then of 160 ms, by turns
                record["step_s"] = 0.14 if (k // 6) % 2 else 0.16
                watch.lines(record)
        snaps.append(summary_of(watch))
    assert [line.split(":")[0] for line in console_lines(snaps)] == ["still slow"]


def test_the_summary_counts_rounds_per_unit_with_equal_neighbours_together():
    """Per-block units (a run that may re-plan in place) would be one item each: consecutive
    units whose replicas had the same rounds are one item."""
    from sdpipe_cli.cli.display import _runs_of

    assert _runs_of("stage", [[4, 3], [4, 3]]) == ["stage 0-1: [4, 3]"]
    assert _runs_of("segment", [[4, 3], [4, 3], [2, 3], [4, 3]]) == [
        "segment 0-1: [4, 3]", "segment 2: [2, 3]", "segment 3: [4, 3]"]
    assert _runs_of("stage", []) == []
