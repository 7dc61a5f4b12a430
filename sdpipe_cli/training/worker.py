"""One worker: stage s of pipeline p, with everything the training loops drive.

A :class:`Worker` holds this stage's slice of the model, its optimizer, its sync strategy, its data
(first and last stages only), the pipeline executor, heterogeneity emulation, and the run's event
channel; it knows how to apply one update, evaluate, save and restore a checkpoint shard, and
report. It owns no loop: :mod:`sdpipe_cli.training.loop` (flushed schedules) and
:mod:`sdpipe_cli.training.async_loop` (asynchronous 1F1B) decide the order of things, through the
public methods here, and :class:`~sdpipe_cli.core.cadence.Cadence` decides when.

"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli import checkpoint
from sdpipe_cli.config.schema import Config, objective
from sdpipe_cli.core.cadence import Cadence
from sdpipe_cli.core.interleaved import virtual_stage
from sdpipe_cli.core.loss_scale import LossScale
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.data import sources
from sdpipe_cli.data.feed import Feed
from sdpipe_cli.hetero.emulation import MemoryLimit, link_delay, make_slowdown
from sdpipe_cli.model import models, optim
from sdpipe_cli.model.boundary import Boundary
from sdpipe_cli.model.layout import carried_or_traced
from sdpipe_cli.pipeline import microbatches, validation
from sdpipe_cli.pipeline.async_stage import AsyncStage
from sdpipe_cli.pipeline.interleaved_stage import InterleavedStage
from sdpipe_cli.pipeline.p2p import Directed
from sdpipe_cli.pipeline.stage import FlushedStage
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.runtime.errors import CheckpointError, Diverged
from sdpipe_cli.runtime.trace import Tracer, trace_path
from sdpipe_cli.sync.strategies import GroupCache, make_sync
from sdpipe_cli.training.busy import BusyTime
from sdpipe_cli.training.tied import TiedCopies

__all__ = ["StageRunner", "Worker", "param_digest"]

# what runs a worker's actions: flushed, interleaved, or (put in place by its loop) asynchronous
StageRunner = FlushedStage | InterleavedStage | AsyncStage

log = logging.getLogger("sdpipe.worker")


def param_digest(module: nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in module.parameters():
        flat = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(flat.data_ptr(), flat.nbytes))  # raw bytes, no numpy needed
    return h.hexdigest()[:16]


class Worker:
    """Stage ``where.stage`` of pipeline ``where.pipeline``.

    ``settings``: the run's config, typed (:mod:`sdpipe_cli.config.settings`): what it builds
    its stage, data and sync from. ``plan``: the run's (its cluster places this worker and
    emulates its speed and links).
    ``groups`` makes the sync strategy's communicators (sdpipe: with ``sync.group_timeout``);
    ``pipeline_groups`` the ones over this pipeline's stages (the global gradient norm), with
    ``run.timeout``: a stage whose group round fails on a lost member spends up to the group
    timeout there, and the other stages of its pipeline must outwait that in the clip's
    all-reduce, or one loss takes a surviving pipeline with it. ``resume``: a verified checkpoint
    folder to start from. ``incarnation``: how many times this pipeline was restarted (a
    restarted worker calls :meth:`rejoin` before it trains); ``rank_offset``: the global rank of
    the default process group's rank 0 (see :mod:`sdpipe_cli.runtime.bootstrap`).
    """

    def __init__(self, settings: Config, where: Placement, plan: RunPlan,
                 device: torch.device, events: dist.Store, groups: GroupCache,
                 pipeline_groups: GroupCache, resume: str | None = None, incarnation: int = 0,
                 rank_offset: int = 0):
        self.settings = cfg = settings  # all it reads: model, data, train, run, fault, ...
        train, run = settings.train, settings.run
        # what this pipeline's stages are built from: the run's split, or its own (the plan's)
        self.partition = partition = plan.partition_of(where.pipeline)
        self.where, self.device, self.events = where, device, events
        self.incarnation, self.rank_offset = incarnation, rank_offset
        self._began = time.monotonic()
        self.traffic = groups.traffic  # what the sync sends, by link class (sync.traffic)
        self.t0 = store.run_clock(events)
        self.cadence = Cadence.of(train, settings.checkpoint, store.limit_spent(events))
        p, s = where.pipeline, where.stage
        # this pipeline's share of the global batch (pipeline.balance): micro-batches, samples
        self.microbatch_count = plan.microbatches_of(p)
        self.batch_size = plan.batch_of(p)
        self.module = models.build_stage_module(cfg, s, partition).to(device)
        # what crosses each cut, which weights are tied: as the launcher found them, or traced
        self.layout = carried_or_traced(plan.layout, plan.microbatch_size, plan.blocks, lambda: models.layout(
            cfg, sources.example(cfg, plan.microbatch_size)[0], plan.microbatch_size))
        self.ties = TiedCopies(models.stage_ties(cfg, s, partition, self.layout), where, incarnation)
        # the stage's parameters, listed once: the optimizer holds these very tensors, so they
        # are the module's for the worker's life (what changes them copies into them)
        self.params = list(self.module.parameters())
        self.optimizer = optim.build_optimizer(self.params, train)
        self.lr = train.lr  # the learning rate of the last update
        self.sync = make_sync(settings.sync, events=events, groups=groups, where=where,
                              device=device, seed=train.seed, optimizer=self.optimizer,
                              incarnation=incarnation, steps=plan.steps,
                              segments=plan.segments, samples=plan.microbatches)
        self.pipeline_groups = pipeline_groups
        self.cluster = plan.cluster
        self.placed = self.cluster.device(p, s)
        self.slowdown = make_slowdown(settings, self.cluster, p, s, lambda: time.time() - self.t0,
                                      partition)
        self.memory = MemoryLimit(self.placed, device)
        self.tracer = (Tracer(where.rank, f"rank {where.rank} (pipeline {p}, stage {s})",
                              lambda: time.time() - self.t0, run.trace_events)
                       if run.trace else None)
        on_action: Callable[..., Any] | None = self.slowdown if self.slowdown.active else None
        before_send, before_action = link_delay(self.cluster, where.rank), None
        if self.tracer is not None:  # around the emulation's: a slow compute shows as compute
            on_action, before_send, before_action = self.tracer.hooks(on_action, before_send)
        # outermost: an emulated slow device's compute counts as its compute
        self.busy = BusyTime(on_action) if settings.fault.on_slowdown != "off" else None
        if self.busy is not None:
            on_action = self.busy
        self._busy_from = 0  # the iteration the busy time is summed from
        self.stage: StageRunner = self._pipeline_stage(plan, before_action, on_action, before_send)
        self.loss_scale = (LossScale(train.loss_scale) if train.precision == "fp16"
                           else None)
        self.skipped = self.skipped_in_a_row = 0  # steps skipped for a non-finite gradient
        self.classify = objective(settings) == "classify"
        self.feed = None
        if where.first or where.last:  # middle stages never touch data
            self.feed = Feed(settings, p, where.pipelines, inputs=where.first, pin_memory=device.type == "cuda",
                             batch_size=self.batch_size)
        self.run_dir = Path(str(settings.run.dir))  # the folder its launch made
        self._last_save = time.monotonic()
        self.start_step = self._restore(Path(resume)) if resume else 0
        self._saved_step = self.start_step  # the step of the last checkpoint (or of the resume)

    def _pipeline_stage(self, plan: RunPlan, before_action: Callable[..., Any] | None,
                        on_action: Callable[..., Any] | None,
                        before_send: Callable[..., Any] | None) -> StageRunner:
        """This worker's executor of a flushed schedule, with the hooks: a
        :class:`FlushedStage`, or an :class:`InterleavedStage` with one executor per model chunk
        (slices of :attr:`module`). Asynchronous 1F1B's loop puts an AsyncStage on the flushed
        stage's executor in its place."""
        cfg, where = self.settings, self.where
        low = models.AUTOCAST.get(self.settings.train.precision)

        def boundaries(piece: int) -> tuple[Boundary | None, Boundary | None]:
            pair = self.layout.stage_boundaries(piece, self.partition)
            if low is None:
                return pair
            # activations and their gradients travel in the low precision
            return (None if pair[0] is None else pair[0].with_floats(low),
                    None if pair[1] is None else pair[1].with_floats(low))

        common = dict(device=self.device, loss_fn=models.loss_function(cfg.model),
                      before_action=before_action, on_action=on_action, before_send=before_send,
                      rank_offset=self.rank_offset, autocast=low,
                      checkpointing=self.settings.pipeline.activation_checkpointing)
        s, S = where.stage, where.stages
        chunks = models.chunk_slices(cfg, s, self.partition, self.layout.blocks)
        if len(chunks) == 1:
            return FlushedStage(self.module, stage=s, num_stages=S, prev_rank=where.prev_rank,
                                next_rank=where.next_rank, boundaries=boundaries(s), **common)
        ranks = [where.rank - s + q for q in range(S)]  # this pipeline's, pipeline-major

        def pipeline_group() -> dist.ProcessGroup:
            return dist.new_group([r - self.rank_offset for r in ranks], use_local_synchronization=True)

        # gradients in a group of their own, so that on NCCL a pair's stream carries one
        # direction (p2p.Directed); two stages are each other's neighbours both ways, so the
        # wrap channel needs groups of its own too
        group = Directed(forward=None, backward=pipeline_group())
        wrap = Directed(pipeline_group(), pipeline_group()) if S == 2 else None
        return InterleavedStage([self.module[c] for c in chunks], s, S, ranks,
                                [boundaries(virtual_stage(s, c, S)) for c in range(len(chunks))],
                                group=group, wrap=wrap, **common)

    def rejoin(self) -> None:
        """A restarted worker: take this stage's state from a live replica, at the point the
        scheduler picks, and go on from the iteration it names (or stop, if the run ended).

        The pipeline's stages are healed one by one; they start together, once all are (the
        scheduler counts the pipeline live only then), and stop together if any of them learnt
        that the run ended first: one all-reduce over the pipeline's own process group.
        """
        step = self.sync.rejoin(self.module)
        ended = torch.tensor([float(self.sync.stop)], device=self.device)
        dist.all_reduce(ended, op=dist.ReduceOp.MAX)
        if ended.item():
            self.sync.stop = True
        if step is not None:
            self.start_step = self._saved_step = step

    def _traced(self, name: str, cat: str):
        return self.tracer.timed(name, cat) if self.tracer is not None else nullcontext()

    def _trace_sync(self, start: float, end: float) -> None:
        """The strategy's part of an update, from ``start`` to ``end`` (run clock): sdpipe's
        wait for its group and the group's all-reduce, else the strategy's communication."""
        if self.tracer is None or end - start < 1e-5:
            return
        stats = self.sync.stats()
        if "wait_s" in stats and "comm_s" in stats:
            comm_start = end - stats["comm_s"]
            self.tracer.span("wait group", "wait", start, comm_start)
            self.tracer.span("group all-reduce", "sync", comm_start, end,
                             "size", stats.get("group_size"), "kind", stats.get("group_kind"))
        else:
            self.tracer.span(f"{self.sync.name} sync", "sync", start, end)

    # -- data ---------------------------------------------------------------------------------
    def microbatches(self, x: Any) -> list[Any]:
        """``x`` (a tensor, or a tuple or dict of them) cut into the micro-batches, on the device."""
        return microbatches.split(x, self.microbatch_count, self.device)

    def _scaled(self) -> None:
        """fp16: the loss scale the last stage multiplies by for the coming backward."""
        if self.loss_scale is not None:
            for executor in self.stage.executors:
                executor.loss_scale = self.loss_scale.value

    def batch(self, step: int) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Iteration ``step``'s micro-batches this stage needs: inputs on the first stage, targets
        on the last, None elsewhere."""
        self._scaled()
        if self.feed is None:
            return None, None
        w, batch = self.where, self.feed.batch(step)
        for name, error in self.feed.new_bad():
            self.emit("unreadable", sample=name, error=error, step=step)
        return (self.microbatches(batch.inputs) if w.first else None,
                self.microbatches(batch.targets) if w.last else None)

    # -- decisions the loops share ------------------------------------------------------------
    def timed_out(self, started: float) -> bool:
        """First stage: the time limit passed since ``started`` or the user asked to stop."""
        return self.cadence.timed_out(time.time() - started,
                                      self.events.check([store.STOP_REQUESTED]))

    def time_checkpoint(self) -> bool:
        """First stage: whether a time-based checkpoint is due; lock-step replicas agree on it
        (a collective: every replica calls this at the same iteration)."""
        if not self.cadence.checkpoint_minutes:
            return False
        return self.sync.agree_on_checkpoint(
            self.cadence.checkpoint_time(time.monotonic() - self._last_save))

    # -- one update ---------------------------------------------------------------------------
    def update(self, iteration: int, round: int | None = None,
               clip_over_pipeline: bool = True) -> float:
        """Apply the accumulated gradients of ``iteration``: the strategy's gradient sync,
        clipping, the optimizer step at the schedule's learning rate and the strategy's weight
        sync for ``round``; returns the seconds spent syncing. A flushed schedule's round is its
        iteration (the default); asynchronous 1F1B's is its update's count, which 2BW's window
        makes differ from the iteration.

        Clipping uses the norm of the whole model's gradient, summed over this pipeline's stages
        (one scalar all-reduce), so a pipeline of S stages takes the step one process holding the
        model would. ``clip_over_pipeline=False`` clips by this stage's own norm (asynchronous
        1F1B, whose stages update at different times: see :mod:`sdpipe_cli.training.async_loop`).
        """
        round = iteration if round is None else round
        if self.loss_scale is not None:  # before any average: replicas may differ in scale
            optim.scale_gradients(self.params, 1.0 / self.loss_scale.value)
        self.ties.reduce_gradients(self.module, self.pipeline_groups)
        own = True  # whether this replica's own gradient is finite (checked where groups mix it)
        if self.loss_scale is None and self.sync.mixes_weights:
            own = self._finite_or_stop(optim.finite_gradients(self.params), iteration,
                                       "this replica's gradient is not finite")
            if not own:  # skipped: share nothing non-finite with the group, take no step
                for p in self.params:
                    if p.grad is not None:
                        p.grad.zero_()
        start, clock = time.perf_counter(), time.time() - self.t0
        self.sync.after_backward(self.module, round)
        sync_s = time.perf_counter() - start
        self._trace_sync(clock, clock + sync_s)
        # The norm of the whole gradient, for clipping and for the divergence guard: summed over
        # the pipeline's stages where they must agree (the clip factor, fp16's or skip's verdict;
        # a stop needs no agreement: a non-finite loss makes every stage's gradient non-finite).
        t, ranks = self.settings.train, self.where.pipeline_ranks()
        agree = t.grad_clip > 0 or self.loss_scale is not None or t.on_nonfinite == "skip"
        over_stages = clip_over_pipeline and len(ranks) > 1 and agree
        with self._traced("clip", "update"):
            norm = optim.clip_gradients(
                self.params, t.grad_clip or float("inf"),
                (lambda t: self.pipeline_groups.all_reduce(
                    t, ranks, incarnations=[self.incarnation] * len(ranks)))
                if over_stages else None, exclude=self.ties.counted_elsewhere(self.module))
        if self.loss_scale is not None:
            step = self.loss_scale.update(math.isfinite(norm))
            if self.loss_scale.exhausted:  # no scale left to halve: stop or skip as fp32 would
                self._finite_or_stop(False, iteration, f"the gradient norm is {norm} at loss scale 1")
        else:  # lock-step replicas share a non-finite average: they all skip or stop alike
            step = self._finite_or_stop(math.isfinite(norm), iteration,
                                        f"the gradient norm is {norm}") and own
        if step:
            self.skipped_in_a_row = 0
        # Lock-step modes are at ``iteration``; sdpipe follows the run's global progress.
        self.lr = optim.lr_at(self.sync.position(iteration), self.settings.train)
        optim.set_lr(self.optimizer, self.lr)
        if self.sync.local_step and step:
            with self._traced("optimizer step", "update"):
                self.optimizer.step()
        start, clock = time.perf_counter(), time.time() - self.t0
        self.sync.after_step(self.module, round)
        if self.sync.mixes_weights:
            self.ties.retie(self.module, self.pipeline_groups)
        after_s = time.perf_counter() - start
        self._trace_sync(clock, clock + after_s)
        return sync_s + after_s

    def _finite_or_stop(self, finite: bool, iteration: int, what: str) -> bool:
        """Whether the step may go on: yes if ``finite``; with ``train.on_nonfinite=skip`` no,
        up to ``train.max_skipped`` times in a row; else the run stops here (:class:`Diverged`),
        before the optimizer step, before any group averages this replica's state (where groups
        mix it, its own gradient is checked before the round) and before a checkpoint could
        hold it. ``what``: the value at fault, for the message."""
        if finite:
            return True
        self.skipped += 1
        self.skipped_in_a_row += 1
        t, w = self.settings.train, self.where
        where = f"at step {iteration + 1} (pipeline {w.pipeline}, stage {w.stage})"
        if t.on_nonfinite == "skip" and self.skipped_in_a_row <= t.max_skipped:
            log.warning("%s %s: step skipped (%d in a row)", what, where, self.skipped_in_a_row)
            return False
        # the scheduler may still be completing the last checkpoint: name the run, whose latest
        # complete checkpoint `sdpipe resume` takes
        then = (f"go back to its latest checkpoint with a lower rate: sdpipe resume {self.run_dir} "
                "train.lr=..." if self._saved_step > 0 or checkpoint.latest(self.run_dir) is not None
                else "no checkpoint was written yet; start again with a lower train.lr")
        again = f", {self.skipped_in_a_row} steps in a row" if t.on_nonfinite == "skip" else ""
        raise Diverged(f"training diverged: {what} {where}{again}; {then}")

    # -- consistent points ----------------------------------------------------------------------
    def consistent_point(self, step: int, save: bool) -> None:
        """Iteration ``step`` is done on every stage of the pipeline: evaluate if due, and save a
        checkpoint if the strategy or the cadence says one is due, or ``save`` (a time-based one)
        asks."""
        if self.cadence.evaluate_after(step):
            with self._traced("eval", "eval"):
                self.evaluate(step)
        if self.sync.scheduled_checkpoints:
            ckpt = self.sync.checkpoint_due()
        else:
            ckpt = step if self.cadence.checkpoint_after(step) else None
        if ckpt is None and save:
            ckpt = step
        if ckpt is not None:
            with self._traced("checkpoint", "checkpoint"):
                self.save(ckpt, step)

    def finish(self, step: int, **extra: Any) -> None:
        """The run ended after iteration ``step`` at a consistent point: the final checkpoint,
        evaluation and weights, and the ``done`` event (with ``extra`` fields)."""
        settings, w = self.settings, self.where
        self.sync.finish()
        if (settings.checkpoint.on_exit and not self.sync.scheduled_checkpoints
                and step != self._saved_step):
            self.save(step, step)  # lock-step modes: every replica stopped at this step
        trained = step > self.start_step or not self.incarnation  # a restart may end unhealed
        if self.cadence.final_evaluation(step) and trained:
            self.evaluate(step)  # always once at the end of the run
        if settings.run.save_final:
            final = self.run_dir / checkpoint.FINAL
            final.mkdir(exist_ok=True)
            name = checkpoint.final_name(w.pipeline, w.stage)
            checkpoint.save_shard(final, name, {k: v.detach().cpu()
                                                for k, v in self.module.state_dict().items()})
        if self.tracer is not None:
            self.tracer.write(trace_path(self.run_dir, w.rank))
        if self.feed is not None:
            self.feed.close()
            extra.update(unreadable=len(self.feed.seen_bad), unreadable_reads=self.feed.bad_reads)
        if self.incarnation:
            extra["healed"] = trained
        self.emit("done", steps=step, samples=step * self.batch_size, param_digest=param_digest(self.module),
                  device=self.placed.name, slowdown_overruns=self.slowdown.overruns,
                  actions=self.slowdown.actions, straggled=self.slowdown.straggled,
                  peak_memory_mb=round(self.memory.peak_mb(), 1),
                  traffic=self.traffic.summary(), wall_s=round(time.monotonic() - self._began, 4),
                  **extra)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, ckpt: int, step: int) -> None:
        """This rank's shard of checkpoint ``ckpt``; the scheduler finalizes it once all are in."""
        w = self.where
        bad = next((name for name, t in self.module.state_dict().items()
                    if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:  # never a checkpoint that a resume would inherit the divergence from
            raise Diverged(f"{bad} (pipeline {w.pipeline}, stage {w.stage}) is not finite at step {step}; "
                           f"checkpoint {ckpt} was not written")
        state = {"step": step, "pipeline": w.pipeline, "stage": w.stage,
                 "model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}
        if self.feed is not None:
            state["data"] = self.feed.state_dict(step)
        sync_state = self.sync.state_dict()
        if sync_state:
            state["sync"] = sync_state
        checkpoint.save_shard(checkpoint.staging_dir(self.run_dir, ckpt), str(w.rank), state)
        self._last_save, self._saved_step = time.monotonic(), step
        self.emit("saved", checkpoint=ckpt, step=step)

    def _restore(self, ckpt: Path) -> int:
        """Load this rank's shard (checksum verified, weights only); returns the step to go on from."""
        state = checkpoint.load_shard(ckpt, str(self.where.rank))
        path = ckpt / checkpoint.shard_name(str(self.where.rank))
        if not isinstance(state.get("step"), int) or state["step"] < 0:
            raise CheckpointError(path, "lacks a valid 'step'")
        rng = state.get("rng")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise CheckpointError(path, "lacks a valid 'rng' state (a uint8 tensor)")
        checkpoint.check_tensors(path, "model", self.module.state_dict(), state.get("model"))
        checkpoint.check_optimizer(path, self.optimizer, state.get("optimizer"))
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(rng)
        if "sync" in state:  # the strategy's own state (sync=diloco: its anchor and momentum)
            self.sync.load_state_dict(state["sync"])
        if self.feed is not None and "data" in state:
            self.feed.load_state_dict(state["data"])
        elif self.feed is not None:
            log.warning("%s holds no data position (an older checkpoint): the data stream goes on "
                        "from the step's usual place, unchecked", ckpt)
        log.info("resumed from %s at step %d", ckpt, state["step"])
        return int(state["step"])

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        """Validation loss of this pipeline's replica on the fixed validation batches."""
        w = self.where
        count = sources.val_count(self.settings)
        batches = ([(None, None)] * count if self.feed is None else
                   ((b.inputs, b.targets) for b in self.feed.validation(count)))
        self.module.eval()
        outcome = validation.validate(self.stage, batches, self.settings.pipeline.microbatches,
                                      first=w.first, last=w.last, classify=self.classify,
                                      device=self.device)
        self.module.train()
        if outcome is not None:
            extra = {} if outcome.accuracy is None else {"val_accuracy": outcome.accuracy}
            self.emit("eval", step=step, val_loss=outcome.loss,
                      samples=step * self.batch_size, **extra)

    # -- events ----------------------------------------------------------------------------------
    def started(self) -> None:
        self.emit("start", pid=os.getpid())
        self.sync.started()

    def report_step(self, step: int, *, rate: float, step_s: float, sync_s: float,
                    loss: float | None, **extra: Any) -> None:
        """The step event of iteration ``step`` (done), if the cadence logs it; the loss only
        from the last stage, which has it."""
        if not self.cadence.log_after(step):
            return
        fields = {"loss": loss} if self.where.last and loss is not None else {}
        since = max(self._busy_from, self.start_step)  # a resume or a heal starts there
        if self.busy is not None and step > since:
            fields["busy_s"] = self.busy.take() / (step - since)
            self._busy_from = step
        if self.loss_scale is not None:
            fields.update(loss_scale=self.loss_scale.value, skipped_steps=self.loss_scale.skipped)
        elif self.skipped:
            fields["skipped_steps"] = self.skipped
        if self.feed is not None:
            fields["data_s"] = round(self.feed.waited_s, 6)
        self.emit("step", step=step, samples=step * self.batch_size,
                  samples_per_s=rate, lr=self.lr, step_s=step_s, compute_s=step_s - sync_s,
                  sync_s=sync_s, straggled=self.slowdown.straggled, **extra,
                  **self.sync.stats(), **self.traffic.take(), **fields)

    def emit(self, kind: str, **fields: Any) -> None:
        w = self.where
        now = round(time.time() - self.t0, 4)
        message: protocol.Saved | protocol.Report
        if kind == "saved":
            message = protocol.Saved(w.rank, w.pipeline, w.stage, fields["checkpoint"],
                                     fields["step"], self.incarnation, now)
        else:
            message = protocol.Report(kind, w.rank, w.pipeline, w.stage, now, self.incarnation,
                                      fields)
        store.push(self.events, store.EVENTS, message)
