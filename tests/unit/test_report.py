"""What `sdpipe report` reads from a run folder and how it labels runs (no matplotlib needed)."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.cli import report
from sdpipe_cli.config.schema import ConfigError


def write_run(folder, config: str, lines: list[dict], torn: str = ""):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + torn)
    return folder


SDPIPE = "sync:\n  name: sdpipe\n  window_ms: 5.0\ntrain:\n  lr: 0.001\nrun:\n  dir: /a\n"
ALLREDUCE = "sync:\n  name: allreduce\ntrain:\n  lr: 0.001\nrun:\n  dir: /b\n"


def train(p, step, t, loss, step_s=1.0):
    return {"kind": "train", "pipeline": p, "step": step, "time": t, "samples": step * 8,
            "samples_per_s": 100.0, "loss": loss, "sync_s": 0.01, "step_s": step_s}


def test_runs_are_labelled_by_what_differs_and_not_by_what_follows_from_it(tmp_path):
    a = report.load(write_run(tmp_path / "a", SDPIPE, []))
    b = report.load(write_run(tmp_path / "b", ALLREDUCE, []))
    assert report.labels([a, b]) == ["sync.name=sdpipe", "sync.name=allreduce"]  # not window_ms, run.dir
    assert report.labels([a]) == ["a"]


def test_runs_that_differ_only_in_a_mode_setting_are_told_apart_by_it(tmp_path):
    """The convergence benchmark's overlay: all-reduce, sdpipe, sdpipe with the plain mean and the
    paper's rule; sync.stale and sync.average exist for sdpipe only, and name its variants."""
    def sdpipe(average, stale):
        return SDPIPE.replace("  window_ms: 5.0\n", f"  average: {average}\n  stale: {stale}\n")

    runs = [report.load(write_run(tmp_path / name, config, [])) for name, config in (
        ("ar", ALLREDUCE), ("pull", sdpipe("weights_grads", "pull")),
        ("mean", sdpipe("weights_grads", "average")), ("paper", sdpipe("weights", "average")))]
    assert report.labels(runs) == [
        "sync.name=allreduce", "sync.name=sdpipe sync.average=weights_grads sync.stale=pull",
        "sync.name=sdpipe sync.average=weights_grads sync.stale=average",
        "sync.name=sdpipe sync.average=weights sync.stale=average"]
    assert len(set(report.labels(runs[:2] + runs[1:2]))) == 2  # identical settings stay identical


def test_loss_is_compared_at_equal_time_across_pipelines_of_different_speeds(tmp_path):
    lines = [train(0, 1, 1.0, 5.0), train(0, 2, 2.0, 4.0), train(1, 1, 2.5, 5.2),
             train(0, 3, 3.0, 3.0), {"kind": "eval", "pipeline": 0, "step": 3, "time": 3.1,
                                     "val_loss": 3.5, "samples": 24}]
    run = report.load(write_run(tmp_path / "r", SDPIPE, lines))
    times, samples, loss = report.mean_loss(run)
    assert times == [1.0, 2.0, 2.5, 3.0]
    assert samples == [8, 16, 24, 32]  # every pipeline's latest count, summed
    assert loss == [5.0, 4.0, pytest.approx(4.6), pytest.approx(4.1)]
    assert report.validation(run) == ([3.1], [32], [3.5])


def test_runs_of_equal_iterations_take_equal_time_whatever_their_start_up(tmp_path):
    """Two runs of the same 3 iterations of 0.5 s: the first of a sweep spent 2.5 s more
    starting (the fork server). From their first iteration on, their clocks agree."""
    def lines(startup):
        return [{"kind": "group", "stage": 0, "round": 1, "time": startup + 0.4, "size": 2}] + [
            train(0, k, startup + 0.5 * k, 5.0 - k, step_s=0.5) for k in (1, 2, 3)] + [
            {"kind": "eval", "pipeline": 0, "step": 3, "time": startup + 1.6, "val_loss": 2.0}]
    slow = report.load(write_run(tmp_path / "first", SDPIPE, lines(2.87)))
    fast = report.load(write_run(tmp_path / "second", SDPIPE, lines(0.38)))
    assert report.mean_loss(slow)[0] == pytest.approx([0.5, 1.0, 1.5])
    assert report.mean_loss(fast)[0] == pytest.approx(report.mean_loss(slow)[0])
    assert report.validation(fast)[0] == pytest.approx(report.validation(slow)[0]) == [1.6]
    assert slow.kind("group")[0]["time"] == pytest.approx(0.4)


def test_a_resume_of_an_older_checkpoint_is_a_timeline_of_its_own(tmp_path):
    """A finished run (steps 1-10 at 1 s each) resumed from its step_4 checkpoint (taken at
    4.05 s): the new leg goes back to iteration 4. The report keeps the first run whole and draws
    the second from its past (up to 4.05 s) on; a resume that does not go back (after a stop)
    splits nothing."""
    first = [train(0, k, float(k), 10.0 - k) for k in range(1, 11)]
    again = [{"kind": "resume", "time": 6.5, "checkpoint": "step_4", "steps": {"0": 4},
              "at": 4.05}] + [
        train(0, k, k + 2.6, 10.0 - k - 0.5) for k in range(5, 11)]
    run = report.load(write_run(tmp_path / "r", SDPIPE, first + again))
    run.label = "r"
    old, new = report.timelines(run)
    assert old.label == "r" and new.label == "r (resumed from step_4)"
    assert [m["step"] for m in old.kind("train")] == list(range(1, 11))
    assert [m["step"] for m in new.kind("train")] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert report.mean_loss(new)[2][-1] == pytest.approx(-0.5)  # the new leg's, not the old's
    stopped = report.load(write_run(tmp_path / "s", SDPIPE, first + [
        {"kind": "resume", "time": 13.5, "checkpoint": "step_10", "steps": {"0": 10}, "at": 10.2}]))
    assert len(report.timelines(stopped)) == 1


