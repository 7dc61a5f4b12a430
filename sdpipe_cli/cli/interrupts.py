"""Interrupts before anything is started: Ctrl-C and SIGTERM end the process at once, with one line.

An interrupt can come at any moment, even while torch and Hydra are still being imported. An
exception raised inside the import of a C extension leaves it half-loaded and turns into some other
error, so until the launcher takes over (it counts interrupts and stops what it started), the
handler installed here writes one line and exits 130: nothing has been started that would need
stopping.
"""

import os
import signal

EXIT_INTERRUPTED = 130


def exit_on_interrupt(while_: str):
    """Install (and return the previous) SIGINT/SIGTERM handlers that end the process at once,
    saying what it was doing; for phases that have started nothing."""
    line = f"sdpipe: error: interrupted while {while_}; nothing was started\n".encode()

    def handler(signum, frame) -> None:
        os.write(2, line)  # not sys.stderr: the interrupted code may hold its lock
        os._exit(EXIT_INTERRUPTED)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
