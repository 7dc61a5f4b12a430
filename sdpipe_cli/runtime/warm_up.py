"""Imported last by the fork server (see :func:`~sdpipe_cli.runtime.processes.preload`): builds,
once, what every child would otherwise build for itself before it can read its config.

Each child of a run reads the run's config typed by the schema of its sync mode
(:func:`~sdpipe_cli.config.run_file.load_run_config`). Building that schema walks every dataclass
of :mod:`sdpipe_cli.config.schema`: tens of milliseconds, paid by each of a run's P x S workers,
its scheduler and its servers, and again by every restarted one. Built here, in the server, the
schemas of every sync mode are in each forked child's memory already (shared copy-on-write, and
read-only: a child merges its config into a copy).
"""

from __future__ import annotations

from sdpipe_cli.config.run_file import frozen_schema
from sdpipe_cli.config.schema import SYNC_CONFIGS

for _name in SYNC_CONFIGS:
    frozen_schema(_name)
