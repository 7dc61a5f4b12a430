"""Imported last by the fork server (see :func:`~sdpipe_cli.runtime.processes.preload`): builds,
once, what every child would otherwise build for itself before it can read its config.

Each child of a run reads the run's config typed by the schema of its sync mode
(:func:`~sdpipe_cli.config.run_file.load_run_config`). Building that schema walks every dataclass
of :mod:`sdpipe_cli.config.schema`: tens of milliseconds, paid by each of a run's P x S workers,
its scheduler and its servers, and again by every restarted one. Built here, in the server, the
schemas of every sync mode are in each forked child's memory already (shared copy-on-write, and
read-only: a child merges its config into a copy). Then it freezes the garbage collector's view of
everything the server holds (below).
"""

from __future__ import annotations

import gc

from sdpipe_cli.config.run_file import frozen_schema
from sdpipe_cli.config.schema import SYNC_CONFIGS

for _name in SYNC_CONFIGS:
    frozen_schema(_name)

# Every child is a fork of this server: a full garbage collection in a child walks every object
# imported here (torch's, and the rest: 430,000 of them), touching each one's header, so that the
# kernel copies nearly every page of the server into the child: 0.34 CPU-s per collection, in
# each worker. Frozen, the collector leaves them alone (they live as long as the process anyway):
# over 51 integration tests (192 workers), the machine's CPU-s 173 and 175 without, 168 and 166
# with, alternately; the workers' own 96 and 92 against 92 and 89.
gc.freeze()
