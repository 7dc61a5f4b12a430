"""One launcher at a time in a run folder (sdpipe_cli.runtime.run_lock), with real processes
holding real locks."""

from __future__ import annotations

import json
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
