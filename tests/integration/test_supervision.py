"""Supervision: a failing or killed child stops the whole run, is named, and leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from sdpipe_cli import checkpoint
from sdpipe_cli.cli import launcher, supervisor
from tests.helpers import (
    REPO,
    finish,
    free_port,
    interrupt_command,
    listening_only_on_loopback,
    metrics,
    run_processes,
    sdpipe_beside,
    sdpipe_popen,
    training_lines,
    wait_for,
    worker_process,
    worker_processes,
)
from tests.unit.test_failure_reports import fill, small_disk

pytestmark = pytest.mark.multiprocess

# runs that go on until they are stopped: modelled compute (sleeps), not two cores spinning
LONG = ("model=mlp", "data=synthetic", "train.steps=100000", "train.batch_size=8", "cluster.compute_ms=10")


def wait_for_training(run_dir: Path, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and metrics(run_dir, "train"):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    pytest.fail("training never started")


def worker_pid(run_dir: Path, rank: int) -> int:
    proc = worker_process(run_dir, rank)
    assert proc is not None, f"no worker rank {rank}"
    return proc.pid


# SIGTERM to the whole process group:
# test_resume.py::test_sigterm_to_the_process_group_stops_everything_at_a_consistent_point
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_ctrl_c_stops_everything(run_dir, sig):
    proc = sdpipe_popen("train", f"run.dir={run_dir}", *LONG)
    wait_for_training(run_dir, proc)
    # while it runs: the store (in the launcher) and gloo listen on 127.0.0.1 only
    children = listening_only_on_loopback(proc, run_dir)
    assert len(children) == 5  # scheduler + 4 workers
    proc.send_signal(sig)
    rc, err, took = finish(proc, timeout=60)
    assert rc == 130, err
    assert "interrupted" in err
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in children)
    assert not _forkservers_of(run_dir)  # gone with sdpipe (PR_SET_PDEATHSIG), not 1-3 s later


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_first_error_is_reported_and_the_rest_are_stopped(tmp_path, monkeypatch, spawn):
    """A child raising an exception: its error file names it; a long-running sibling is stopped.
    Children forked from the fork server and fresh interpreters (``SDPIPE_SPAWN=exec``) alike."""
    monkeypatch.setenv("SDPIPE_SPAWN", spawn)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    env = {**os.environ, "SDPIPE_RUN_DIR": str(run_dir), "PYTHONPATH": str(REPO)}
    sleeper = launcher.spawn("tests.children.sleeper", "0", "worker rank 0 (pipeline 0, stage 0)",
                             run_dir, {**env, "RANK": "0"})
    crash = launcher.spawn("tests.children.crash", "1", "worker rank 1 (pipeline 0, stage 1)",
                           run_dir, {**env, "RANK": "1"})
    children = [sleeper, crash]
    try:
        assert len(run_processes(run_dir)) == 2  # each child's pid is in logs/<name>.pid
        failure, interrupted, bad_input = supervisor.Supervisor(children, run_dir, _NoStore(),
                                                                lambda _: None).run()
    finally:
        supervisor.stop_all(children, grace=5)
    assert not interrupted and not bad_input
    assert failure.startswith("worker rank 1 (pipeline 0, stage 1) exited with code 1: "
                              "RuntimeError: deliberate failure on rank 1")
    assert sleeper.proc.returncode == -signal.SIGTERM
    assert "deliberate failure on rank 1" in (run_dir / "logs" / "1.log").read_text()  # its stderr
    assert not run_processes(run_dir)


class _NoStore:
    """The supervisor only reads the progress key; a run without a scheduler has none."""

    def check(self, keys):
        return False


def test_second_ctrl_c_stops_at_once(run_dir):
    """The launcher in this process (the first test's is a process of its own)."""
    def twice(command):
        command.wait_for(training_lines(run_dir), what="training")
        interrupt_command()
        interrupt_command()

    out, _ = sdpipe_beside(twice, run_dir, "train", f"run.dir={run_dir}", *LONG, timeout=60)
    assert out.returncode == 130 and "interrupted" in out.stderr, out.stderr
    assert not run_processes(run_dir)


def test_lost_pipeline_is_dropped_and_the_others_go_on(run_dir):
    """fault.on_pipeline_loss=continue (sync=sdpipe): all-reduce could not do this."""
    def kill_pipeline_2(command):
        command.wait_for(training_lines(run_dir), what="training")
        os.kill(worker_pid(run_dir, 4), signal.SIGKILL)  # pipeline 2, stage 0

    # the launcher in this process: what is tested is what it does, not its process
    out, _ = sdpipe_beside(kill_pipeline_2, run_dir, "train", f"run.dir={run_dir}", "model=mlp",
                           "data=synthetic", "cluster.pipelines=3", "train.steps=40",
                           "train.batch_size=8", "cluster.compute_ms=5", "train.eval_every=0",
                           "checkpoint.every=20", "checkpoint.keep=0",
                           "fault.on_pipeline_loss=continue",
                           "sync.group_timeout=3",  # a group with the dead replica gives up soon
                           timeout=180)
    rc, err = out.returncode, out.stderr
    assert rc == 0, err
    assert "pipeline 2 lost" in err and "worker rank 4 (pipeline 2, stage 0) was killed by SIGKILL" in err
    (lost,) = metrics(run_dir, "lost")
    assert lost["pipeline"] == 2
    done = [d for d in metrics(run_dir, "done") if "param_digest" in d]
    assert {d["pipeline"] for d in done} == {0, 1}
    for stage in (0, 1):  # the survivors still end on a global sync
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    groups = metrics(run_dir, "group")
    after = groups[[g["time"] for g in groups].index(max(g["time"] for g in groups)):]
    assert all(2 not in g["members"] for g in after)
    assert not run_processes(run_dir)
    # checkpoints after the loss are still complete: pipeline 2's shards stand in from a replica
    # that was identical at that global sync, at pipeline 2's own iteration count
    last = checkpoint.latest(run_dir)
    manifest = checkpoint.verify(last)
    assert manifest["stand_ins"] == [2] and len(manifest["files"]) == 3 * 2 + 1
    assert manifest["steps"]["2"] == checkpoint.load_shard(last, "4")["step"] < 40
    assert not list((run_dir / "checkpoints").glob(f"{checkpoint.STAGING_PREFIX}*"))


# Without a restart left a lost pipeline stops the run, its worker named in one line:
# test_restart_run.py::test_a_failure_past_the_budget_fails_the_run (and across two nodes:
# test_multinode.py::test_a_failure_on_one_node_stops_both)


def one_interrupt_line(err: str) -> str:
    """The launcher's whole report of an interrupt during start-up: one error line, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("sdpipe: error:")]
    assert len(lines) == 1, err
    return lines[0]


TWO_NODES = ("cluster.nodes=[{name: a, host: 127.0.0.1, devices: [{}, {}]},"
             " {name: b, host: 127.0.0.1, devices: [{}, {}]}]", "cluster.device=cpu",
             "model=mlp", "data=synthetic", "run.timeout=120")


def test_interrupt_while_loading_is_one_line(tmp_path):
    """A Ctrl-C a moment after the command starts (imports, composition, preparation). (SIGTERM
    at that moment: test_hostile.py's row "SIGTERM while starting".)"""
    run = tmp_path / "run"
    proc = sdpipe_popen("train", f"run.dir={run}", *LONG)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    rc, err, _ = finish(proc, timeout=60)
    assert rc == 130, err
    assert "interrupted while" in one_interrupt_line(err)
    assert not run_processes(run)


def test_interrupt_while_the_workers_join(run_dir):
    """Node a of two, alone: its workers wait in the rendezvous for node b's, which never come,
    so the launcher is held in start-up; the first Ctrl-C stops it at once. (The launcher in
    this process: by then it counts interrupts itself; one before that ends its process, in
    the test above.)"""
    def interrupt_in_the_rendezvous(command):
        command.wait_for(lambda: len(worker_processes(run_dir)) >= 2, timeout=60,
                         what="node a's workers")
        time.sleep(1.0)
        return interrupt_command()

    out, sent = sdpipe_beside(interrupt_in_the_rendezvous, run_dir, "train", f"run.dir={run_dir}",
                              *TWO_NODES, f"run.port={free_port()}", "run.node=a", timeout=90)
    assert out.returncode == 130, out.stderr
    assert "interrupted while waiting for the workers to join" in one_interrupt_line(out.stderr)
    assert time.monotonic() - sent < 20
    assert not run_processes(run_dir)
    assert (run_dir / "config.yaml").exists()  # what was written stays


def test_interrupt_while_waiting_for_the_first_node(tmp_path):
    port = free_port()
    proc = sdpipe_popen("train", f"run.dir={tmp_path / 'run'}", *TWO_NODES, f"run.port={port}",
                        "run.node=b")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    waiting = f"sdpipe: node b: waiting for the first node's store at 127.0.0.1:{port}"
    try:  # the join would wait run.timeout=120 s; interrupt it once it has begun
        wait_for(lambda: any(line.startswith(waiting) for line in list(lines)), proc,
                 timeout=120, what="the node's waiting line")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    took = time.monotonic() - start
    reader.join(10)
    err = "".join(lines)
    assert rc == 130, err
    assert f"waiting for the first node's store at 127.0.0.1:{port}" in one_interrupt_line(err)
    assert took < 10


def _forkservers_of(run_dir: Path) -> list[psutil.Process]:
    """The fork server (and resource tracker) started for this run: their environment names it."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if ("multiprocessing.forkserver" in line or "resource_tracker" in line) and \
                    proc.environ().get("SDPIPE_RUN_DIR") == str(run_dir.resolve()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_a_sigkilled_launcher_leaves_nothing_behind(run_dir):
    """SIGKILL gives the launcher no chance to stop anything: its children notice it is gone
    (within a second) and end, and with them the fork server and the resource tracker. Killed
    while the processes start (none has trained yet: before, they waited for the dead store
    for run.timeout, and the fork server with them; once training, losing the store ends them)."""
    proc = sdpipe_popen("train", f"run.dir={run_dir}", "model=mlp", "data=synthetic",
                        "train.steps=100000", "cluster.compute_ms=20")
    try:
        wait_for(lambda: (run_dir / "logs" / "scheduler.pid").exists(), proc, what="the scheduler")
        assert run_processes(run_dir)
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    while (run_processes(run_dir) or _forkservers_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run_processes(run_dir) and not _forkservers_of(run_dir)


def test_a_run_whose_disk_fills_up_ends_in_one_line_naming_the_file_and_the_resume(tmp_path):
    """A tiny run on a small file system that fills up after its first checkpoint: whichever
    file could not be written next (a shard, metrics.jsonl, the scheduler's journal), the run
    ends with one line naming it, the full disk and the checkpoint to resume from, and the
    summary is written, or the console says why not."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        run_dir = disk / "run"

        def fill_after_a_checkpoint(command):
            command.wait_for(lambda: (run_dir / "metrics.jsonl").exists()
                             and metrics(run_dir, "checkpoint"), what="a checkpoint")
            fill(disk)

        # the launcher in this process (its own writes fail there as in a process of its own)
        out, _ = sdpipe_beside(fill_after_a_checkpoint, run_dir, "train", f"run.dir={run_dir}",
                               *LONG, "sync.global_every=5", "checkpoint.every=5",
                               "checkpoint.keep=1", "train.eval_every=0", "fault.on_slowdown=off",
                               timeout=180)
        rc, err = out.returncode, out.stderr
        (line,) = [ln for ln in err.splitlines() if ln.startswith("sdpipe: error:")]
        assert rc == 1 and re.search(rf"{re.escape(str(run_dir))}/\S+: cannot be written: the "
                                     r"disk is full \(No space left on device\)", line), err
        latest = checkpoint.latest(run_dir)
        assert f"the latest complete checkpoint is {latest}: sdpipe resume {run_dir}" in line
        summary = run_dir / "summary.json"
        if summary.exists():
            assert "the disk is full" in json.loads(summary.read_text())["failure"]
        else:
            assert "the run's summary is not written" in err and "disk is full" in err, err
        assert not run_processes(run_dir)
