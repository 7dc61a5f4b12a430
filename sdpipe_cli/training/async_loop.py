"""A worker's training loop under asynchronous 1F1B (``pipeline.schedule=async_1f1b``).

The flushed loop (:meth:`sdpipe_cli.training.worker.Worker.train`) runs one iteration at a time: m
micro-batches through the pipeline, a flush, one optimizer step and one sync. Here the
micro-batch stream crosses iteration boundaries: :class:`~sdpipe_cli.pipeline.async_stage.AsyncStage`
runs *segments* of iterations, and after every micro-batch's backward this loop updates the
stage (sync hooks, clipping, optimizer step) and lets the sync strategy act on that update
(with ``pipeline.weight_versions=2``, PipeDream-2BW, the gradients of an iteration's
micro-batches accumulate and the update comes after the last of them):

* ``allreduce``: the micro-batch's gradient is all-reduced over the stage's replicas (every
  replica runs the same batch ids, so they stay identical);
* ``sdpipe``: a ready signal per update, and the group average the scheduler decides;
* ``adpsgd``: an average with the peer of that update's round;
* ``ps``: a push of the gradient and a pull of the server's weights.

Iterations (``train.batch_size`` samples, m micro-batches) stay the unit of ``train.steps``, the
learning rate schedule, logging, evaluation and checkpoints. A segment ends (the pipeline drains,
every stage at the same batch id) only where the pipeline must be consistent: before an
evaluation, a checkpoint, a global sync (the scheduler's answer to the first stage at the start of
each iteration) and the end of the run. The first stage decides at the start of each iteration
whether it is the last before such a point and says so in the iteration's control message, so
the stop point is known before any stage forwards that iteration. Nothing in flight survives a
drain, so checkpoints hold no stashed weights: a resumed run starts a new segment at the
checkpoint's iteration.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from sdpipe_cli.training import data

from sdpipe_cli.runtime import store
from sdpipe_cli.pipeline.async_stage import AsyncStage, Batch
from sdpipe_cli.pipeline.p2p import Control
from sdpipe_cli.core.schedule import updates_per_iteration
from sdpipe_cli.training.worker import Worker


class AsyncLoop:
    """Trains ``worker``'s stage with asynchronous 1F1B; uses the worker's model, optimizer, sync
    strategy, data, evaluation, checkpoints and events."""

    def __init__(self, worker: Worker):
        self.w = worker
        self.cfg = worker.cfg
        p = self.cfg.pipeline
        self.m = p.microbatches
        # micro-batches per update: 1 (PipeDream) or m (2BW: one update per iteration)
        self.window = self.m // updates_per_iteration(p.schedule, p.microbatches, p.weight_versions)
        worker.stage = self.stage = AsyncStage(worker.stage.executor, self.m, p.weight_versions)
        self.started = time.time()
        self.ending = False  # the first stage decided that the run ends at the next drain
        self.segment = worker.start_step  # iteration at which the current segment began
        # The iteration being finished on this stage: loss, sync time, start.
        self._losses: list[float] = []
        self._sync_s = 0.0
        self._t_iteration = time.perf_counter()

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> None:
        w = self.w
        w._emit("start", pid=os.getpid())
        self.started = time.time()
        step = w.start_step
        while True:
            self.segment = step
            self._t_iteration = time.perf_counter()
            done, control = self.stage.run_segment(
                step, self._decide if w.where.first else None, self._load, self._update)
            if not control.go:
                break
            step = done  # drained: every stage of the pipeline finished iteration step - 1
            w.consistent_point(step, control.save)
        w.finish(step, **self.stage.stash.stats())

    # -- the first stage's decisions -----------------------------------------------------------
    def _decide(self, k: int) -> Control:
        """Iteration k's control: whether it runs (segment start), and whether it ends the segment."""
        w, cfg = self.w, self.cfg
        limit = cfg.train.time_limit
        timed_out = (bool(limit and time.time() - self.started >= limit)
                     or w.events.check([store.STOP_REQUESTED]))

        def local_go(iteration: int) -> bool:
            return iteration < cfg.train.steps and not timed_out

        if k == self.segment:  # a drained point: the run may end here
            go = not self.ending and w.sync.should_continue(k, local_go(k), timed_out)
            if not go:
                return Control(False, k, False, False)
        # Does the run go on after iteration k? Lock-step strategies agree on it here (the same
        # collective, at the same batch id, on every replica); sdpipe's scheduler answers below.
        go_on = w.sync.should_continue(k + 1, local_go(k + 1), timed_out)
        drain = w.sync.drain_after(k)  # sdpipe: a global sync after iteration k
        every = cfg.checkpoint.every
        # Lock-step checkpoints fall on multiples of checkpoint.every; sdpipe's on global syncs.
        checkpoint = w.sync.name != "sdpipe" and bool(every) and (k + 1) % every == 0
        minutes = cfg.checkpoint.every_minutes
        save = bool(minutes) and w.sync.agree_on_checkpoint(
            time.monotonic() - w._last_save >= minutes * 60)
        evaluate = bool(cfg.train.eval_every) and (k + 1) % cfg.train.eval_every == 0
        self.ending = not go_on
        return Control(True, k, save, not go_on or drain or checkpoint or save or evaluate)

    # -- every stage ----------------------------------------------------------------------------
    def _load(self, k: int) -> Batch:
        w, cfg = self.w, self.cfg
        if w.corpus is None:
            return None, None
        x, y = data.train_batch(w.corpus, w.where.pipeline, w.where.pipelines, cfg.train.batch_size,
                                cfg.model.seq_len, cfg.train.seed, k)
        return (w._microbatches(x) if w.where.first else None,
                w._microbatches(y) if w.where.last else None)

    def _update(self, j: int, loss: Optional[float]) -> None:
        """After batch id j's backward: sync, clip and step, as the flushed loop does per iteration
        (with 2BW only after an iteration's last micro-batch, on the mean of its gradients)."""
        w = self.w
        k = j // self.m
        if loss is not None:
            self._losses.append(loss)
        if (j + 1) % self.window:
            return  # 2BW: the gradient accumulates until the end of the iteration
        if self.window > 1:
            for p in w.module.parameters():
                if p.grad is not None:
                    p.grad /= self.window  # the mean over the iteration, as a flushed loss / m
        self._sync_s += w.update(j // self.window, k)  # this update's round (sdpipe, adpsgd, ps)
        self.stage.stash.changed()  # one new weight version per update (step and averaging)
        w.optimizer.zero_grad(set_to_none=True)
        if (j + 1) % self.m == 0:
            self._iteration_done(k + 1, w.lr)

    def _iteration_done(self, step: int, lr: float) -> None:
        """This stage made the last update of iteration ``step - 1``: report it."""
        w, cfg = self.w, self.cfg
        w.memory.check()
        w.slowdown.new_iteration()  # per-iteration stragglers draw for the next iteration
        now = time.perf_counter()
        step_s, sync_s = now - self._t_iteration, self._sync_s
        self._t_iteration, self._sync_s = now, 0.0
        losses, self._losses = self._losses, []
        if step % cfg.train.log_every:
            return
        elapsed = max(time.time() - self.started, 1e-9)
        extra = {"loss": sum(losses) / len(losses)} if w.where.last and losses else {}
        stash = self.stage.stash
        w._emit("step", step=step, samples=step * cfg.train.batch_size,
                samples_per_s=(step - w.start_step) * cfg.train.batch_size / elapsed, lr=lr,
                step_s=step_s, compute_s=step_s - sync_s, sync_s=sync_s,
                stash_versions=stash.peak_versions, stash_bytes=stash.peak_bytes,
                straggled=w.slowdown.straggled, **w.sync.stats(), **extra)
