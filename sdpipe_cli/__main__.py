"""The ``sdpipe`` program: ``python -m sdpipe_cli`` and the console script both start here.

An interrupt can come at any moment, even while torch and Hydra are still being imported. An
exception raised inside the import of a C extension leaves it half-loaded and turns into some other
error, so until the CLI takes over, Ctrl-C and SIGTERM end the process at once with one line and
exit 130: nothing has been started yet that would need stopping.
"""

from sdpipe_cli.cli.interrupts import exit_on_interrupt


def entry() -> int:
    exit_on_interrupt("loading")
    from sdpipe_cli.cli.parsing import main

    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
