"""Whether to re-plan the pipeline's split after a device slowed down: a pure decision.

The split chosen at the start (``pipeline.partition``, ``auto`` from a profile) is wrong once a
device slows down: its stage sets the pace of its pipeline. Given each device's block times at
the speeds measured now (the profile's, times the slowdown the detector measured,
:mod:`sdpipe_cli.core.slowdowns`), this asks the partitioner of ``pipeline.partition=auto``
(:func:`~sdpipe_cli.core.partition.plan` over :func:`~sdpipe_cli.core.partition.device_cost`)
for the split those speeds call for, predicts the run's samples/s under the current split and
under that one, and re-plans only when the time it saves over the rest of the run exceeds the
time moving costs.

**The run's pace.** A pipeline's iteration takes the sum of its stages' times per micro-batch
plus ``m - 1`` times its slowest stage's (1F1B and GPipe alike: one micro-batch through every
stage, the others behind it at the bottleneck's pace). How the pipelines' paces make the run's
depends on who waits for whom (:func:`pace_bound`): a lock-step mode (``allreduce``, ``adpsgd``,
``diloco``) waits for its slowest pipeline every round, so its samples/s are
``P x batch / slowest``. sdpipe's rounds wait for the replicas forecast within ``sync.patience``
x the opener's own interval (:mod:`sdpipe_cli.core.grouping`), so the pipelines within
``1 + patience`` of the fastest meet in full groups at the slowest of them's pace, and a pipeline
slower than that goes at its own: re-splitting a slowed pipeline until it is *nearly* as fast as
the others makes the groups wait for it, and the run gains nothing. (Measured, not assumed:
``docs/results/replan_sdpipe.md``.) Modes without rounds add the pipelines' own paces.

**Whose split changes.** Under a lock-step mode (``allreduce``, ``adpsgd``, ``diloco``) every
replica of a stage holds the same blocks (it averages flat vectors with the others every round),
so one split serves every pipeline, and that is what the run needs: the slow device's pipeline is
everyone's pace. sdpipe averages per segment of blocks (:mod:`~sdpipe_cli.core.segments`), so
each pipeline gets the split its own devices call for, and only the pipelines whose call changed
are re-split (``pipeline.partitions``): the others keep theirs. Either way, a split the run was
given against the profile's advice (``uniform``, an explicit one) is not taken back for a
slowdown that does not change that advice.

**Moving** stops the run at a consistent point (the next global sync under sdpipe, the next
iteration in lock-step, the next outer step with diloco), writes a checkpoint and starts again
from it resharded to the new split: ``restart_s`` (the run's own measured start-up) plus the
checkpoint's bytes passed :data:`DISK_PASSES` times at ``disk_bytes_per_s`` (written, read and
written again resharded, verified, loaded). A re-plan must also gain at least :data:`MIN_GAIN` of the run's pace: a
split a few percent better is not worth a restart's risk.

No I/O and no clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sdpipe_cli.core.grouping.prediction import AWAIT_PACE_RATIO
from sdpipe_cli.core.interleaved import CHUNKED, CHUNKED_SCHEDULES, stage_blocks
from sdpipe_cli.core.iteration_plan import IterationPlan
from sdpipe_cli.core.meetings import setting
from sdpipe_cli.core.partition import device_cost, plan, plan_chunks
from sdpipe_cli.core.schedule import SPLIT_SCHEDULES

__all__ = ["Proposal", "as_config", "called_for", "move_cost", "pace_bound", "pipeline_ms",
           "run_rate", "propose", "scaled", "slowest_iteration", "splits_field", "MIN_GAIN"]

MIN_GAIN = 1.05  # the least predicted gain of the run's samples/s that is worth a restart
DISK_PASSES = 5  # the checkpoint written, read, written resharded, verified and loaded


@dataclass(frozen=True)
class Proposal:
    """What the measured speeds call for, and whether it is worth it."""

    current: list[list[int]]  # each pipeline's split now (boundaries)
    bounds: list[list[int]]  # each pipeline's split the speeds call for
    rate_now: float  # predicted samples/s of the run under ``current``
    rate_new: float  # and under ``bounds``
    move_s: float  # predicted seconds moving costs
    gain_s: float  # predicted seconds saved over the rest of the run (before moving)
    go: bool
    reason: str  # one line for the record and the console

    def record(self) -> dict:
        """The ``replan`` line's fields (the splits as :func:`splits_field` writes them)."""
        return {"partition": splits_field(self.current), "proposed": splits_field(self.bounds),
                "go": self.go, "rate_now": round(self.rate_now, 4),
                "rate_new": round(self.rate_new, 4), "move_s": round(self.move_s, 3),
                "gain_s": round(self.gain_s, 3), "reason": self.reason}

    def change(self) -> str:
        """The change in words: ``[4, 8] -> [5, 9]``, or per pipeline where they differ."""
        if _alike(self.current) and _alike(self.bounds):  # one split for all
            return f"{self.current[0]} -> {self.bounds[0]}"
        return "; ".join(f"pipeline {p}: {c} -> {b}"
                         for p, (c, b) in enumerate(zip(self.current, self.bounds)) if c != b)


