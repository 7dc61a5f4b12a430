"""Imported first by the fork server (see :func:`~sdpipe_cli.runtime.processes.preload`): it
ends with its launcher, and only with it.

The fork server is the launcher's child, started before any worker, and it then spends seconds
importing torch and the children's modules. Until it reaches its loop it does not notice that
the launcher is gone; after that it lives on while any child holds its pipe, and the resource
tracker lives as long as the server. So, before importing anything heavy, the server asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux), and ends at once if the
launcher died before it asked.

The server shares the launcher's process group, and what stops a job (``timeout``, ``kill --
-PGID``, a batch system's SIGTERM) signals the whole group. CPython's server ignores SIGINT, so
that Ctrl-C reaches only the launcher; it must not die of SIGTERM either, or it takes with it the
only channel that reports its children's exit codes (every child then reads as exited with 255,
and the launcher cannot stop them in order). The launcher, which counts either signal as a
request to stop gracefully, then stops the children itself. The server *blocks* SIGTERM rather
than ignoring it: a forked child inherits the mask, takes SIGTERM's default back once it is in
its own session, and only then unblocks it (:func:`~sdpipe_cli.runtime.processes.start`), so a
SIGTERM the launcher sends a child that is still starting waits for it instead of being lost.

Elsewhere (a process whose parent is not the launcher named in
``SDPIPE_LAUNCHER_PID``) importing this module does nothing.
"""

from __future__ import annotations

import os
import signal

from sdpipe_cli.runtime.processes import die_with_parent


def _guard() -> None:
    launcher = os.environ.get("SDPIPE_LAUNCHER_PID", "")
    if not launcher.isdigit() or os.getppid() != int(launcher):
        return  # not the launcher's fork server, or the launcher is already gone (checked below)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if die_with_parent(signal.SIGKILL) and os.getppid() != int(launcher):
        os._exit(1)  # it died between the two looks: no signal will come


_guard()
