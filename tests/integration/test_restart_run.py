"""``fault.on_failure=restart``: a lock-step run whose worker is killed starts again from its latest
checkpoint, in its own run folder, and goes on as if nothing had happened; past the budget the
failure ends the run as a run without fault tolerance ends: within seconds, the worker named in
one line. (The suite's SIGKILLed worker of a lock-step run, and the checkpoint such a run leaves
resumed: the restart is that resume.)

The worker is killed from a thread of this process while ``sdpipe`` runs in it (``helpers.sdpipe``
bounds the run), once the run has a checkpoint and has gone past it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import losses, metrics, run_processes, sdpipe, worker_process

pytestmark = pytest.mark.multiprocess

# P = S = 2, 12 iterations of about 0.3 s (modelled compute), checkpoints at 4, 8 and 12.
RUN = ("sync=allreduce", "model=mlp", "data=synthetic", "train.steps=12", "train.batch_size=8",
       "train.eval_every=0", "checkpoint.every=4", "cluster.compute_ms=20",
       "fault.on_failure=restart", "fault.restart_backoff=0.1")


class Killer(threading.Thread):
    """SIGKILLs worker ``rank`` of the run in ``run_dir`` once it has a checkpoint and pipeline 0
    has logged iteration ``after``; gives up after ``timeout`` seconds."""

    def __init__(self, run_dir: Path, rank: int = 1, after: int = 6, timeout: float = 60):
        super().__init__(daemon=True)
        self.run_dir, self.rank, self.after, self.timeout = run_dir, rank, after, timeout
        self.killed: int | None = None
        self.killed_at: float | None = None  # time.monotonic() of the kill

    def ready(self) -> bool:
        if not (self.run_dir / "metrics.jsonl").exists():
            return False
        lines = metrics(self.run_dir)
        return (any(m["kind"] == "checkpoint" for m in lines)
                and any(m["kind"] == "train" and m["pipeline"] == 0 and m["step"] >= self.after
                        for m in lines))

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.ready():
                victim = worker_process(self.run_dir, self.rank)
                if victim is not None:
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed, self.killed_at = victim.pid, time.monotonic()
                return
            time.sleep(0.05)


def train_killed_once(run_dir: Path, *extra: str):
    """The run, its worker killed once: (its output, seconds from the kill to its end)."""
    killer = Killer(run_dir)
    killer.start()
    out = sdpipe("train", f"run.dir={run_dir}", *RUN, *extra, timeout=120)
    ended = time.monotonic()
    killer.join(10)
    assert killer.killed, f"the worker was never killed: {out.stderr[-2000:]}"
    return out, ended - killer.killed_at


def test_a_killed_worker_restarts_the_run_from_its_checkpoint_with_the_same_losses(run_dir, tmp_path):
    out, _ = train_killed_once(run_dir, "train.time_limit=600")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("sdpipe: warning:")]
    assert len(warnings) == 1, out.stderr
    assert "worker rank 1 (pipeline 0, stage 1) was killed by SIGKILL" in warnings[0]
    assert "(restart 1 of 3, in 0.1 s)" in warnings[0]
    assert "after 1 restart" in out.stderr  # the summary says so
    lines = metrics(run_dir)
    (at,) = [i for i, m in enumerate(lines) if m["kind"] == "restart"]
    restart = lines[at]
    step = restart["from_checkpoint"]
    assert step in (4, 8) and f"restarting from checkpoints/step_{step} " in warnings[0]
    assert restart["restart"] == 1 and restart["backoff_s"] == 0.1
    assert restart["reason"] in warnings[0]
    reached = {p: max(m["step"] for m in lines[:at] if m["kind"] == "train" and m["pipeline"] == p)
               for p in (0, 1)}
    assert set(restart["redone"]) == {"0", "1"}
    for p in (0, 1):  # the snapshot the launcher last saw may lag the metrics by a moment
        assert 0 <= restart["redone"][str(p)] <= reached[p] - step
    assert restart["time"] >= max(m["time"] for m in lines[:at] if "time" in m)
    # the time limit counts across the legs: the next has what the first left of it
    assert abs((600 - restart["time_left"]) - restart["time"]) < 1.0
    # the run goes on from the checkpoint: every later iteration once, in the same folder
    after = losses(lines[at + 1:])
    assert sorted(after) == [(p, k) for p in (0, 1) for k in range(step + 1, 13)]
    assert len(list(run_dir.glob(f"config.resume-step_{step}*.yaml"))) == 1
    assert not run_processes(run_dir)

    reference = tmp_path / "reference"  # the same run, never interrupted
    clean = sdpipe("train", f"run.dir={reference}", *RUN, timeout=120)
    assert clean.returncode == 0, clean.stderr
    expected = losses(metrics(reference))
    assert after == {key: expected[key] for key in after}  # bit-exact, as a resumed run is


def test_a_failure_past_the_budget_fails_the_run(run_dir):
    """With no restart left (as without fault tolerance) the SIGKILLed worker stops the whole run
    within seconds, named in one error line, no traceback, no process left."""
    out, took = train_killed_once(run_dir, "fault.max_restarts=0")
    assert out.returncode == 1, out.stderr
    assert took < 30, took
    errors = [line for line in out.stderr.splitlines() if line.startswith("sdpipe: error:")]
    assert len(errors) == 1, out.stderr
    assert "worker rank 1 (pipeline 0, stage 1) was killed by SIGKILL" in errors[0]
    assert errors[0].endswith("(restarts used up: fault.max_restarts=0)")
    assert "sdpipe: warning:" not in out.stderr
    assert "Traceback" not in out.stderr
    assert not metrics(run_dir, "restart")
    assert not run_processes(run_dir)
    assert metrics(run_dir, "checkpoint")  # killed after a checkpoint: the restart test resumes one
