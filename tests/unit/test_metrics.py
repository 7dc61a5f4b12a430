"""RunTracker (pure, fake clock) and the metrics.jsonl log."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.runtime.metrics import MetricsLog, RunTracker, read_metrics, scalars


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def start(rank, pipeline, stage, time=0.0):
    return {"type": "start", "rank": rank, "pipeline": pipeline, "stage": stage, "time": time,
            "pid": 1000 + rank}


def step(rank, pipeline, stage, n, *, loss=None, batch=8, time=1.0, lr=1e-3):
    event = {"type": "step", "rank": rank, "pipeline": pipeline, "stage": stage, "time": time,
             "step": n, "samples": n * batch, "samples_per_s": n * batch / time, "lr": lr,
             "step_s": 0.1, "compute_s": 0.08, "sync_s": 0.02}
    if loss is not None:
        event["loss"] = loss
    return event


def evaluate(rank, pipeline, stage, n, val_loss, batch=8, time=2.0):
    return {"type": "eval", "rank": rank, "pipeline": pipeline, "stage": stage, "time": time,
            "step": n, "val_loss": val_loss, "samples": n * batch}


def done(rank, pipeline, stage, n, time=3.0):
    return {"type": "done", "rank": rank, "pipeline": pipeline, "stage": stage, "time": time,
            "steps": n, "samples": 4 * n, "param_digest": f"digest{rank}"}


@pytest.fixture
def clock():
    return FakeClock(100.0)


@pytest.fixture
def tracker(clock):
    # P = 2 pipelines, S = 2 stages: ranks 0, 1 are pipeline 0; 2, 3 pipeline 1; stage = rank % 2.
    return RunTracker(pipelines=2, stages=2, target_iterations=2 * 10, clock=clock,
                      heartbeat_timeout=30.0)


def test_world_size(tracker):
    assert tracker.world_size == 4


def test_start_produces_no_line(tracker):
    for rank in range(4):
        assert tracker.update(start(rank, rank // 2, rank % 2)) is None
    snap = tracker.snapshot()
    assert snap["started"] == 4
    assert snap["done"] == 0
    assert snap["iterations"] == 0
    assert snap["loss"] is None and snap["val_loss"] is None


def test_iterations_past_the_last_logged_one_count_from_the_done_lines(tracker):
    """train.log_every=3 over 8 iterations logs steps 3 and 6: the summary's count is the done
    lines' 8 a pipeline (it said 6, and 0 with log_every past the run), the loss the last logged."""
    for rank in range(4):
        tracker.update(start(rank, rank // 2, rank % 2))
    for n in (3, 6):
        for p in (0, 1):
            tracker.update(step(2 * p + 1, p, 1, n, loss=2.0 - n / 10))
    assert tracker.snapshot()["iterations"] == 12
    for rank in range(4):
        tracker.update(done(rank, rank // 2, rank % 2, 8))
    snap = tracker.snapshot()
    assert snap["iterations"] == 16 and snap["samples"] == 2 * 4 * 8
    assert snap["loss"] == pytest.approx(1.4)


def test_last_stage_step_produces_train_line(tracker):
    line = tracker.update(step(1, 0, 1, 3, loss=2.5, time=1.5, lr=2e-3))
    assert line["kind"] == "train"
    for key in ("step", "time", "pipeline", "loss", "samples", "samples_per_s", "lr"):
        assert key in line, key
    assert line["step"] == 3
    assert line["time"] == 1.5
    assert line["pipeline"] == 0
    assert line["loss"] == 2.5
    assert line["samples"] == 24
    assert line["samples_per_s"] == pytest.approx(24 / 1.5)
    assert line["lr"] == 2e-3
    assert {"step_s", "compute_s", "sync_s"} <= set(line)
    assert "type" not in line and "rank" not in line and "stage" not in line
    json.dumps(line)  # serializable


def test_step_without_loss_is_only_a_heartbeat(tracker, clock):
    tracker.update(start(0, 0, 0))
    clock.advance(25.0)
    assert tracker.update(step(0, 0, 0, 1)) is None  # non-last stage: no loss
    snap = tracker.snapshot()
    assert snap["iterations"] == 0
    assert snap["samples"] == 0
    clock.advance(25.0)  # 50 s after start, 25 s after the heartbeat
    assert tracker.silent_workers() == []
    clock.advance(6.0)
    assert tracker.silent_workers() == [0]


def test_eval_produces_eval_line(tracker):
    tracker.update(step(3, 1, 1, 5, loss=2.0))
    line = tracker.update(evaluate(3, 1, 1, 5, 1.75))
    assert line["kind"] == "eval"
    assert line["val_loss"] == 1.75
    assert line["step"] == 5
    assert line["pipeline"] == 1
    assert line["samples"] == 40
    assert "time" in line
    assert "type" not in line and "rank" not in line
    assert tracker.snapshot()["val_loss"] == 1.75
    assert tracker.snapshot()["pipelines"][1]["val_loss"] == 1.75
    assert tracker.snapshot()["val_accuracy"] is None  # not a classifier


def test_a_classifiers_accuracy_reaches_the_summary_and_tensorboard(tracker):
    for p, acc in ((0, 0.5), (1, 0.75)):
        line = tracker.update({**evaluate(p * 2 + 1, p, 1, 5, 1.0), "val_accuracy": acc})
        assert line["val_accuracy"] == acc
        assert (f"pipeline{p}/val_accuracy", acc, 5) in [(t, v, s) for t, v, s, _ in scalars(line)]
    assert tracker.snapshot()["val_accuracy"] == 0.625
    assert tracker.snapshot()["pipelines"][1]["val_accuracy"] == 0.75


def test_done_lines_and_all_done(tracker):
    for rank in range(4):
        tracker.update(start(rank, rank // 2, rank % 2))
    lines = []
    for rank in range(4):
        assert not tracker.all_done()
        lines.append(tracker.update(done(rank, rank // 2, rank % 2, 10)))
    assert tracker.all_done()
    for rank, line in enumerate(lines):
        assert line["kind"] == "done"
        assert line["pipeline"] == rank // 2
        assert line["stage"] == rank % 2
        assert line["steps"] == 10
        assert line["param_digest"] == f"digest{rank}"
        assert "type" not in line
    assert tracker.snapshot()["done"] == 4


def test_done_twice_from_one_rank_does_not_finish_run(tracker):
    tracker.update(done(0, 0, 0, 10))
    tracker.update(done(0, 0, 0, 10))
    assert not tracker.all_done()


def test_silent_workers_after_timeout(tracker, clock):
    for rank in range(4):
        tracker.update(start(rank, rank // 2, rank % 2))
    clock.advance(20.0)
    tracker.update(step(1, 0, 1, 1, loss=3.0))
    tracker.update(step(0, 0, 0, 1))
    assert tracker.silent_workers() == []
    clock.advance(10.0)  # 30 s: exactly the timeout is not yet silent
    assert tracker.silent_workers() == []
    clock.advance(0.5)
    assert tracker.silent_workers() == [2, 3]
    clock.advance(20.0)
    assert tracker.silent_workers() == [0, 1, 2, 3]
    tracker.update(step(2, 1, 0, 1))  # a heartbeat clears rank 2
    assert tracker.silent_workers() == [0, 1, 3]


def test_done_workers_are_never_silent(tracker, clock):
    for rank in range(4):
        tracker.update(start(rank, rank // 2, rank % 2))
    tracker.update(done(1, 0, 1, 10))
    tracker.update(done(3, 1, 1, 10))
    clock.advance(1000.0)
    assert tracker.silent_workers() == [0, 2]
    tracker.update(done(0, 0, 0, 10))
    tracker.update(done(2, 1, 0, 10))
    assert tracker.silent_workers() == []
    assert tracker.all_done()


def test_snapshot_totals(tracker):
    tracker.update(step(1, 0, 1, 4, loss=2.0, batch=8, time=2.0))
    tracker.update(step(3, 1, 1, 6, loss=3.0, batch=8, time=2.0))
    snap = tracker.snapshot()
    assert snap["iterations"] == 10  # summed over pipelines
    assert snap["target"] == 20
    assert snap["samples"] == 4 * 8 + 6 * 8
    assert snap["samples_per_s"] == pytest.approx(32 / 2.0 + 48 / 2.0)
    assert snap["loss"] == pytest.approx(2.5)  # mean over pipelines
    assert snap["val_loss"] is None
    assert snap["pipelines"][0]["steps"] == 4
    assert snap["pipelines"][1]["steps"] == 6
    assert snap["pipelines"][0]["loss"] == 2.0
    json.dumps(snap)

    # a later step replaces a pipeline's latest values
    tracker.update(step(1, 0, 1, 5, loss=1.0, batch=8, time=2.5))
    snap = tracker.snapshot()
    assert snap["iterations"] == 11
    assert snap["loss"] == pytest.approx(2.0)


def test_snapshot_loss_mean_ignores_pipelines_without_loss(tracker):
    tracker.update(step(1, 0, 1, 2, loss=4.0))
    assert tracker.snapshot()["loss"] == pytest.approx(4.0)


def test_tracker_folds_a_whole_run(clock):
    tracker = RunTracker(pipelines=1, stages=2, target_iterations=3, clock=clock,
                         heartbeat_timeout=5.0)
    lines = []
    for event in [start(0, 0, 0), start(1, 0, 1),
                  step(0, 0, 0, 1), step(1, 0, 1, 1, loss=3.0),
                  step(0, 0, 0, 2), step(1, 0, 1, 2, loss=2.5),
                  step(0, 0, 0, 3), step(1, 0, 1, 3, loss=2.0),
                  evaluate(1, 0, 1, 3, 2.2),
                  done(0, 0, 0, 3), done(1, 0, 1, 3)]:
        clock.advance(1.0)
        line = tracker.update(event)
        if line is not None:
            lines.append(line)
    assert [line["kind"] for line in lines] == ["train"] * 3 + ["eval", "done", "done"]
    assert [line["step"] for line in lines[:3]] == [1, 2, 3]
    assert tracker.all_done()
    assert tracker.snapshot()["iterations"] == tracker.target_iterations


# ---------------------------------------------------------------------------- MetricsLog


def test_metrics_log_round_trip(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"kind": "train", "step": 1, "time": 0.5, "pipeline": 0, "loss": 5.5, "samples": 8,
         "samples_per_s": 16.0, "lr": 0.001},
        {"kind": "eval", "step": 1, "time": 0.7, "pipeline": 0, "val_loss": 5.4, "samples": 8},
        {"kind": "done", "pipeline": 0, "stage": 1, "steps": 1, "param_digest": "abc"},
    ]
    log = MetricsLog(path)
    for line in lines:
        log.write(line)
        # flushed at once: readable before close
    assert read_metrics(path) == lines
    log.close()

    text = path.read_text()
    assert text.endswith("\n")
    raw = text.splitlines()
    assert len(raw) == 3
    assert [json.loads(r) for r in raw] == lines
    assert all(isinstance(json.loads(r), dict) for r in raw)


def test_metrics_log_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path)
    first.write({"kind": "train", "step": 1})
    first.close()
    second = MetricsLog(path)
    second.write({"kind": "train", "step": 2})
    second.close()
    assert [line["step"] for line in read_metrics(path)] == [1, 2]


def test_read_metrics_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n\n   \n{"kind": "done"}\n')
    assert read_metrics(path) == [{"kind": "train", "step": 1}, {"kind": "done"}]


def test_tracker_lines_through_log(tmp_path, clock):
    tracker = RunTracker(pipelines=1, stages=1, target_iterations=1, clock=clock)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for event in [start(0, 0, 0), step(0, 0, 0, 1, loss=1.5), evaluate(0, 0, 0, 1, 1.4),
                  done(0, 0, 0, 1)]:
        line = tracker.update(event)
        if line is not None:
            log.write(line)
    log.close()
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert [line["kind"] for line in back] == ["train", "eval", "done"]
    assert back[0]["loss"] == 1.5
    assert back[1]["val_loss"] == 1.4


def test_tensorboard_scalars_of_each_kind_of_line():
    from sdpipe_cli.runtime.metrics import scalars

    train = {"kind": "train", "pipeline": 1, "step": 7, "time": 3.5, "loss": 2.0, "lr": 1e-3,
             "group_kind": "group", "straggled": 0, "wait_s": 0.1}
    assert scalars(train) == [("pipeline1/loss", 2.0, 7, 3.5), ("pipeline1/lr", 1e-3, 7, 3.5),
                              ("pipeline1/wait_s", 0.1, 7, 3.5)]
    assert scalars({"kind": "group", "stage": 0, "round": 4, "size": 3, "max_wait_s": 0.2,
                    "time": 1.0}) == [("stage0/group_size", 3.0, 4, 1.0),
                                      ("stage0/max_wait_s", 0.2, 4, 1.0)]
    assert scalars({"kind": "consensus", "stage": 1, "round": 9, "consensus": 0.01}) == [
        ("stage1/consensus", 0.01, 9, None)]
    assert scalars({"kind": "sync", "pipeline": 0, "stage": 0, "step": 2, "time": 1.0,
                    "wait_s": 0.3}) == [("pipeline0/stage0/wait_s", 0.3, 2, 1.0)]
    assert scalars({"kind": "eval", "pipeline": 0, "step": 5, "time": 2.0, "val_loss": 1.5}) == [
        ("pipeline0/val_loss", 1.5, 5, 2.0)]
    assert scalars({"kind": "done", "pipeline": 0, "steps": 5}) == []
    assert scalars({**train, "loss": None}) == [("pipeline1/lr", 1e-3, 7, 3.5),
                                               ("pipeline1/wait_s", 0.1, 7, 3.5)]


def test_data_waits_and_unreadable_samples_are_summed_up():
    tracker = RunTracker(pipelines=1, stages=2, target_iterations=12)
    for n in range(1, 13):  # the first stage waits 10 ms of 100 after its first (loader start)
        first = step(0, 0, 0, n)
        first["data_s"] = 5.0 if n == 1 else 0.01
        assert tracker.update(first) == {"kind": "data", "step": n, "time": 1.0, "pipeline": 0,
                                         "stage": 0, "step_s": 0.1, "data_s": first["data_s"]}
        last = step(1, 0, 1, n, loss=2.0)
        last["data_s"] = 0.0
        assert tracker.update(last)["kind"] == "train"
    assert tracker.snapshot()["data_wait_share"] == pytest.approx(0.1)
    bad = {"type": "unreadable", "rank": 0, "pipeline": 0, "stage": 0, "time": 3.0, "step": 4,
           "sample": "/d/train/cat/x.jpg", "error": "truncated"}
    assert tracker.update(bad)["kind"] == "unreadable"
    tracker.update({**bad, "rank": 1, "stage": 1})  # the last stage met it too: one sample
    assert tracker.snapshot()["unreadable"] == ["/d/train/cat/x.jpg"]
    short = RunTracker(pipelines=1, stages=1, target_iterations=2)
    short.update({**step(0, 0, 0, 1, loss=1.0), "data_s": 0.05})
    short.update({**step(0, 0, 0, 2, loss=1.0), "data_s": 0.05})
    assert short.snapshot()["data_wait_share"] is None  # too short to judge


def test_a_diverged_loss_is_written_as_json_null(tmp_path):
    from sdpipe_cli.runtime.metrics import strict_json

    assert strict_json({"loss": float("nan"), "x": [1.0, float("inf")], "n": {"v": -float("inf")}}) == \
        '{"loss": null, "x": [1.0, null], "n": {"v": null}}'
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"kind": "train", "loss": float("nan")})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"kind": "train", "loss": None}