def test_a_run_still_being_written_is_read_up_to_its_torn_line(tmp_path):
    run = report.load(write_run(tmp_path / "r", SDPIPE, [train(0, 1, 1.0, 5.0)], torn='{"kind": "tr'))
    assert len(run.lines) == 1


def test_consensus_is_timed_by_its_rounds_group_line(tmp_path):
    lines = [{"kind": "group", "stage": 0, "round": 7, "time": 4.2, "size": 2},
             {"kind": "consensus", "stage": 0, "round": 7, "consensus": 0.01}]
    run = report.load(write_run(tmp_path / "r", SDPIPE, lines))
    assert report.consensus(run) == {0: ([4.2], [0.01])}


def test_waits_split_for_sdpipe_and_whole_for_the_others(tmp_path):
    sd = report.load(write_run(tmp_path / "s", SDPIPE, [{**train(0, 1, 1.0, 5.0), "wait_s": 0.2,
                                                         "comm_s": 0.01}]))
    ar = report.load(write_run(tmp_path / "a", ALLREDUCE, [train(0, 1, 1.0, 5.0)]))
    assert report.sync_times(sd) == {"wait for the group": [0.2], "group all-reduce": [0.01]}
    assert report.sync_times(ar) == {"sync": [0.01]}


def test_what_is_not_a_run_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        report.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a run folder"):
        report.load(tmp_path / "empty")


def _paced(pipeline_seconds: list[float], steps: int = 10) -> list[dict]:
    """Train lines of pipelines each ``pipeline_seconds[p]`` per step, ``steps`` steps from 0."""
    return [{"kind": "train", "pipeline": p, "step": k, "time": k * s, "samples": k * 8}
            for p, s in enumerate(pipeline_seconds) for k in range(steps + 1)]


def test_tolerance_is_each_modes_fraction_of_its_slowdowns_limit(tmp_path):
    """A sweep over heterogeneity: each run is judged against the ``none`` run of its slowdowns
    and seed (the solo rates summed), against the slowest pipeline's slowdown; a run without a
    ``none`` beside it is left out, and one slowdown alone draws nothing."""
    def config(sync, slowdown, seed=0):
        return (f"sync:\n  name: {sync}\ntrain:\n  seed: {seed}\ncluster:\n"
                f"  slowdown: {slowdown}\nrun:\n  dir: /x\n")

    runs = [report.load(write_run(tmp_path / name, config(sync, slowdown, seed), lines))
            for name, sync, slowdown, seed, lines in (
                ("n-eq", "none", "[1, 1]", 0, _paced([1, 1])),  # limit 16 samples/s
                ("s-eq", "sdpipe", "[1, 1]", 0, _paced([1.25, 1.25])),  # 12.8: 0.8
                ("n-2", "none", "[1, 2]", 0, _paced([1, 2])),  # limit 8 + 4
                ("s-2", "sdpipe", "[1, 2]", 0, _paced([1, 2], 5)),  # 80 samples in 10 s
                ("a-2", "allreduce", "[1, 2]", 0, _paced([2, 2], 5)),  # 8 samples/s: 2/3
                ("a-3", "allreduce", "[1, 3]", 0, _paced([3, 3], 5)))]  # no none: left out
    got = report.tolerance(runs)
    assert set(got) == {"sdpipe", "allreduce"}
    assert got["sdpipe"] == [(1.0, pytest.approx(0.8)), (2.0, pytest.approx(80 / 10 / 12))]
    assert got["allreduce"] == [(2.0, pytest.approx(8 / 12))]
    assert report.tolerance(runs[:2]) == {}  # one slowdown: no figure


def test_rounds_are_counted_by_why_they_closed_in_the_policys_order(tmp_path):
    group = {"kind": "group", "stage": 0, "round": 1, "size": 2, "time": 1.0}
    lines = [{**group, "reason": r} for r in ("late", "all", "all", "stop", "expected")]
    run = report.load(write_run(tmp_path / "r", SDPIPE, lines + [group]))  # an older line: none
    assert report.reasons(run) == {"all": 2, "expected": 1, "late": 1, "stop": 1}
    outside = [{**group, "reason": "late", "outside": {"1": "late", "3": "busy"},
                "inside": {"0": "ready", "2": "opened"}},
               {**group, "reason": "cap", "outside": {"2": "capped", "3": "busy"},
                "inside": {"0": "opened", "1": "expected"}}]
    run = report.load(write_run(tmp_path / "o", SDPIPE, outside))
    assert list(report.reasons(run).items()) == [
        ("late", 1), ("cap", 1), ("in: opened", 2), ("in: expected", 1), ("in: ready", 1),
        ("out: late", 1), ("out: capped", 1), ("out: busy", 2)]


def test_the_models_layout_in_the_plan_is_no_label(tmp_path):
    """A sweep over the batch size: the plan's layout (each boundary's shape) differs as well, and
    sorts first, but follows from the settings that are shown."""
    def config(batch, shape):
        return (f"train:\n  batch_size: {batch}\nplan:\n  microbatch_size: {batch // 4}\n  layout:\n"
                f"    microbatch_size: {batch // 4}\n    outputs:\n    - '{shape}'\nrun:\n  dir: /a\n")

    runs = [report.load(write_run(tmp_path / str(b), config(b, f"[{b // 4},64]"), [])) for b in (8, 16)]
    assert report.labels(runs) == ["plan.microbatch_size=2 train.batch_size=8",
                                   "plan.microbatch_size=4 train.batch_size=16"]
