"""The ``sdpipe`` program: ``python -m sdpipe_cli`` and the console script both start here.

An interrupt can come at any moment, even while torch and Hydra are still being imported, so this
small module installs the handlers first and imports the CLI after: Ctrl-C or SIGTERM at any point
of start-up ends with one line and exit 130, never a traceback.
"""

import signal
import sys

EXIT_INTERRUPTED = 130


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def entry() -> int:
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops sdpipe like Ctrl-C
    try:
        from sdpipe_cli.cli import main
    except KeyboardInterrupt:
        print("sdpipe: error: interrupted while loading; nothing was started", file=sys.stderr)
        return EXIT_INTERRUPTED
    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
