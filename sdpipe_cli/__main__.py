"""``python -m sdpipe_cli`` runs the same CLI as the ``sdpipe`` console script."""

from sdpipe_cli.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
