"""How every child process of a run starts: one bootstrap for workers, profilers, the scheduler
and the parameter servers.

The launcher starts each child with torchrun-style environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), ``SDPIPE_RUN_DIR`` and
``SDPIPE_CONFIG`` (the resolved config it wrote, the only config a child reads). A child then
logs to stderr (the launcher's per-process log file) under its name, dumps every thread's stack on
``SIGUSR1`` (``kill -USR1 PID`` shows where a hung process is), records any exception in its error
file (the launcher reports the first failure from those files), connects to the store, and, if it
takes part in collectives, joins the default process group on the device it was given.

That group is the whole run (profiling, parameter servers) or, for training, the worker's own
pipeline: a pipeline that is restarted after a failure (``fault.on_pipeline_loss=restart``) gets
new processes, which cannot join a group of the whole run that is already formed, so each
pipeline forms its own, named after its incarnation (``SDPIPE_INCARNATION``: 0 at the start, one
more at each restart). Replicas of a stage meet in communicators of their own
(:class:`sdpipe_cli.sync.groups.GroupCache`), never in the default group.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from sdpipe_cli.config.run_file import ChildConfig, load_child_config
from sdpipe_cli.config.schema import Config
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import store
from sdpipe_cli.runtime.errors import record

__all__ = ["Child", "Joined", "child", "joined", "connect_store"]


@dataclass(frozen=True)
class Child:
    """A started child: its run folder and the run's config, as the record and as settings."""

    run_dir: Path
    cfg: DictConfig
    settings: Config


@contextmanager
def child(name: str, label: str | None = None, loaded: ChildConfig | None = None,
          **identity: Any) -> Iterator[Child]:
    """Logging as ``label`` (default ``name``), stack dumps on SIGUSR1, the run config (``loaded``
    if the caller already read it to name itself), and the error file ``name`` for any exception
    escaping the block (``identity`` says who failed: rank, pipeline, stage, role)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {label or name} %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1)
    run_dir, cfg, settings = loaded or load_child_config()
    with record(run_dir, name, **identity):
        yield Child(run_dir, cfg, settings)


def connect_store(timeout: float):
    """A new connection to the launcher's store, its operations bounded by ``timeout`` seconds
    (the run's ``run.timeout``, or a collective's own)."""
    return store.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)


@contextmanager
def process_group(client, rank: int, world: int, device, timeout: float,
                  prefix: str = "") -> Iterator[str]:
    """Join the default process group (NCCL on a GPU, else gloo) through the store, its
    rendezvous under ``prefix``; yields the backend's name and destroys the group when the block
    ends."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    rendezvous = dist.PrefixStore(store.PG_PREFIX + prefix, client)
    dist.init_process_group(backend, store=rendezvous, rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Joined:
    """A worker that has joined the run's process group (see :func:`joined`)."""

    cfg: DictConfig
    settings: Config  # the same config, typed
    run_dir: Path
    where: Placement
    plan: RunPlan  # the run's topology, placement, budget (resolved by the launcher)
    device: Any  # torch.device
    client: Any  # a connection to the launcher's store
    backend: str  # gloo | nccl
    incarnation: int = 0  # how many times this worker's pipeline was restarted
    rank_offset: int = 0  # the global rank of the default process group's rank 0


@contextmanager
def joined(pipeline_group: Callable[[Config], bool] = lambda settings: False) -> Iterator[Joined]:
    """Start a per-(pipeline, stage) worker, for training or profiling: :func:`child`, the device
    (one GPU per worker, or one CPU thread per ``OMP_NUM_THREADS``), the store and the default
    process group: the whole run's, or, where ``pipeline_group(settings)``, this pipeline
    incarnation's. What it reads of the config, it reads typed; the plan comes from the record's
    ``plan`` section, as the launcher wrote it."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("SDPIPE_INCARNATION", "0"))
    loaded = load_child_config()
    settings = loaded.settings
    where = Placement(rank, settings.cluster.pipelines, settings.pipeline.stages)
    group_rank, size, prefix, offset = rank, world, "", 0
    if pipeline_group(settings):
        group_rank, size, offset = where.stage, where.stages, where.pipeline_ranks()[0]
        prefix = f"pipeline{where.pipeline}.{incarnation}/"
    identity = {"rank": rank, "pipeline": where.pipeline, "stage": where.stage}
    with child(str(rank), f"rank{rank}", loaded, **identity) as started:
        plan = RunPlan.of(started.cfg)
        if settings.cluster.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        timeout = settings.run.timeout
        client = connect_store(timeout)
        with (process_group(client, group_rank, size, device, timeout, prefix) as backend,
              record(started.run_dir, str(rank), **identity)):  # before the group is torn down
            logging.getLogger("sdpipe.worker").info(
                "pipeline %d stage %d on %s", where.pipeline, where.stage, device)
            yield Joined(started.cfg, settings, started.run_dir, where, plan, device, client, backend,
                         incarnation, offset)
