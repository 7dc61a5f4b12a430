"""A child's watch over its launcher (runtime/processes.exit_with_launcher): it ends the child once
the launcher is gone, and only then; a stepped system clock does not make the launcher look gone."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from sdpipe_cli.runtime import processes

pytestmark = pytest.mark.multiprocess


def _watch_then_exit(launcher: int, shift_clock: bool) -> None:
    """A child in a session of its own (the watch kills its process group), watching
    ``launcher`` for 2 s; with ``shift_clock`` the boot time psutil reads moves a second later,
    as a stepped system clock moves it."""
    os.setsid()
    processes.exit_with_launcher(launcher, poll_s=0.05)
    if shift_clock:
        import psutil._pslinux as pslinux

        boot = pslinux.boot_time()
        pslinux.boot_time = lambda: boot + 1.0
    time.sleep(2.0)
    os._exit(0)


def _run(launcher: int, shift_clock: bool) -> int:
    child = multiprocessing.get_context("fork").Process(target=_watch_then_exit,
                                                        args=(launcher, shift_clock))
    child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
        child.join(5)
        pytest.fail("the child neither ended nor was killed")
    return child.exitcode


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="psutil's Linux boot time")
def test_a_stepped_clock_does_not_make_the_launcher_look_gone():
    # fails with a watch that compares create_time(), which moves with the boot time: -9
    assert _run(os.getpid(), shift_clock=True) == 0


def test_the_watch_ends_the_child_once_the_launcher_is_gone():
    gone = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    gone.start()
    gone.join(10)
    assert _run(gone.pid, shift_clock=False) == -9  # SIGKILL, from its own watch
