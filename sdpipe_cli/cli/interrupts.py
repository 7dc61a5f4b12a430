"""Interrupts before anything is started: Ctrl-C and SIGTERM end the process at once, with one line.

An interrupt can come at any moment, even while torch and Hydra are still being imported. An
exception raised inside the import of a C extension leaves it half-loaded and turns into some other
error, so until the launcher takes over (it counts interrupts and stops what it started), the
handler installed here writes one line and exits 130: nothing has been started that would need
stopping.

The commands that only read (:data:`READ_ONLY`) start nothing at any point; their line says so
in their own words, since "preparing the run" means nothing to a user evaluating a model.
"""

import os
import signal

EXIT_INTERRUPTED = 130
READ_ONLY = ("eval", "sample")  # commands that write nothing but their result, at their end


def exit_on_interrupt(while_: str, command: str | None = None):
    """Install (and return the previous) SIGINT/SIGTERM handlers that end the process at once,
    saying what it was doing (``command``'s own words for one of :data:`READ_ONLY`); for phases
    that have started nothing."""
    def line(sig: signal.Signals) -> bytes:
        if command in READ_ONLY:
            return f"sdpipe: error: {command} interrupted ({sig.name}); nothing was written\n".encode()
        return f"sdpipe: error: interrupted while {while_}; nothing was started\n".encode()

    lines = {sig: line(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame) -> None:
        os.write(2, lines[signum])  # not sys.stderr: the interrupted code may hold its lock
        os._exit(EXIT_INTERRUPTED)

    return {sig: signal.signal(sig, handler) for sig in lines}
