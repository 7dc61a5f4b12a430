"""A worker's training loop under asynchronous 1F1B (``pipeline.schedule=async_1f1b``).

The flushed loop (:mod:`sdpipe_cli.training.loop`) runs one iteration at a time: m
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

Gradient clipping here is by each stage's own norm, not by the norm over the pipeline as in the
flushed loop: the stages of an asynchronous pipeline update at different times by design (stage
s updates batch j about 2(S - s) actions before stage 0 does), so a global norm would make every
update wait for the backward of the same micro-batch on every other stage: the flush this
schedule exists to remove. Each stage's norm is at most the whole model's, so this clips no more
often than the flushed loops do.
"""

from __future__ import annotations

import time

from sdpipe_cli.core.cadence import Throughput
from sdpipe_cli.core.schedule import updates_per_iteration
from sdpipe_cli.pipeline.async_stage import AsyncStage
from sdpipe_cli.pipeline.p2p import Control
from sdpipe_cli.training.worker import Worker

__all__ = ["AsyncLoop"]


class AsyncLoop:
    """Trains ``worker``'s stage with asynchronous 1F1B; uses the worker's model, optimizer, sync
    strategy, data, evaluation, checkpoints and events."""

    def __init__(self, worker: Worker):
        self.w = worker
        self.settings = worker.settings
        p = self.settings.pipeline
        self.m = p.microbatches
        # micro-batches per update: 1 (PipeDream) or m (2BW: one update per iteration)
        self.window = self.m // updates_per_iteration(p.schedule, p.microbatches, p.weight_versions)
        (executor,) = worker.stage.executors  # one: validation refuses chunks here
        self.stage = AsyncStage(executor, self.m, p.weight_versions)
        worker.stage = self.stage  # the worker's evaluations and checkpoints go through it too
        self.started = time.time()
        self.rate = Throughput(worker.batch_size)
        self.ending = False  # the first stage decided that the run ends at the next drain
        self.segment = worker.start_step  # iteration at which the current segment began
        # The iteration being finished on this stage: loss, sync time, start.
        self._losses: list[float] = []
        self._sync_s = 0.0
        self._t_iteration = time.perf_counter()

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> None:
        w = self.w
        w.started()
        self.started = time.time()
        step = w.start_step
        w.slowdown.step = step  # the first iteration's (the next ones: _iteration_done)
        while True:
            self.segment = step
            self._t_iteration = time.perf_counter()
            done, control = self.stage.run_segment(
                step, self._decide if w.where.first else None, w.batch, self._update)
            if not control.go:
                break
            step = done  # drained: every stage of the pipeline finished iteration step - 1
            w.consistent_point(step, control.save)
        w.finish(step, **self.stage.stash.stats())

    # -- the first stage's decisions -----------------------------------------------------------
    def _decide(self, k: int) -> Control:
        """Iteration k's control: whether it runs (segment start), and whether it ends the segment."""
        w, cadence = self.w, self.w.cadence
        timed_out = w.timed_out(self.started)
        if k == self.segment:  # a drained point: the run may end here
            go = not self.ending and w.sync.should_continue(k, cadence.local_go(k, timed_out),
                                                            timed_out)
            if not go:
                return Control(False, k, False, False)
        # Does the run go on after iteration k? Lock-step strategies agree on it here (the same
        # collective, at the same batch id, on every replica); sdpipe's scheduler answers below.
        go_on = w.sync.should_continue(k + 1, cadence.local_go(k + 1, timed_out), timed_out)
        drain = w.sync.drain_after(k)  # sdpipe: a global sync after iteration k
        # Lock-step checkpoints fall on multiples of checkpoint.every; sdpipe's on global syncs.
        checkpoint = not w.sync.scheduled_checkpoints and cadence.checkpoint_after(k + 1)
        save = w.time_checkpoint()
        evaluate = cadence.evaluate_after(k + 1)
        self.ending = not go_on
        return Control(True, k, save, not go_on or drain or checkpoint or save or evaluate)

    # -- every stage ----------------------------------------------------------------------------
    def _update(self, j: int, loss: float | None) -> None:
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
        # this update's round (sdpipe, adpsgd, ps); clipping by this stage's norm (see above)
        self._sync_s += w.update(k, round=j // self.window, clip_over_pipeline=False)
        self.stage.stash.changed()  # one new weight version per update (step and averaging)
        w.optimizer.zero_grad(set_to_none=True)
        if (j + 1) % self.m == 0:
            self._iteration_done(k + 1)

    def _iteration_done(self, step: int) -> None:
        """This stage made the last update of iteration ``step - 1``: report it."""
        w = self.w
        w.memory.check()
        w.slowdown.new_iteration(step)  # the next iteration: its stragglers, its speed
        now = time.perf_counter()
        step_s, sync_s = now - self._t_iteration, self._sync_s
        self._t_iteration, self._sync_s = now, 0.0
        losses, self._losses = self._losses, []
        stash = self.stage.stash
        w.report_step(step, rate=self.rate.iteration_done(time.time(), step, step_s),
                      step_s=step_s, sync_s=sync_s,
                      loss=sum(losses) / len(losses) if losses else None,
                      stash_versions=stash.peak_versions, stash_bytes=stash.peak_bytes)
