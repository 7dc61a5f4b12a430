"""Imported last by the fork server (see :func:`~sdpipe_cli.runtime.processes.preload`): does,
once, what every child would otherwise do for itself before it can read its config.

Each child of a run builds its settings from its config file's values through the schema's
annotations (:func:`~sdpipe_cli.config.run_file.load_child_config`); the annotations read here
are in each forked child's memory already (shared copy-on-write). Then it freezes the garbage
collector's view of everything the server holds (below).
"""

from __future__ import annotations

import gc

from sdpipe_cli.config.values import warm

warm()

# Every child is a fork of this server: a full garbage collection in a child walks every object
# imported here (torch's, and the rest: 430,000 of them), touching each one's header, so that the
# kernel copies nearly every page of the server into the child: 0.34 CPU-s per collection, in
# each worker. Frozen, the collector leaves them alone (they live as long as the process anyway):
# over 51 integration tests (192 workers), the machine's CPU-s 173 and 175 without, 168 and 166
# with, alternately; the workers' own 96 and 92 against 92 and 89.
gc.freeze()
