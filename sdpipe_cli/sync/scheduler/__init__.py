"""The scheduler process: the one place that holds the run's global view.

Started by the launcher (``python -m sdpipe_cli.sync.scheduler`` runs the same), it is a client
of the run's TCPStore like every worker. It pops worker events from the store's queue, feeds
ready signals to the pure group policy (:mod:`sdpipe_cli.core.grouping`) and writes each decision
back under :func:`~sdpipe_cli.runtime.store.decision_key`, where the waiting workers read it. It
also folds progress events into a :class:`~sdpipe_cli.runtime.metrics.RunTracker`, writes
``metrics.jsonl`` and ``summary.json``, and publishes a snapshot for the launcher's display.

A worker silent past ``run.heartbeat_timeout`` fails the run with its name; where a run survives
a lost pipeline (``fault.on_pipeline_loss=continue|restart``) it is named under
:data:`~sdpipe_cli.runtime.store.HUNG` instead, and the launcher kills it and handles the loss.
Restarted pipelines (``restart``): the launcher says so with the ``lost`` event (``restart``)
and a ``restart`` event when it starts the new processes; each of their workers asks to
``rejoin``, and the policy's decision that heals it names its source, which the scheduler
writes under :func:`~sdpipe_cli.runtime.store.heal_key` (or ``stop``, when the run ended
first). Every decision carries its members' incarnations, which name their communicators.

Its parts, each small enough to read at once:

- :mod:`.process`: the loop over the event queue, batches, the ticker, the journal and its
  replay, ``main``;
- :mod:`.handling`: :class:`~.handling.Scheduler`, one run's event handling and the decisions
  it publishes;
- :mod:`.checkpoints`: which global syncs are checkpoints, and finalizing them with stand-ins;
- :mod:`.health`: silent workers, named hung or failing the run.
"""
