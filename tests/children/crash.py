"""A child that fails on purpose after a short while, recording its error like a real worker."""

import os
import time
from pathlib import Path

from sdpipe_cli.runtime.errors import record


def main() -> int:
    rank = int(os.environ["RANK"])
    with record(Path(os.environ["SDPIPE_RUN_DIR"]), str(rank), rank=rank):
        time.sleep(float(os.environ.get("CRASH_AFTER", "0.5")))
        raise RuntimeError(f"deliberate failure on rank {rank}")


if __name__ == "__main__":
    raise SystemExit(main())