def as_config(splits: Sequence[Sequence[int]], shared: Sequence[int]
              ) -> tuple[list[int], dict[int, list[int]]]:
    """Splits as a config gives them: ``pipeline.partition`` (``shared`` unless every pipeline
    has the same) and ``pipeline.partitions`` (the pipelines split otherwise)."""
    each = [[int(b) for b in bounds] for bounds in splits]
    if _alike(each):
        return each[0], {}
    common = [int(b) for b in shared]
    return common, {p: b for p, b in enumerate(each) if b != common}


def splits_field(splits: Sequence[Sequence[int]]) -> list:
    """Splits for a record: one list when every pipeline has it, else one per pipeline."""
    each = [list(b) for b in splits]
    return each[0] if _alike(each) else each


def _alike(splits: Sequence[Sequence[int]]) -> bool:
    """Whether every pipeline has the same split."""
    return all(list(b) == list(splits[0]) for b in splits)


def scaled(block_ms: Sequence[Sequence[Sequence[float]]],
           slowed: dict[tuple[int, int], float]) -> list[list[list[float]]]:
    """``block_ms[p][s][i]`` with the device of (p, s) slower by ``slowed[(p, s)]`` (default 1)."""
    return [[[t * slowed.get((p, s), 1.0) for t in row] for s, row in enumerate(rows)]
            for p, rows in enumerate(block_ms)]


def pipeline_ms(block_ms: Sequence[Sequence[float]], bounds: Sequence[int],
                microbatches: int, schedule: str = "1f1b") -> float:
    """One pipeline's iteration, in ms: the sum of its stages' times plus ``m - 1`` times its
    slowest, where ``block_ms[s][i]`` is block i's forward and backward time per micro-batch on
    its stage s's device. Interleaved (``bounds`` cutting ``v x S`` pieces) or with a split
    backward (``schedule`` zb_h1, interleaved_zb): the schedule's own timeline
    (:meth:`~sdpipe_cli.core.iteration_plan.IterationPlan.makespan`), each chunk's action its
    blocks' time (a forward a third of it, a backward two thirds, each of ``B`` and ``W`` half
    that), since pieces of unequal length leave bubbles no closed formula sees, and a ``W``
    fills some of them."""
    stages = len(block_ms)
    held = stage_blocks(bounds, len(block_ms[0]), stages)
    chunks = (len(bounds) + 1) // stages
    if chunks == 1 and schedule not in SPLIT_SCHEDULES:  # 1F1B's formula, as written, to the bit
        times = [sum(sum(block_ms[s][a:b]) for a, b in ranges) for s, ranges in enumerate(held)]
        return sum(times) + (microbatches - 1) * max(times)
    piece = [[sum(block_ms[s][a:b]) for a, b in ranges] for s, ranges in enumerate(held)]
    own = schedule in CHUNKED or (schedule in SPLIT_SCHEDULES and chunks == 1)
    timeline = schedule if own else CHUNKED_SCHEDULES[0]  # pieces without a chunked schedule named
    return _timeline(timeline, stages, microbatches, chunks).makespan(
        lambda s, backward, c: piece[s][c] * (2 if backward else 1) / 3)


