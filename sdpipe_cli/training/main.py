"""The worker process: ``python -m sdpipe_cli.training.main``, started P x S times by the launcher.

It joins the run (:func:`sdpipe_cli.runtime.bootstrap.joined`), builds its
:class:`~sdpipe_cli.training.worker.Worker`, waits until every worker is built (so that
pipelines start their first iteration together) and runs the loop of its schedule: the flushed loop
for ``1f1b`` and ``gpipe``, the asynchronous one for ``async_1f1b``. ``SDPIPE_RESUME`` names a
verified checkpoint folder when a run goes on.
"""

from __future__ import annotations

import logging
import os

from sdpipe_cli.config.schema import Config
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES
from sdpipe_cli.runtime import store
from sdpipe_cli.runtime.bootstrap import joined
from sdpipe_cli.sync import groups
from sdpipe_cli.training.async_loop import AsyncLoop
from sdpipe_cli.training.loop import FlushedLoop
from sdpipe_cli.training.worker import Worker

log = logging.getLogger("sdpipe.worker")


def own_group(settings: Config) -> bool:
    """Whether a worker's process group is its pipeline: always, except with parameter servers,
    which talk to every worker (see :mod:`sdpipe_cli.runtime.bootstrap`)."""
    return not mode(settings.sync.name).servers


def main() -> int:
    with joined(own_group) as ctx:
        settings = ctx.settings
        # A mode with a group timeout (sdpipe) gets its own store connection for its groups:
        # a member that died between its ready signal and the average must not stall the rest.
        timeout = getattr(settings.sync, "group_timeout", None) or settings.run.timeout
        sync_groups = groups.for_worker(ctx, timeout)
        # apart even on the same connection: what the pipeline's stages exchange (the clipping
        # norm, tied weights) is not the sync's traffic, which sync_groups count
        pipeline_groups = groups.for_worker(ctx, settings.run.timeout)
        shared = store.namespace(ctx.client)
        # a restarted worker takes its state from a live replica (rejoin), not from the
        # checkpoint the leg began with, which may not even hold its blocks (a re-split)
        resume = os.environ.get("SDPIPE_RESUME") if not ctx.incarnation else None
        worker = Worker(settings, ctx.where, ctx.plan, ctx.device, shared, sync_groups,
                        pipeline_groups, resume=resume, incarnation=ctx.incarnation,
                        rank_offset=ctx.rank_offset)
        # Waiting silently, a worker must not look hung (or never started) to the scheduler. A
        # restarted one counts itself in before it waits to be healed, which takes a round.
        patience = min(settings.run.timeout, settings.run.heartbeat_timeout) / 2
        if not store.start_together(shared, ctx.plan.pipelines * ctx.plan.stages, patience,
                                    wait=not ctx.incarnation):
            log.warning("not every worker was built within %g s; starting anyway", patience)
        if ctx.incarnation:
            worker.rejoin()
        loop = AsyncLoop if settings.pipeline.schedule in ASYNC_SCHEDULES else FlushedLoop
        loop(worker).train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
