"""What the launcher says about a child that failed without a word: on a full disk, why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdpipe_cli.cli import supervisor


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs filled to the last byte (the machines this runs on let root mount)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        (mount / "logs").mkdir()
        (mount / "logs" / "scheduler.log").write_text("")
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _exited_silently(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait(30)
    return supervisor.Child("scheduler", "scheduler", proc, run_dir / "logs" / "scheduler.log")


def test_a_child_that_failed_silently_on_a_full_disk_is_said_to_have(full_disk):
    line = supervisor.describe_failure(_exited_silently(full_disk), full_disk)
    assert line.startswith("scheduler exited with code 1: the disk holding ")
    assert "is full" in line and "resume from the latest checkpoint" in line and "no output" in line


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
