"""One worker process: stage s of pipeline p, for the whole run.

Started by the launcher as ``python -m sdpipe_cli.training.worker`` with torchrun-style environment
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
``SDPIPE_RUN_DIR`` and ``SDPIPE_CONFIG`` (the resolved config the launcher wrote, the only config
it reads), plus ``SDPIPE_RESUME`` (a verified checkpoint folder) when a run goes on.

Ranks are pipeline-major: rank = p * S + s. Per iteration the worker
1. agrees whether to go on: the first stage decides (with its replicas, if the sync strategy needs
   it) and passes the decision down the pipeline in a small control message, so that every stage of
   a pipeline runs exactly the same iterations;
2. runs the schedule's actions (forwards and backwards of m micro-batches) through the stage;
3. lets the sync strategy act (gradient all-reduce), clips, steps the optimizer, lets the strategy
   act again (weight averaging), and reports a step event to the scheduler;
4. saves its checkpoint shard when one is due (the strategy or the control message says when).
"""

from __future__ import annotations

import ctypes
import faulthandler
import hashlib
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from sdpipe_cli.training import checkpoint, data, models, optim

from sdpipe_cli.core import partition

from sdpipe_cli.runtime import store
from sdpipe_cli.config.schema import load_child_config, n_blocks
from sdpipe_cli.runtime.errors import record
from sdpipe_cli.core.cluster import Cluster
from sdpipe_cli.hetero.emulation import MemoryLimit, link_delay, make_slowdown
from sdpipe_cli.core.schedule import get_schedule
from sdpipe_cli.pipeline import p2p
from sdpipe_cli.pipeline.stage import PipelineStage
from sdpipe_cli.sync.strategies import GroupCache, make_sync

log = logging.getLogger("sdpipe.worker")


@dataclass(frozen=True)
class Placement:
    """Where this worker sits in the P x S grid."""

    rank: int
    pipelines: int
    stages: int

    @property
    def pipeline(self) -> int:
        return self.rank // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, pipeline: int, stage: int) -> int:
        return pipeline * self.stages + stage


def param_digest(module: nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in module.parameters():
        flat = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(flat.data_ptr(), flat.nbytes))  # raw bytes, no numpy needed
    return h.hexdigest()[:16]


def build_stage_module(cfg: DictConfig, stage: int) -> nn.Module:
    """This stage's blocks; every replica builds the whole model from the same seed, then slices."""
    torch.manual_seed(cfg.train.seed)
    blocks = models.build_blocks(cfg.model)
    start, stop = partition.stage_ranges(list(cfg.pipeline.partition), n_blocks(cfg.model))[stage]
    return nn.Sequential(*blocks[start:stop])


