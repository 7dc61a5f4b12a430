"""A child that would run for a long time (``SLEEP_S`` seconds, 600 unless set): the supervisor
must stop it, or, with ``SLEEP_S`` short, one that ends well after a while."""

import os
import time


def main() -> int:
    time.sleep(float(os.environ.get("SLEEP_S", "600")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
