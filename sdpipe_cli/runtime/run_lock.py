"""One launcher at a time in a run folder: ``<run>/run.lock``.

Two launchers writing one run folder (two ``sdpipe resume`` of one run, a resume of a run still
training) interleave two timelines in ``metrics.jsonl`` and finalize and prune each other's
checkpoints. So a launcher holds the run's lock from before it writes anything there until its
last leg has ended, and a second one is refused with the owner's name.

The lock is the kernel's (``flock`` on the file, exclusive, non-blocking): it is released when
its holder exits, however it exits, so a pid that was reused can never keep a run locked. The
file also says who holds it (pid, host, command, since when, and which process that pid was: its
start since boot, and the boot) for the refusal, and is removed on release. A file left with an
owner in it while the lock is free means that owner did not release it, or holds it where this
process cannot see its lock (:func:`decide`): a named process that is gone, or whose pid now
belongs to a process started later, or of an earlier boot, ended, and the lock is taken over with
a warning; a named process still running is a launcher whose lock does not reach here (a
file system without working locks, a copy of the folder) or a process this file cannot tell
from one, so the run is refused with the owner named. An owner on another host (a shared file
system whose locks do not cross machines) cannot be checked from here and is refused too.
Removing the file (once that launcher is surely gone) takes the lock over.

Within one process the lock is re-entrant by folder (:class:`Holder`): ``sdpipe resume`` takes
it before its checks and the run loop again once the launch has the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sdpipe_cli.core.errors import BadInput

__all__ = ["LOCK", "Holder", "RunInUse"]

LOCK = "run.lock"


class RunInUse(BadInput):
    """The run folder is held by another launcher."""


_held: dict[Path, tuple[int, int]] = {}  # this process's locks: folder -> (fd, holders)


def _boot() -> str | None:
    """This boot of the machine (Linux), which a process's start time is counted from."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def started(pid: int) -> int | None:
    """Process ``pid``'s start, in clock ticks since boot (with the pid, the process's identity:
    a reused pid starts later); None if there is no such process, or only its zombie; -1 if it
    runs but its start cannot be read (no ``/proc``)."""
    try:
        stat_ = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        stat_ = ""
    fields = stat_.rpartition(")")[2].split()  # after the command's name, which may hold spaces
    if len(fields) > 19:
        return None if fields[0] in ("Z", "X") else int(fields[19])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:  # it exists, another user's
        pass
    return -1


def _owner_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "command": " ".join(["sdpipe", *sys.argv[1:]])[:300],
                       "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "boot": _boot(), "started": started(os.getpid())})


def decide(owner: dict, boot: str | None, started_of: Callable[[int], int | None]
           ) -> str | None:
    """A lock file naming ``owner`` (of this host) whose kernel lock was free: why its owner
    ended, for the warning that takes it over; None if the owner may still run, and the run
    is refused.

    The kernel drops a lock with its holder, so a free lock under a named owner is an owner that
    ended without removing the file, unless the owner holds the lock where it does not reach this
    process (a file system without working locks, the folder copied from a running one). Only
    the named process itself can tell these apart: gone, or of an earlier boot, or its pid now a
    process that started later (a reused pid) is an owner that ended; a process still running
    under that pid, as far as the file can tell the same one, may be that launcher, and is never
    taken over. ``boot``: this boot's id; ``started_of``: :func:`started`."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return "names no process that could hold it"
    if pid == os.getpid():  # this process released it (it holds its own locks in _held)
        return "was this process's, released"
    if owner.get("boot") and boot and owner["boot"] != boot:
        return "ended with an earlier boot of this machine"
    now = started_of(pid)
    if now is None:
        return "ended without releasing it"
    then = owner.get("started")
    if isinstance(then, int) and then >= 0 and now >= 0 and now != then:
        return f"ended without releasing it (pid {pid} is now a later process's)"
    return None


def _describe(text: str) -> tuple[str, str | None]:
    """(who, host) from a lock file's text."""
    try:
        owner = json.loads(text)
        return (f"pid {owner['pid']} on {owner['host']} since {owner['since']} "
                f"({owner['command']})", str(owner["host"]))
    except (ValueError, KeyError, TypeError):
        return "an unknown owner", None


def _take(folder: Path, warn: Callable[[str], None]) -> int:
    path = folder / LOCK
    while True:
        try:  # never through a symbolic link: a run folder from elsewhere may hold one
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise BadInput(str(path), f"cannot be made ({err.strerror}): is it a link or not "
                           "yours? Resume into a new folder with run.dir=NEW") from None
        try:
            taken = _lock(fd, path, folder, warn)
        except BaseException:
            os.close(fd)
            raise
        if taken:
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: try again


def _lock(fd: int, path: Path, folder: Path, warn: Callable[[str], None]) -> bool:
    """Lock the open ``fd`` of ``path`` and write this process as its owner; False if ``path``
    no longer names it (open again). Raises :class:`RunInUse` or :class:`BadInput`."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise BadInput(str(path), "is not a regular file; resume into a new folder with run.dir=NEW")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        raise RunInUse(str(folder), f"is in use by another launcher: {_describe(text)[0]}; "
                       "wait for it to end, or resume into a new folder with run.dir=NEW") from None
    except OSError as err:  # a file system without locks (NFS without lockd, some FUSE mounts)
        warn(f"sdpipe: warning: {path}: the file system takes no locks ({err.strerror}); the "
             "file names this launcher, but another could still start here")
    try:
        if os.fstat(fd).st_ino != os.lstat(path).st_ino:
            return False
    except FileNotFoundError:
        return False
    left = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if left:
        who, host = _describe(left)
        if host is None:  # not a lock file this sdpipe wrote: not ours to overwrite
            raise BadInput(str(path), "holds something other than a run's owner; remove it if it is "
                           "yours to remove, or resume into a new folder with run.dir=NEW")
        if host != socket.gethostname():
            raise RunInUse(str(path), f"names {who}, on another host, which this one cannot "
                           "check; if that launcher is gone, remove the file and run again")
        why = decide(json.loads(left), _boot(), started)
        if why is None:
            raise RunInUse(str(path), f"names {who}, which is still running on this host though "
                           "the lock is free (a file system without working locks, or a folder "
                           "copied from a running run?); if it is not a launcher of this run, "
                           "remove the file and run again")
        warn(f"sdpipe: warning: {path}: its owner, {who}, {why}; taken over")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _owner_text().encode("utf-8"), 0)
        os.fsync(fd)
    except OSError as err:
        raise BadInput(str(path), f"cannot be written: {err.strerror}") from None
    return True


class Holder:
    """The run locks one command holds; each :meth:`take` is undone by :meth:`release_all`."""

    def __init__(self, warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr)):
        self.warn = warn
        self.folders: list[Path] = []

    def take(self, folder: Path) -> None:
        """Hold ``folder``'s lock (again, if this process holds it already); :class:`RunInUse`
        when another launcher does."""
        key = Path(folder).resolve()
        fd, count = _held.get(key, (-1, 0))
        if count == 0:
            fd = _take(key, self.warn)
        _held[key] = (fd, count + 1)
        self.folders.append(key)

    def release_all(self) -> None:
        while self.folders:
            key = self.folders.pop()
            fd, count = _held.pop(key)
            if count > 1:
                _held[key] = (fd, count - 1)
                continue
            try:  # before unlocking, so that a waiter finds a new file; only if it is still ours
                if os.lstat(key / LOCK).st_ino == os.fstat(fd).st_ino:
                    (key / LOCK).unlink()
            except OSError:
                pass
            os.close(fd)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc) -> None:
        self.release_all()
