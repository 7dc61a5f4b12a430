"""Checkpoints and ``sdpipe resume`` end to end: exact continuation, group sync, refusals."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import metrics, run_processes, sdpipe

pytestmark = pytest.mark.multiprocess

ALLREDUCE = ("sync=allreduce", "model=mlp", "data=synthetic", "train.steps=20", "train.batch_size=8",
             "checkpoint.every=10", "train.eval_every=0")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An all-reduce run of 20 steps with checkpoints at steps 10 and 20."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", *ALLREDUCE)
    assert out.returncode == 0, out.stderr
    assert not run_processes(run_dir)
    return run_dir


def _losses(lines) -> dict[tuple[int, int], float]:
    return {(m["pipeline"], m["step"]): m["loss"] for m in lines if m["kind"] == "train"}


def test_checkpoints_are_complete_and_pruned(finished_run):
    ckpts = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    assert ckpts == ["step_10", "step_20"]
    files = {p.name for p in (finished_run / "checkpoints" / "step_10").iterdir()}
    assert files == {"0.pt", "1.pt", "2.pt", "3.pt", "scheduler.pt", "manifest.json"}
    assert [m["step"] for m in metrics(finished_run, "checkpoint")] == [10, 20]


def test_allreduce_resume_reproduces_the_losses_exactly(finished_run, tmp_path):
    """Stopped at step 10 and resumed, the run gives the same losses as the one never stopped."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_20")  # as if the run had stopped after step 10
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy))
    assert out.returncode == 0, out.stderr
    assert "step_10" in out.stderr
    resumed = metrics(copy)[before:]
    reference = _losses(metrics(finished_run))
    continued = _losses(resumed)
    assert sorted(continued) == [(p, k) for p in (0, 1) for k in range(11, 21)]
    assert all(continued[key] == reference[key] for key in continued)  # bit-exact
    assert (copy / "config.yaml").read_text() == (finished_run / "config.yaml").read_text()
    assert list(copy.glob("config.resume-step_10*.yaml"))
    assert not run_processes(copy)


def test_sdpipe_resume_goes_on_from_a_global_sync(tmp_path):
    run_dir = tmp_path / "run"
    common = ("model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
              "train.eval_every=0", "sync.global_every=10")
    out = sdpipe("train", f"run.dir={run_dir}", "train.steps=30", "checkpoint.every=10", *common)
    assert out.returncode == 0, out.stderr
    saved = metrics(run_dir, "checkpoint")
    first = saved[0]
    for later in saved[1:]:
        shutil.rmtree(later["path"])
    before = len(metrics(run_dir))
    out = sdpipe("resume", str(run_dir))
    assert out.returncode == 0, out.stderr
    done = [d for d in metrics(run_dir)[before:] if d["kind"] == "done"]
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 3 * 30  # the budget still holds
    assert all(d["steps"] >= first["steps"][str(d["pipeline"])] for d in done)
    for stage in (0, 1):  # and the run still ends on a global sync
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1


@pytest.mark.parametrize("case, args, key", [
    ("missing path", ("{missing}",), "does not exist"),
    ("unsafe override", ("{run}", "model.n_layers=2"), "model.n_layers: cannot change"),
    ("unsafe override (sync)", ("{run}", "sync.name=none"), "sync.name: cannot change"),
    ("not key=value", ("{run}", "train.steps"), "train.steps"),
    ("wrong type", ("{run}", "train.steps=many"), "train.steps"),
])
def test_bad_resume_input_is_one_line_and_starts_nothing(finished_run, tmp_path, case, args, key):
    before = (finished_run / "metrics.jsonl").read_bytes()
    argv = [a.format(run=finished_run, missing=tmp_path / "nope") for a in args]
    out = sdpipe("resume", *argv, timeout=60)
    assert out.returncode == 2, (case, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: ") and key in lines[0], lines
    assert (finished_run / "metrics.jsonl").read_bytes() == before  # nothing written


def test_corrupted_or_truncated_checkpoint_is_refused(finished_run, tmp_path):
    for damage in ("truncate", "flip"):
        copy = tmp_path / damage
        shutil.copytree(finished_run, copy)
        shard = copy / "checkpoints" / "step_20" / "1.pt"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2] if damage == "truncate"
                          else data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
        out = sdpipe("resume", str(copy / "checkpoints" / "step_20"), timeout=60)
        assert out.returncode == 2, out.stderr
        assert "1.pt" in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_run_without_checkpoints_is_refused(tmp_path):
    (tmp_path / "empty-run").mkdir()
    out = sdpipe("resume", str(tmp_path / "empty-run"), timeout=60)
    assert out.returncode == 2 and "no complete checkpoint" in out.stderr, out.stderr