class Worker:
    def __init__(self, cfg: DictConfig, where: Placement, device: torch.device, events: dist.Store,
                 groups: GroupCache, resume: str | None = None):
        self.cfg, self.where, self.device, self.events = cfg, where, device, events
        self.t0 = store.run_clock(events)
        p, s, P, S = where.pipeline, where.stage, where.pipelines, where.stages
        self.module = build_stage_module(cfg, s).to(device)
        self.optimizer = optim.build_optimizer(self.module.parameters(), cfg)
        self.lr = cfg.train.lr  # the learning rate of the last update
        self.sync = make_sync(cfg.sync.name, events=events, groups=groups, rank=where.rank,
                              pipeline=p, stage=s, pipelines=P, stages=S, device=device,
                              seed=cfg.train.seed, average=cfg.sync.average,
                              optimizer=self.optimizer)
        self.cluster = Cluster.from_config(cfg.cluster, S)
        self.placed = self.cluster.device(p, s)
        self.slowdown = make_slowdown(cfg, self.cluster, p, s, lambda: time.time() - self.t0)
        self.memory = MemoryLimit(self.placed, device)
        mb = cfg.train.batch_size // cfg.pipeline.microbatches
        self.stage = PipelineStage(
            self.module, stage=s, num_stages=S,
            prev_rank=None if where.first else where.rank_of(p, s - 1),
            next_rank=None if where.last else where.rank_of(p, s + 1),
            activation_shape=models.activation_shape(cfg.model, mb),
            device=device, loss_fn=models.loss_fn,
            on_action=self.slowdown if self.slowdown.active else None,
            before_send=link_delay(self.cluster, where.rank),
        )
        self.actions = get_schedule(cfg.pipeline.schedule)(S, cfg.pipeline.microbatches, s)
        self.corpus = None
        if where.first or where.last:  # middle stages never touch data
            self.corpus = data.load_corpus(cfg.data, cfg.train.seed)
            data.check_corpus(self.corpus, cfg.model.seq_len)
        self._pending: list[p2p.Pending] = []
        self.run_dir = Path(cfg.run.dir)
        self._last_save = time.monotonic()
        self._save_after = False
        self.start_step = self._restore(Path(resume)) if resume else 0
        self._saved_step = self.start_step  # the step of the last checkpoint (or of the resume)

    # -- control ---------------------------------------------------------------------------
    def _agree(self, step: int, started: float) -> bool:
        """Whether the pipeline runs iteration ``step``; the same answer on every stage."""
        w = self.where
        if w.first:
            limit = self.cfg.train.time_limit
            timed_out = (bool(limit and time.time() - started >= limit)
                         or self.events.check([store.STOP_REQUESTED]))
            go = self.sync.should_continue(step, step < self.cfg.train.steps and not timed_out,
                                           timed_out)
            minutes = self.cfg.checkpoint.every_minutes
            save = bool(minutes) and go and self.sync.agree_on_checkpoint(
                time.monotonic() - self._last_save >= minutes * 60)
            control = p2p.Control(go, step, save)
        else:
            control = p2p.receive_control(w.rank_of(w.pipeline, w.stage - 1), step, self.device,
                                          stage=w.stage)
        if not w.last:
            self._pending.append(p2p.send_control(control, w.rank_of(w.pipeline, w.stage + 1),
                                                  self.device))
        self._save_after = control.save  # a time-based checkpoint at the end of this iteration
        return control.go

    def _microbatches(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(self.device) for t in x.chunk(self.cfg.pipeline.microbatches)]

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        from sdpipe_cli.core.schedule import ASYNC_SCHEDULES
        if self.cfg.pipeline.schedule in ASYNC_SCHEDULES:  # no flush: see sdpipe_cli/training/async_loop.py
            from sdpipe_cli.training.async_loop import AsyncLoop  # (it imports this module)
            return AsyncLoop(self).train()
        cfg, w = self.cfg, self.where
        self._emit("start", pid=os.getpid())
        started = time.time()
        step = self.start_step
        warm = None  # (time, step) at the end of the first iteration: throughput counts from there
        while self._agree(step, started):
            t_step = time.perf_counter()
            self.slowdown.new_iteration()
            inputs = targets = None
            if self.corpus is not None:
                x, y = data.train_batch(self.corpus, w.pipeline, w.pipelines, cfg.train.batch_size,
                                        cfg.model.seq_len, cfg.train.seed, step)
                inputs, targets = self._microbatches(x), self._microbatches(y)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.stage.run(self.actions, inputs if w.first else None,
                                  targets if w.last else None)
            compute_s = time.perf_counter() - t_step
            sync_s = self.update(step, step)
            self._wait_pending()
            self.memory.check()
            step += 1
            step_s = time.perf_counter() - t_step
            if warm is None:  # the first iteration pays one-off set-up (connections, allocator)
                warm = (time.time(), step)
            if step % cfg.train.log_every == 0:
                since, at = warm
                rate = ((step - at) * cfg.train.batch_size / max(time.time() - since, 1e-9)
                        if step > at else cfg.train.batch_size / step_s)
                extra = {"loss": loss} if w.last else {}
                self._emit("step", step=step, samples=step * cfg.train.batch_size,
                           samples_per_s=rate, lr=self.lr, step_s=step_s, compute_s=compute_s,
                           sync_s=sync_s, straggled=self.slowdown.straggled,
                           **self.sync.stats(), **extra)
            self.consistent_point(step, self._save_after)
        self._wait_pending()
        self.finish(step)

    def update(self, round: int, iteration: int) -> float:
        """Apply the accumulated gradients of ``iteration``: the strategy's gradient sync,
        clipping, the optimizer step at the schedule's learning rate and the strategy's weight
        sync for ``round``; returns the seconds spent syncing."""
        start = time.perf_counter()
        self.sync.after_backward(self.module, round)
        sync_s = time.perf_counter() - start
        if self.cfg.train.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip)
        # Lock-step modes are at ``iteration``; sdpipe follows the run's global progress.
        self.lr = optim.lr_at(self.sync.position(iteration), self.cfg)
        optim.set_lr(self.optimizer, self.lr)
        if self.sync.local_step:
            self.optimizer.step()
        start = time.perf_counter()
        self.sync.after_step(self.module, round)
        return sync_s + time.perf_counter() - start

    def consistent_point(self, step: int, save: bool) -> None:
        """Iteration ``step`` is done on every stage of the pipeline: evaluate if due, and save a
        checkpoint if the strategy says one is due or ``save`` (a time-based one) asks."""
        cfg = self.cfg
        if cfg.train.eval_every and step % cfg.train.eval_every == 0:
            self.evaluate(step)
        ckpt = self.sync.checkpoint_due(step, cfg.checkpoint.every)
        if ckpt is None and save:
            ckpt = step
        if ckpt is not None:
            self._save(ckpt, step)

    def finish(self, step: int, **extra) -> None:
        """The run ended after iteration ``step`` at a consistent point: the final checkpoint,
        evaluation and weights, and the ``done`` event (with ``extra`` fields)."""
        cfg, w = self.cfg, self.where
        self.sync.finish()
        if cfg.checkpoint.on_exit and self.sync.name != "sdpipe" and step != self._saved_step:
            self._save(step, step)  # lock-step modes: every replica stopped at this step
        if not (cfg.train.eval_every and step % cfg.train.eval_every == 0):
            self.evaluate(step)  # always once at the end of the run
        if cfg.run.save_final:
            final = Path(cfg.run.dir) / "final"
            final.mkdir(exist_ok=True)
            torch.save(self.module.state_dict(), final / f"p{w.pipeline}-s{w.stage}.pt")
        self._emit("done", steps=step, param_digest=param_digest(self.module),
                   device=self.placed.name, slowdown_overruns=self.slowdown.overruns,
                   actions=self.slowdown.actions, straggled=self.slowdown.straggled,
                   peak_memory_mb=round(self.memory.peak_mb(), 1), **extra)

    # -- checkpoints ----------------------------------------------------------------------------
    def _save(self, ckpt: int, step: int) -> None:
        """This rank's shard of checkpoint ``ckpt``; the scheduler finalizes it once all are in."""
        w = self.where
        state = {"step": step, "pipeline": w.pipeline, "stage": w.stage,
                 "model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}
        checkpoint.save_shard(checkpoint.staging_dir(self.run_dir, ckpt), str(w.rank), state)
        self._last_save, self._saved_step = time.monotonic(), step
        self._emit("saved", checkpoint=ckpt, step=step)

    def _restore(self, ckpt: Path) -> int:
        """Load this rank's shard (checksum verified, weights only); returns the step to go on from."""
        state = checkpoint.load_shard(ckpt, str(self.where.rank))
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", ckpt, state["step"])
        return int(state["step"])

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        """Validation loss of this pipeline's replica on the fixed validation batches."""
        cfg, w = self.cfg, self.where
        batches = [(None, None)] * cfg.data.eval_batches
        if self.corpus is not None:
            batches = data.val_batches(self.corpus, cfg.data.eval_batches, cfg.train.batch_size,
                                       cfg.model.seq_len, cfg.train.seed)
        self.module.eval()
        losses = []
        for x, y in batches:
            loss = self.stage.forward_only(self._microbatches(x) if w.first else None,
                                           self._microbatches(y) if w.last else None,
                                           microbatches=cfg.pipeline.microbatches)
            losses.append(loss)
        self.module.train()
        if w.last:
            self._emit("eval", step=step, val_loss=sum(losses) / len(losses),
                       samples=step * cfg.train.batch_size)

    def _emit(self, kind: str, **fields) -> None:
        w = self.where
        store.push(self.events, store.EVENTS, {
            "type": kind, "rank": w.rank, "pipeline": w.pipeline, "stage": w.stage,
            "time": round(time.time() - self.t0, 4), **fields})

    def _wait_pending(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()


@dataclass(frozen=True)
class Joined:
    """A child process that has joined the run's process group (see :func:`joined`)."""

    cfg: DictConfig
    run_dir: Path
    where: Placement
    device: torch.device
    client: dist.TCPStore  # a connection to the launcher's store
    backend: str  # gloo | nccl


@contextmanager
def joined() -> Iterator[Joined]:
    """Set up a per-(pipeline, stage) child as the launcher started it, for training or profiling.

    Reads the environment and the run config, logs to stderr (the launcher's log file), records
    any exception in the error file, picks the device (one GPU per worker, or one CPU thread per
    ``OMP_NUM_THREADS``), connects to the store and initializes the default process group; the
    group is destroyed when the block ends.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack to the log
    run_dir, cfg = load_child_config()
    where = Placement(rank, cfg.cluster.pipelines, cfg.pipeline.stages)
    with record(run_dir, str(rank), rank=rank, pipeline=where.pipeline, stage=where.stage):
        cuda = cfg.cluster.device == "cuda"
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        client = store.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               cfg.run.timeout)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(store.PG_PREFIX, client), rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg.run.timeout),
                                device_id=device if cuda else None)
        log.info("pipeline %d stage %d on %s", where.pipeline, where.stage, device)
        try:
            yield Joined(cfg, run_dir, where, device, client, backend)
        finally:
            dist.destroy_process_group()


def group_cache(ctx: Joined, timeout: float) -> GroupCache:
    """Communicators over subsets of ranks, with the emulated all-reduce time when links are
    emulated; a ``timeout`` other than ``run.timeout`` gets its own store connection."""
    cfg = ctx.cfg
    group_store = store.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                timeout) if timeout != cfg.run.timeout else ctx.client
    cluster = Cluster.from_config(cfg.cluster, cfg.pipeline.stages)
    return GroupCache(dist.PrefixStore(store.PG_PREFIX, group_store), ctx.where.rank, ctx.backend,
                      timeout, delay=cluster.allreduce_s if cluster.links_emulated else None)


def main() -> int:
    with joined() as ctx:
        # sdpipe's groups get their own store connection and a short timeout: a member that
        # died between its ready signal and the average must not stall the survivors.
        cfg = ctx.cfg
        timeout = cfg.sync.group_timeout if cfg.sync.name == "sdpipe" else cfg.run.timeout
        Worker(cfg, ctx.where, ctx.device, store.namespace(ctx.client), group_cache(ctx, timeout),
               resume=os.environ.get("SDPIPE_RESUME")).train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
