"""Starting a run's child processes: forks of a server that has imported torch once.

Every worker, the scheduler, the parameter servers and the profilers run code that needs torch.
Started as fresh interpreters, each imports torch on its own, about 3 CPU-seconds apiece: the
P x S workers of a run on a machine with few cores spend their first seconds importing, one
after another. The launcher starts them instead from :mod:`multiprocessing`'s fork server, which
imports the children's modules once (``preload``). A child is a fork of that server (torch's pages
are shared copy-on-write) that then makes itself the child the launcher asked for:

- its own session, so a Ctrl-C at the terminal, or a SIGTERM to the launcher's process group,
  reaches only the launcher, which stops the children in order (the server itself ignores SIGINT
  and blocks SIGTERM; a child unblocks SIGTERM once it has left the server's group);
- stdin from /dev/null, stdout and stderr appended to its log file;
- exactly the environment the launcher gave it (``RANK``, ``MASTER_ADDR``, ...);
- SIGTERM when its parent dies (PR_SET_PDEATHSIG): the server exits when the launcher does, so
  no child outlives the launcher;
- then the module's ``main()``, whose return value is the exit code.

A forked child keeps the server's command line and initial environment, so ``ps`` and
``/proc/PID/environ`` no longer say who it is: :func:`start` writes ``<name>.pid`` beside the
child's log instead (:func:`read_pid`).

Where the platform has no fork server (Windows), or with ``SDPIPE_SPAWN=exec``, a child is a
fresh ``python -m MODULE`` as before; both kinds answer the same calls (``pid``, ``poll()``,
``wait(timeout)``, ``returncode``), those of :class:`subprocess.Popen`.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

__all__ = ["ChildProcess", "die_with_parent", "preload", "read_pid", "start"]


class ChildProcess(Protocol):
    """What the launcher needs of a child: the part of :class:`subprocess.Popen` it uses."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def _forking() -> bool:
    return (os.environ.get("SDPIPE_SPAWN", "fork") != "exec"
            and "forkserver" in multiprocessing.get_all_start_methods())


# Imported lazily by torch itself, so a child module's imports miss it: the first optimizer
# built imports torch._dynamo (about 1.6 CPU-s).
LAZY_TORCH = ("torch._dynamo",)
# Imported last: builds what every child needs before it reads its config (see the module).
WARM_UP = ("sdpipe_cli.runtime.warm_up",)


def preload(modules: Sequence[str], env: dict[str, str]) -> None:
    """Start the fork server, which imports ``modules`` (and :data:`LAZY_TORCH`, then
    :data:`WARM_UP`), in environment ``env``.

    The server's environment matters for what libraries read when they load (OpenMP reads
    ``OMP_NUM_THREADS`` when torch is imported), and it is what ``/proc/PID/environ`` shows for
    every child. A server already running (a second launch in one process) keeps what it has;
    a child imports any other module itself.
    """
    if not _forking():
        return
    from multiprocessing import forkserver

    # first the guard that ends the server with its launcher, even while it imports the rest
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["sdpipe_cli.runtime.fork_server", *modules, *LAZY_TORCH, *WARM_UP])
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux); whether it
    could."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
            return True
        except (OSError, AttributeError):
            pass
    return False


LAUNCHER_POLL_S = 1.0  # how often a child looks whether its launcher is still there


def exit_with_launcher(pid: int, poll_s: float = LAUNCHER_POLL_S) -> None:
    """End this child and its process group (its data loaders) once the launcher ``pid`` is gone.

    A forked child's parent is the fork server, so the kernel's parent-death signal follows the
    server, not the launcher; and CPython hands every child the server's liveness pipe, so the
    server, and the resource tracker, live as long as any child does. A launcher killed with
    SIGKILL cannot stop them: each child watches for it instead (a daemon thread, one check a
    second; a pid reused by another process does not count as the launcher)."""
    import threading

    import psutil

    try:
        launcher = psutil.Process(pid)
    except psutil.Error:
        launcher = None

    def alive() -> bool:
        # is_running() tells a reused pid by the start time since boot. Not by comparing
        # create_time(): psutil adds the boot time to that, which moves whenever the system clock
        # is stepped (NTP, a virtual machine resumed from a snapshot), and every child of a run
        # then took its launcher, still there, for gone and killed itself.
        try:
            return (launcher is not None and launcher.is_running()
                    and launcher.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def _become(module: str, env: dict[str, str], log_path: str) -> None:
    """Runs in the forked child: become the launcher's child ``module``, then run its main()."""
    os.setsid()
    # the server blocks SIGTERM (see fork_server): its default back, then one sent while this
    # child was starting is delivered
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    die_with_parent()
    if env.get("SDPIPE_LAUNCHER_PID"):
        exit_with_launcher(int(env["SDPIPE_LAUNCHER_PID"]))
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    # the interpreter's own stdout, a text wrapper, now writing to the log
    cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    raise SystemExit(importlib.import_module(module).main())


class _Forked:
    """A child forked from the server, answering as :class:`subprocess.Popen` does."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid: int = cast(int, process.pid)  # set: start() is called first

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N when killed by signal N, as Popen says it

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self.pid}", timeout or 0.0)
        return self._process.exitcode


def start(module: str, log_path: Path, env: dict[str, str]) -> ChildProcess:
    """Start ``module``'s ``main()`` as a child with environment ``env`` (the whole of it), its
    output appended to ``log_path``; its pid goes to ``log_path`` with the suffix ``.pid``."""
    if _forking():
        ctx = multiprocessing.get_context("forkserver")
        process = ctx.Process(target=_become, args=(module, env, str(log_path)),
                              name=log_path.stem, daemon=False)
        process.start()
        child: ChildProcess = _Forked(process)
    else:
        with log_path.open("ab") as log_file:
            child = subprocess.Popen(
                [sys.executable, "-m", module], env=env, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
    # whole or absent (renamed into place): a reader (supervision, a user's script) never finds
    # the file empty between its creation and its write
    pid_path = log_path.with_suffix(".pid")
    tmp = pid_path.with_name(f".{pid_path.name}.tmp")
    tmp.write_text(f"{child.pid}\n")
    os.replace(tmp, pid_path)
    return child


def read_pid(log_path: Path) -> int | None:
    """The pid :func:`start` recorded for the child logging to ``log_path``, if any."""
    try:
        return int(log_path.with_suffix(".pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
