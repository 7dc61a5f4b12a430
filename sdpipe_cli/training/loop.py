"""A worker's training loop under a flushed schedule (``pipeline.schedule=1f1b``, ``gpipe``,
``zb_h1``, ``interleaved_1f1b`` or ``interleaved_zb``).

Per iteration:

1. the pipeline agrees whether to go on: the first stage decides (with its replicas, where the
   sync strategy needs it) and passes the decision down the pipeline in the control message, so
   that every stage of a pipeline runs exactly the same iterations; while a stop is asked for
   (or the time is up) but the strategy ends the run itself, the message also says so, and a
   strategy that meets its replicas only every few steps meets after this one: a stop is acted
   on at the next step boundary, not at the end of a long block (``sync.every``);
2. the executor runs the schedule's forwards and backwards of m micro-batches (the flush);
3. the worker applies the update: the strategy's gradient sync, clipping by the norm over the
   whole pipeline, the optimizer step, the strategy's weight sync, and the step event;
4. at that consistent point, evaluation and a checkpoint shard, when due.

The asynchronous schedule has its own loop (:mod:`sdpipe_cli.training.async_loop`); both drive a
:class:`~sdpipe_cli.training.worker.Worker` and ask the same
:class:`~sdpipe_cli.core.cadence.Cadence`.
"""

from __future__ import annotations

import time
from typing import cast

from sdpipe_cli.core.cadence import Throughput
from sdpipe_cli.core.interleaved import schedule_of
from sdpipe_cli.pipeline import p2p
from sdpipe_cli.pipeline.interleaved_stage import InterleavedStage
from sdpipe_cli.pipeline.stage import FlushedStage
from sdpipe_cli.training.worker import Worker

__all__ = ["FlushedLoop"]


class FlushedLoop:
    """Trains ``worker``'s stage one flushed iteration at a time."""

    def __init__(self, worker: Worker):
        self.w = worker
        w = worker.where
        p = worker.settings.pipeline
        self.actions = schedule_of(p.schedule, p.chunks)(w.stages, worker.microbatch_count, w.stage)
        self._pending: list[p2p.Pending] = []
        # the worker builds its flushed stage (interleaved: one executor per chunk)
        assert isinstance(worker.stage, (FlushedStage, InterleavedStage))
        self.stage = worker.stage

    def train(self) -> None:
        w = self.w
        w.started()
        started = time.time()
        rate = Throughput(w.batch_size)
        step = w.start_step
        while True:
            control = self._agree(step, started)
            if not control.go:
                break
            if control.last:
                w.sync.meet_now()
            t_step = time.perf_counter()
            w.slowdown.new_iteration(step)
            inputs, targets = w.batch(step)
            w.optimizer.zero_grad(set_to_none=True)
            loss = self.stage.run(self.actions, inputs, targets)
            sync_s = w.update(step)
            self._wait_pending()
            w.memory.check()
            step += 1
            step_s = time.perf_counter() - t_step
            w.report_step(step, rate=rate.iteration_done(time.time(), step, step_s),
                          step_s=step_s, sync_s=sync_s, loss=loss)
            w.consistent_point(step, control.save)
        self._wait_pending()
        w.finish(step)

    def _agree(self, step: int, started: float) -> p2p.Control:
        """Whether the pipeline runs iteration ``step``, whether a time-based checkpoint follows
        it, and whether its replicas should meet after it because the run is to end (``last``);
        the same answer on every stage (the first decides and passes it on)."""
        w, where = self.w, self.w.where
        if where.first:
            timed_out = w.timed_out(started)
            go = w.sync.should_continue(step, w.cadence.local_go(step, timed_out), timed_out)
            control = p2p.Control(go, step, go and w.time_checkpoint(), go and timed_out)
        else:
            control = p2p.receive_control(cast(int, where.prev_rank), step, w.device,
                                          stage=where.stage, offset=w.rank_offset)
        if not where.last:
            self._pending.append(p2p.send_control(control, cast(int, where.next_rank), w.device,
                                                  offset=w.rank_offset))
        return control

    def _wait_pending(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()
