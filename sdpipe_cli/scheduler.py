"""The scheduler process: the one place that holds the run's global view.

Started by the launcher as ``python -m sdpipe_cli.scheduler``, it is a client of the run's
TCPStore like every worker. It drains the workers' event queue, folds the events into a
:class:`~sdpipe_cli.metrics.RunTracker` (progress, heartbeats), writes ``metrics.jsonl`` and
``summary.json``, and publishes a progress snapshot for the launcher's display. A worker that
stays silent past ``run.heartbeat_timeout`` fails the run with its name, since a hung worker
otherwise stalls its whole pipeline without an error anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from sdpipe_cli import store
from sdpipe_cli.config import load_run_config
from sdpipe_cli.errors import record
from sdpipe_cli.metrics import MetricsLog, RunTracker

log = logging.getLogger("sdpipe.scheduler")

POLL_S = 0.01  # idle wait between drains of the event queue
PUBLISH_S = 0.2  # how often the progress snapshot is refreshed


class WorkerHung(RuntimeError):
    pass


def serve(cfg: DictConfig, run_dir: Path, events, clock=time.monotonic) -> RunTracker:
    """Run until every worker reported done; returns the final tracker."""
    P, S = cfg.cluster.pipelines, cfg.pipeline.stages
    tracker = RunTracker(P, S, P * cfg.train.steps, clock=clock,
                         heartbeat_timeout=cfg.run.heartbeat_timeout)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    published = 0.0
    started = clock()
    try:
        while not tracker.all_done():
            batch = store.pop_all(events, store.EVENTS)
            for event in batch:
                line = tracker.update(event)
                if line is not None:
                    metrics.write(line)
            # Silence only counts once training started: start-up may compile or load data.
            hung = tracker.silent_workers()
            if hung:
                raise WorkerHung(f"no report from rank(s) {hung} for {cfg.run.heartbeat_timeout:g} s")
            missing = tracker.world_size - len(tracker.started)
            if missing and clock() - started > cfg.run.timeout:
                raise WorkerHung(f"{missing} worker(s) never started within run.timeout")
            if clock() - published > PUBLISH_S:
                store.set_json(events, store.PROGRESS, tracker.snapshot())
                published = clock()
            if not batch:
                time.sleep(POLL_S)
    finally:
        metrics.close()
    store.set_json(events, store.PROGRESS, tracker.snapshot())
    return tracker


def main() -> int:
    run_dir = Path(os.environ["SDPIPE_RUN_DIR"])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s scheduler %(levelname)s %(message)s")
    cfg = load_run_config(run_dir / "config.yaml")
    with record(run_dir, "scheduler", role="scheduler"):
        client = store.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               cfg.run.timeout)
        events = store.namespace(client)
        tracker = serve(cfg, run_dir, events)
        summary = tracker.snapshot()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        for p, state in summary["pipelines"].items():
            log.info("pipeline %s: %d iterations, loss %s", p, state["steps"], state["loss"])
        events.set(store.FINISHED, "1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
