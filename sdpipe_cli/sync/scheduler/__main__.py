"""``python -m sdpipe_cli.sync.scheduler``: the scheduler process (:mod:`.process`)."""

from sdpipe_cli.sync.scheduler.process import main

raise SystemExit(main())