@functools.lru_cache(maxsize=8)
def _timeline(schedule: str, stages: int, microbatches: int, chunks: int) -> IterationPlan:
    """The iteration's plan (a split's search times hundreds of splits on it)."""
    return IterationPlan(schedule, stages, microbatches, chunks)


def pace_bound(lock_step: bool, sync: Any = None) -> float:
    """How much slower than the fastest pipeline a pipeline may be and still pace the others,
    before anything is measured: every one under a lock-step mode (and sdpipe with
    ``sync.connect_every=1``); under sdpipe's forecasts, ``1 + sync.patience`` with the classic
    policy, and with cost_aware the replicas it holds alike (``AWAIT_PACE_RATIO``; the scheduler
    predicts with what it measures, ``GroupScheduler.tolerance``); none (1) where nobody waits."""
    if lock_step or (sync is not None and int(setting(sync, "connect_every", 0) or 0) == 1):
        return math.inf
    patience = float(setting(sync, "patience", 0.0) or 0.0) if sync is not None else 0.0
    if patience and setting(sync, "policy", "cost_aware") == "cost_aware":
        return AWAIT_PACE_RATIO
    return 1.0 + patience


def run_rate(block_ms: Sequence[Sequence[Sequence[float]]], splits: Sequence[Sequence[int]],
             microbatches: int, batch_size: int, pace: float, schedule: str = "1f1b") -> float:
    """The run's predicted samples/s with pipeline p split at ``splits[p]`` (``block_ms[p][s][i]``:
    see :func:`pipeline_ms`): the pipelines within ``pace`` x the fastest one's iteration go at
    the slowest of them's pace (:func:`pace_bound`), the others at their own."""
    times = [pipeline_ms(row, bounds, microbatches, schedule) / 1e3
             for row, bounds in zip(block_ms, splits)]
    together = [t for t in times if t <= pace * min(times)]
    return (len(together) * batch_size / max(together)
            + sum(batch_size / t for t in times if t > pace * min(times)))


def called_for(block_ms: Sequence[Sequence[Sequence[float]]], own: bool,
               chunks: int = 1, microbatches: int = 0, schedule: str = "1f1b") -> list[list[int]]:
    """Each pipeline's split at these speeds: its own devices' best (``own``: the mode averages
    per segment), else the best of one split for all (the partitioner of ``auto``); with
    ``chunks`` a stage, into ``chunks x S`` pieces (:func:`~sdpipe_cli.core.partition.plan_chunks`),
    judged by their iteration's timeline under ``schedule`` with ``microbatches`` where that is
    given."""
    blocks, stages = len(block_ms[0][0]), len(block_ms[0])

    def best(rows: Sequence[Sequence[Sequence[float]]]) -> list[int]:
        cost = device_cost(rows)
        if chunks == 1:
            return plan(cost, blocks, stages).bounds
        judge = slowest_iteration(rows, microbatches, schedule) if microbatches else None
        return plan_chunks(cost, blocks, stages, chunks, judge).bounds

    if own:
        return [best([rows]) for rows in block_ms]
    return [best(block_ms)] * len(block_ms)


def slowest_iteration(block_ms: Sequence[Sequence[Sequence[float]]], microbatches: int,
                      schedule: str = "1f1b") -> Callable[[Sequence[int]], float]:
    """What the interleaved partitioner lowers (``plan_chunks``'s ``judge``), at a run's start
    (``partition=auto``) as at a re-plan: a split's slowest pipeline's iteration, on the
    schedule's own timeline (:func:`pipeline_ms`); balancing the stages' sums alone leaves
    pieces of one block and of four on a stage, and the bubbles between them."""
    return lambda bounds: max(pipeline_ms(row, bounds, microbatches, schedule) for row in block_ms)


