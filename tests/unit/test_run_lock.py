"""One launcher at a time in a run folder (sdpipe_cli.runtime.run_lock), with real processes
holding real locks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from sdpipe_cli.runtime import run_lock

HOLD = """
import sys, time
from pathlib import Path
from sdpipe_cli.runtime import run_lock
holder = run_lock.Holder()
holder.take(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def other_launcher(tmp_path):
    """Another process holding the lock of ``tmp_path``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_folder_held_by_another_process_is_refused_naming_it(tmp_path, other_launcher):
    with pytest.raises(run_lock.RunInUse) as refused:
        run_lock.Holder().take(tmp_path)
    assert f"pid {other_launcher.pid} on {socket.gethostname()}" in str(refused.value)
    assert refused.value.key == str(tmp_path)


def test_the_lock_of_a_killed_owner_is_taken_over_with_a_warning(tmp_path, other_launcher):
    other_launcher.kill()
    other_launcher.wait(10)  # SIGKILL: it could not remove its file, the kernel dropped its lock
    said = []
    with run_lock.Holder(said.append) as holder:
        holder.take(tmp_path)
        owner = json.loads((tmp_path / run_lock.LOCK).read_text())
    assert len(said) == 1 and f"pid {other_launcher.pid}" in said[0] and "taken over" in said[0]
    assert owner["host"] == socket.gethostname() and owner["pid"] != other_launcher.pid
    assert not (tmp_path / run_lock.LOCK).exists()  # released: the file is gone


def test_one_process_takes_its_own_lock_again_and_releases_it_once(tmp_path):
    outer, inner = run_lock.Holder(), run_lock.Holder()
    outer.take(tmp_path)
    inner.take(tmp_path)  # the run loop, inside a resume that holds it already
    inner.release_all()
    assert (tmp_path / run_lock.LOCK).exists()
    outer.release_all()
    assert not (tmp_path / run_lock.LOCK).exists()
    with run_lock.Holder() as again:  # and it can be taken once more
        again.take(tmp_path)


def test_an_owner_on_another_host_is_not_taken_over(tmp_path):
    (tmp_path / run_lock.LOCK).write_text(json.dumps(
        {"pid": 1, "host": "elsewhere", "command": "sdpipe resume x", "since": "then"}))
    with pytest.raises(run_lock.RunInUse) as refused:
        run_lock.Holder().take(tmp_path)
    assert "elsewhere" in str(refused.value) and "remove the file" in str(refused.value)
    assert (tmp_path / run_lock.LOCK).exists()  # left for its owner


def test_a_lock_file_that_is_a_link_or_not_a_lock_is_never_written(tmp_path):
    """A run folder from elsewhere may hold run.lock as a link to one of your files, or a file
    that is no lock: the lock never writes through the one nor overwrites the other."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / run_lock.LOCK).symlink_to(victim)
    with pytest.raises(run_lock.BadInput, match="is it a link"):
        run_lock.Holder().take(run)
    assert victim.read_text() == "mine"
    (run / run_lock.LOCK).unlink()
    (run / run_lock.LOCK).write_text("not a lock")
    with pytest.raises(run_lock.BadInput, match="holds something other than a run's owner"):
        run_lock.Holder().take(run)
    assert (run / run_lock.LOCK).read_text() == "not a lock"


def _left_by(folder, pid: int, **identity) -> None:
    """A lock file naming ``pid`` on this host, as a launcher that did not release it leaves it."""
    (folder / run_lock.LOCK).write_text(json.dumps(
        {"pid": pid, "host": socket.gethostname(), "command": "sdpipe train", "since": "then",
         **identity}))


@pytest.mark.parametrize("identity", [{}, "same"], ids=["unrecorded", "recorded"])
def test_a_live_process_named_by_a_free_lock_is_never_taken_over(tmp_path, identity):
    """The lock is free, but the process it names still runs (pid 1, a launcher whose lock does
    not reach here): refused with the owner named, the file left, nothing written."""
    if identity == "same":
        identity = {"boot": run_lock._boot(), "started": run_lock.started(1)}
    _left_by(tmp_path, 1, **identity)
    before = (tmp_path / run_lock.LOCK).read_text()
    said = []
    with pytest.raises(run_lock.RunInUse) as refused:
        run_lock.Holder(said.append).take(tmp_path)
    assert "pid 1 on" in str(refused.value) and "still running" in str(refused.value)
    assert "remove the file" in str(refused.value) and not said
    assert (tmp_path / run_lock.LOCK).read_text() == before


def test_a_reused_pid_or_an_earlier_boot_is_taken_over_with_a_warning(tmp_path):
    """The named pid runs, but as a process started after the lock's owner (a reused pid), or
    the owner ran in an earlier boot: the owner ended, and the lock is taken over, said so."""
    later = subprocess.Popen(["sleep", "30"])  # running, under a pid the file names
    try:
        _left_by(tmp_path, later.pid, boot=run_lock._boot(),
                 started=run_lock.started(later.pid) - 1)
        said = []
        with run_lock.Holder(said.append) as holder:
            holder.take(tmp_path)
    finally:
        later.kill()
        later.wait(10)
    assert len(said) == 1 and "is now a later process's" in said[0] and "taken over" in said[0]
    _left_by(tmp_path, 1, boot="an earlier boot", started=run_lock.started(1))
    said = []
    with run_lock.Holder(said.append) as holder:
        holder.take(tmp_path)
    assert len(said) == 1 and "earlier boot" in said[0]


@pytest.mark.parametrize("owner, running, expected", [
    ({"pid": 7}, None, "ended without releasing it"),  # gone
    ({"pid": 7}, 500, None),  # running, and nothing tells it from the owner
    ({"pid": 7}, -1, None),  # running, its start unreadable
    ({"pid": 7, "boot": "b", "started": 500}, 500, None),  # the owner itself
    ({"pid": 7, "boot": "b", "started": 400}, 500, "is now a later process's"),  # reused pid
    ({"pid": 7, "boot": "a", "started": 500}, 500, "earlier boot"),
    ({"pid": "x"}, 500, "names no process"),
    ({"pid": os.getpid(), "boot": "b", "started": 500}, 500, "this process's, released"),
], ids=["gone", "running", "unreadable", "owner", "reused", "rebooted", "no-pid", "mine"])
def test_the_decision_on_a_free_lock_left_with_an_owner(owner, running, expected):
    why = run_lock.decide(owner, "b", lambda pid: running)
    assert why == expected if expected is None else expected in why