def _interrupt_when_training(run_dir, *args):
    import signal
    import time

    from tests.helpers import sdpipe_popen
    proc = sdpipe_popen("train", f"run.dir={run_dir}", *args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir, "train")) >= 6:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=90)
    except Exception:
        proc.kill()
        raise
    return proc.returncode, err


@pytest.mark.parametrize("sync", ["allreduce", "sdpipe"])
def test_ctrl_c_stops_at_a_consistent_point_with_a_final_checkpoint(tmp_path, sync):
    run_dir = tmp_path / "run"
    rc, err = _interrupt_when_training(run_dir, f"sync={sync}", "model=mlp", "data=synthetic",
                                       "train.steps=100000", "train.batch_size=8",
                                       "checkpoint.on_exit=true")
    assert rc == 130, err
    assert "stopped at a consistent point" in err
    done = metrics(run_dir, "done")
    assert len(done) == 4
    for stage in (0, 1):  # every replica of a stage ends identical (all-reduce or last global)
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    (saved,) = metrics(run_dir, "checkpoint")
    per_pipeline = {int(p): k for p, k in saved["steps"].items()}
    assert per_pipeline == {d["pipeline"]: d["steps"] for d in done}
    assert not run_processes(run_dir)
    out = sdpipe("resume", str(run_dir), f"train.steps={saved['step'] + 3}")
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("sync", ["allreduce", "sdpipe"])
def test_time_based_checkpoints(tmp_path, sync):
    run_dir = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run_dir}", f"sync={sync}", "model=mlp", "data=synthetic",
                 "train.steps=40", "train.batch_size=8", "train.eval_every=0",
                 "sync.global_every=5", "checkpoint.every_minutes=0.01", "checkpoint.keep=0",
                 "checkpoint.on_exit=true")
    assert out.returncode == 0, out.stderr
    saved = metrics(run_dir, "checkpoint")
    assert len(saved) >= 2  # 0.6 s apart on a run of several seconds, plus the one at the end
    steps = [c["step"] for c in saved]
    assert steps == sorted(set(steps))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        f"step_{k}" for k in steps)


def test_after_a_sigkill_the_last_checkpoint_resumes(tmp_path):
    import os
    import signal
    import time

    from tests.helpers import sdpipe_popen
    run_dir = tmp_path / "run"
    proc = sdpipe_popen("train", f"run.dir={run_dir}", "sync=allreduce", "model=mlp",
                        "data=synthetic", "train.steps=100000", "train.batch_size=8",
                        "checkpoint.every=5", "train.eval_every=0")
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir, "checkpoint")) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    worker = next(p for p in run_processes(run_dir) if "sdpipe_cli.training.worker" in " ".join(p.cmdline()))
    os.kill(worker.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "SIGKILL" in err
    assert not run_processes(run_dir)
    last = metrics(run_dir, "checkpoint")[-1]
    out = sdpipe("resume", str(run_dir), f"train.steps={last['step'] + 5}")
    assert out.returncode == 0, out.stderr
    assert f"step_{last['step']}" in out.stderr
    done = metrics(run_dir, "done")
    assert {d["steps"] for d in done} == {last["step"] + 5}