def move_cost(restart_s: float, state_bytes: float, bytes_per_s: float, changed: int,
              pipelines: int, in_place: bool) -> float:
    """What moving costs, in seconds of the whole run's time: the run stops, writes its
    checkpoint, reads it back resharded and starts again; or, in place (fewer than all
    pipelines change), only the ``changed`` pipelines stop, for a start-up and a copy of
    their state from the others, while the rest go on."""
    if in_place and 0 < changed < pipelines:
        share = changed / pipelines
        return share * (restart_s + state_bytes * share / bytes_per_s)
    return restart_s + DISK_PASSES * state_bytes / bytes_per_s


def propose(block_ms: Sequence[Sequence[Sequence[float]]], current: Sequence[Sequence[int]],
            advised: Sequence[Sequence[int]], microbatches: int, batch_size: int,
            pace: float, own: bool, samples_left: float, restart_s: float,
            state_bytes: float, disk_bytes_per_s: float = 200e6,
            in_place: bool = False, schedule: str = "1f1b") -> Proposal:
    """The re-plan the speeds in ``block_ms`` call for, with ``samples_left`` of the run's
    budget still to train and a checkpoint of ``state_bytes`` (weights and optimizer state of
    the whole run) to write and read back. ``current``: each pipeline's split now; ``advised``:
    what :func:`called_for` gave at the speeds the leg began with (a split given against that
    advice is kept while the advice stays); ``pace``: :func:`pace_bound`; ``own``: pipelines
    may be split apart. ``in_place``: pipelines re-split while the others go on, so that
    moving stops only their share of the run, for a restart and a copy of their state from
    the others (:func:`move_cost`). Iterations are timed as ``schedule`` runs them
    (:func:`pipeline_ms`)."""
    now_split = [[int(b) for b in bounds] for bounds in current]
    wanted = called_for(block_ms, own, (len(now_split[0]) + 1) // len(block_ms[0]), microbatches,
                        schedule)
    kept = [p for p, (c, w, a) in enumerate(zip(now_split, wanted, advised)) if w == list(a) != c]
    bounds = [c if p in kept else w for p, (c, w) in enumerate(zip(now_split, wanted))]
    now = run_rate(block_ms, now_split, microbatches, batch_size, pace, schedule)
    new = run_rate(block_ms, bounds, microbatches, batch_size, pace, schedule)
    changed = sum(1 for c, b in zip(now_split, bounds) if c != b)
    move_s = move_cost(restart_s, state_bytes, disk_bytes_per_s, changed, len(now_split),
                       in_place)
    gain_s = samples_left / now - samples_left / new if now > 0 and new > 0 else 0.0
    if bounds == now_split and kept:
        go, reason = False, (f"{wanted[kept[0]]} is what the profile advised at the start too; "
                             f"the run's own split {now_split[kept[0]]} was given")
    elif bounds == now_split:
        go, reason = False, "the split is already the one these speeds call for"
    elif new < MIN_GAIN * now:
        who = ("the slowest pipeline's pace" if math.isinf(pace) else
               "the pipelines' own paces" if pace <= 1.0 else
               f"pipelines within {pace:g}x of the fastest meet at the slowest one's pace")
        go, reason = False, (f"predicted {new:.1f} samples/s against {now:.1f} now ({who}): "
                             f"less than {MIN_GAIN:g}x")
    elif gain_s <= move_s:
        go, reason = False, (f"saves {gain_s:.1f} s over the rest of the run, moving costs "
                             f"{move_s:.1f} s")
    else:
        go, reason = True, (f"predicted {new:.1f} samples/s against {now:.1f} now; saves "
                            f"{gain_s:.1f} s, moving costs {move_s:.1f} s")
    return Proposal(now_split, bounds, now, new, move_s, gain_s, go, reason)
