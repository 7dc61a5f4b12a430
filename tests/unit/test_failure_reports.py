"""What the launcher says about a child that failed without a word: on a full disk, why."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdpipe_cli import checkpoint
from sdpipe_cli.cli import supervisor
from sdpipe_cli.runtime.errors import WriteFailed, read_error, record
from sdpipe_cli.runtime.metrics import MetricsLog, write_summary


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "256k"):
    """A tmpfs of ``size`` at ``folder`` (the machines this runs on let root mount), unmounted
    at the end."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Fill the disk holding ``folder`` to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs filled to the last byte."""
    with small_disk(tmp_path / "small") as mount:
        (mount / "logs").mkdir()
        (mount / "logs" / "scheduler.log").write_text("")
        fill(mount)
        yield mount


def _exited_silently(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait(30)
    return supervisor.Child("scheduler", "scheduler", proc, run_dir / "logs" / "scheduler.log")


def test_a_child_that_failed_silently_on_a_full_disk_is_said_to_have(full_disk):
    line = supervisor.describe_failure(_exited_silently(full_disk), full_disk)
    assert line.startswith("scheduler exited with code 1: the disk holding ")
    assert "is full" in line and "no checkpoint is complete yet" in line and "no output" in line


def test_elsewhere_it_says_only_what_the_log_says(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "scheduler.log").write_text("")
    line = supervisor.describe_failure(_exited_silently(tmp_path), tmp_path)
    assert line.startswith("scheduler exited with code 1: no output") and "full" not in line


def test_a_failure_after_the_launcher_was_stopped_says_so_first():
    now = [0.0]
    pauses = supervisor.Pauses(clock=lambda: now[0])
    for step in (0.1, 0.2, 1.5, 0.1):  # polls, one slow
        now[0] += step
        pauses.tick()
    assert pauses.explain("worker rank 3 failed: gloo timeout") == "worker rank 3 failed: gloo timeout"
    now[0] += 95.0  # SIGSTOP, then SIGCONT
    pauses.tick()
    said = pauses.explain("worker rank 3 failed: gloo timeout")
    assert said.startswith("the launcher itself was stopped for 95 s") and said.endswith(
        "then: worker rank 3 failed: gloo timeout")


def test_every_file_a_run_writes_on_a_full_disk_names_itself_the_full_disk_and_the_resume(
        tmp_path):
    """A real full disk, under a run folder with one complete checkpoint: a checkpoint shard
    (torch's own error about its zip file, the disk's beneath it), a metrics line and the
    summary each fail with one line naming the file, that the disk is full, and the checkpoint
    to resume from; the summary is whole or not there."""
    with small_disk(tmp_path / "run", "512k") as run:
        done = checkpoint.staging_dir(run, 10)
        for name in ("0", "scheduler"):
            checkpoint.save_shard(done, name, {"step": 10})
        ten = checkpoint.finalize(run, 10, {}, ["0", "scheduler"])
        metrics = MetricsLog(run / "metrics.jsonl")
        fill(run)
        resume = f"the latest complete checkpoint is {ten}: sdpipe resume {run}"
        shard = checkpoint.staging_dir(run, 20) / "0.pt"
        with pytest.raises(checkpoint.SaveFailed) as failed:
            checkpoint.save_shard(shard.parent, "0", {"model": torch.zeros(50_000)})
        assert str(failed.value) == (f"{shard}: cannot be written: the disk is full (No space "
                                     f"left on device); free space")
        assert checkpoint.go_on_from(failed.value.run_dir) == resume  # what its reporter adds
        with pytest.raises(WriteFailed) as failed:
            metrics.write({"kind": "train", "step": 11, "loss": 1.0})
        metrics.close(failed=True)
        assert str(failed.value).startswith(f"{run / 'metrics.jsonl'}: cannot be written: the "
                                            "disk is full") and failed.value.run_dir == run
        with pytest.raises(WriteFailed, match="summary.json: cannot be written: the disk is full"):
            write_summary(run, {"iterations": 11, "failure": "x" * 10_000})
        assert not list(run.glob("*summary*"))
        (run / "filler").unlink()
        write_summary(run, {"iterations": 11})
        assert json.loads((run / "summary.json").read_text()) == {"iterations": 11}


def test_a_process_that_fails_as_the_disk_fills_still_leaves_its_error_file(tmp_path):
    """The disk fills up while a child runs, and its failure is that: the room it kept for its
    error file at its start is given up to write it, so the launcher names the file that could
    not be written rather than a full disk somewhere."""
    with small_disk(tmp_path / "run") as run:
        with pytest.raises(WriteFailed):
            with record(run, "3", rank=3):
                fill(run)
                raise WriteFailed(run / "metrics.jsonl", OSError(28, "No space left on device"),
                                  run)
        said = read_error(run, "3")
        assert said["message"].startswith(f"WriteFailed: {run / 'metrics.jsonl'}: cannot be "
                                          "written: the disk is full") and said["rank"] == 3
        assert not list((run / "logs").glob(".*reserve"))
