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
stage, the others behind it at the bottleneck's pace). How the pipelines' paces make the run's depends on the
sync mode: a lock-step mode (``allreduce``, ``adpsgd``, ``diloco``) waits for its slowest
pipeline every round, so its samples/s are ``P x batch / slowest``; sdpipe (and ``none``,
``ps``) lets every pipeline go at its own pace, so they are the sum of the pipelines' own.

**One split for all pipelines.** Every replica of a stage holds the same blocks (a stage's
replicas average flat weight vectors), so a new split applies to every pipeline. Under a
lock-step mode that is what the run needs: the slow device's pipeline is everyone's pace. Under
sdpipe, taking blocks off the slow device's stage speeds its pipeline up but slows the other
pipelines' same stage down, and the sum may drop: then the decision is *no*, and says why.

**Moving** stops the run at a consistent point (the next global sync under sdpipe, the next
iteration in lock-step, the next outer step with diloco), writes a checkpoint and starts again
from it resharded to the new split: ``restart_s`` (the run's own measured start-up) plus the
checkpoint's bytes passed :data:`DISK_PASSES` times at ``disk_bytes_per_s`` (written, read and
written again resharded, verified, loaded). A re-plan must also gain at least :data:`MIN_GAIN` of the run's pace: a
split a few percent better is not worth a restart's risk.

No I/O and no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sdpipe_cli.core.partition import device_cost, plan, stage_ranges

__all__ = ["Proposal", "pipeline_ms", "run_rate", "propose", "scaled", "MIN_GAIN"]

MIN_GAIN = 1.05  # the least predicted gain of the run's samples/s that is worth a restart
DISK_PASSES = 5  # the checkpoint written, read, written resharded, verified and loaded


@dataclass(frozen=True)
class Proposal:
    """What the measured speeds call for, and whether it is worth it."""

    current: list[int]  # the split now (boundaries)
    bounds: list[int]  # the split the speeds call for
    rate_now: float  # predicted samples/s of the run under ``current``
    rate_new: float  # and under ``bounds``
    move_s: float  # predicted seconds moving costs
    gain_s: float  # predicted seconds saved over the rest of the run (before moving)
    go: bool
    reason: str  # one line for the record and the console

    def record(self) -> dict:
        """The ``replan`` line's fields."""
        return {"partition": self.current, "proposed": self.bounds, "go": self.go,
                "rate_now": round(self.rate_now, 4), "rate_new": round(self.rate_new, 4),
                "move_s": round(self.move_s, 3), "gain_s": round(self.gain_s, 3),
                "reason": self.reason}


def scaled(block_ms: Sequence[Sequence[Sequence[float]]],
           slowed: dict[tuple[int, int], float]) -> list[list[list[float]]]:
    """``block_ms[p][s][i]`` with the device of (p, s) slower by ``slowed[(p, s)]`` (default 1)."""
    return [[[t * slowed.get((p, s), 1.0) for t in row] for s, row in enumerate(rows)]
            for p, rows in enumerate(block_ms)]


def pipeline_ms(block_ms: Sequence[Sequence[float]], bounds: Sequence[int],
                microbatches: int) -> float:
    """One pipeline's iteration, in ms: the sum of its stages' times plus ``m - 1`` times its
    slowest, where ``block_ms[s][i]`` is block i's forward and backward time per micro-batch on
    its stage s's device."""
    blocks = len(block_ms[0])
    times = [sum(block_ms[s][a:b]) for s, (a, b) in enumerate(stage_ranges(bounds, blocks))]
    return sum(times) + (microbatches - 1) * max(times)


def run_rate(block_ms: Sequence[Sequence[Sequence[float]]], bounds: Sequence[int],
             microbatches: int, batch_size: int, lock_step: bool) -> float:
    """The run's predicted samples/s (``block_ms[p][s][i]``: see :func:`pipeline_ms`)."""
    times = [pipeline_ms(row, bounds, microbatches) / 1e3 for row in block_ms]
    if lock_step:
        return len(times) * batch_size / max(times)
    return sum(batch_size / t for t in times)


def propose(block_ms: Sequence[Sequence[Sequence[float]]], current: Sequence[int],
            microbatches: int, batch_size: int, lock_step: bool, samples_left: float,
            restart_s: float, state_bytes: float, disk_bytes_per_s: float = 200e6) -> Proposal:
    """The re-plan the speeds in ``block_ms`` call for, with ``samples_left`` of the run's
    budget still to train and a checkpoint of ``state_bytes`` (weights and optimizer state of
    the whole run) to write and read back."""
    blocks, stages = len(block_ms[0][0]), len(block_ms[0])
    current = [int(b) for b in current]
    bounds = plan(device_cost(block_ms), blocks, stages).bounds
    now = run_rate(block_ms, current, microbatches, batch_size, lock_step)
    new = run_rate(block_ms, bounds, microbatches, batch_size, lock_step)
    move_s = restart_s + DISK_PASSES * state_bytes / disk_bytes_per_s
    gain_s = samples_left / now - samples_left / new if now > 0 and new > 0 else 0.0
    if bounds == current:
        go, reason = False, "the split is already the one these speeds call for"
    elif new < MIN_GAIN * now:
        pace = "the slowest pipeline's" if lock_step else "the sum of the pipelines'"
        go, reason = False, (f"predicted {new:.1f} samples/s against {now:.1f} now ({pace}): "
                             f"less than {MIN_GAIN:g}x")
    elif gain_s <= move_s:
        go, reason = False, (f"saves {gain_s:.1f} s over the rest of the run, moving costs "
                             f"{move_s:.1f} s")
    else:
        go, reason = True, (f"predicted {new:.1f} samples/s against {now:.1f} now; saves "
                            f"{gain_s:.1f} s, moving costs {move_s:.1f} s")
    return Proposal(current, bounds, now, new, move_s, gain_s, go, reason)
