"""How the pipelines share a global batch (``pipeline.balance``): each pipeline's micro-batches
per iteration, a pure decision.

**Why.** A pipeline slower than the others by a little (a GPU generation apart, a throttled
card: 1.1x to about 2x) is the case neither classic design handles: all-reduce waits for it
every iteration, and sdpipe's rounds wait for it too, since a replica that close to the others'
pace is worth waiting for (:func:`~sdpipe_cli.core.replan.pace_bound`); left out instead, it
drifts from the others and costs loss per sample. Giving the slow pipeline fewer micro-batches,
so that its iteration takes no longer than the fast ones', lets every device work at its own
pace while the replicas stay in step: the fast pipelines stop waiting, and a round's mean,
each replica's gradient counted by its samples (:func:`shares`), is the mean gradient of all
the samples the pipelines took, as with equal shares. The global batch shrinks by what the slow
pipeline gives up; the learning rate is the run's.

**The rule** (``speed``). Pipeline ``p``'s iteration at ``m'`` micro-batches takes
``pipeline_ms(p, m')`` (its stages' block times on its devices, the schedule's timeline:
:func:`~sdpipe_cli.core.replan.pipeline_ms`, bubble included). At a pace ``T``, each pipeline
takes the most micro-batches, at most ``pipeline.microbatches`` and in the schedule's grain,
whose iteration fits in ``T`` (within :data:`SLACK`). In lock-step (all-reduce) everyone goes
at the slowest one's pace, so every pace among the pipelines' iteration times is tried and the
one giving the most samples per second taken. Under sdpipe the fastest pipelines set the pace
(they never wait), and a share must not run ahead of it: a replica a little faster than
the others drifts out of their phase and meets them by chance. A pipeline that no share
keeps at the pace takes the whole batch, as without balance: waited for within the mode's pace
bound, else on its own way (sdpipe's rounds tolerate a far straggler); and equal shares are kept when
that is predicted faster by more than :data:`ALONE_MARGIN`. Under sdpipe the integer shares
fit some ratios only (with ``m = 4`` on two stages: 1.25-1.31x, 1.67-1.75x, 2.5-2.62x); a
larger ``m`` fits more. All-reduce takes a share at every ratio.

Static within a leg: the speeds are those the leg starts with (``profile=``'s block times on the
cluster's devices, else every block alike; each device's speed, ``cluster.slowdown`` and the
slowdowns earlier legs measured, ``fault.slowed``). No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sdpipe_cli.core.replan import pipeline_ms

__all__ = ["ALONE_MARGIN", "BALANCES", "SLACK", "Balance", "decide", "grain_of", "shares"]

BALANCES = ("equal", "speed")

#: How much longer than the pace a pipeline's iteration may take and still count as keeping it:
#: the micro-batch a pipeline gives up is a whole one (a quarter of its work at m = 4), so a
#: strict bound would often cut one too many.
SLACK = 0.05

#: How much faster (predicted) equal shares, with a far-off straggler left to go at its own pace,
#: must be before they are kept over balanced ones: a replica left behind meets the others in
#: their rounds (it was measured at 0.51 of their iterations where its speed allows 0.63, one
#: pipeline 1.6x slower) and drifts from them, which the pace model does not count.
ALONE_MARGIN = 0.10


@dataclass(frozen=True)
class Balance:
    """A decision: each pipeline's micro-batches, and the predicted samples/s behind it."""

    microbatches: tuple[int, ...]
    predicted: float  # micro-batches per second of the whole run, at these shares
    equal: float  # the same at equal shares (every pipeline at ``pipeline.microbatches``)
    why: str  # "equal speeds" | "balanced" | "stragglers left behind" | "no share keeps the pace"

    @property
    def balanced(self) -> bool:
        return len(set(self.microbatches)) > 1


def grain_of(schedule_takes_groups: bool, stages: int) -> int:
    """The step of a pipeline's micro-batch count: the stages where the schedule takes
    micro-batches in groups of them (interleaved and zero-bubble ones), else 1."""
    return stages if schedule_takes_groups else 1


def _rate(counts: Sequence[int], times: Sequence[float], together: Sequence[bool]) -> float:
    """Micro-batches per ms: those going together at the slowest of them's pace, the others at
    their own."""
    pace = max((t for t, x in zip(times, together) if x), default=0.0)
    return sum(c / pace if x else c / t for c, t, x in zip(counts, times, together))


def decide(block_ms: Sequence[Sequence[Sequence[float]]], splits: Sequence[Sequence[int]],
           microbatches: int, grain: int, schedule: str, pace_bound: float) -> Balance:
    """Each pipeline's micro-batches (see the module's rule); ``block_ms[p][s][i]``: block i's
    forward and backward time on pipeline p's stage s; ``splits[p]``: its partition;
    ``pace_bound``: how much slower than the fastest a pipeline may be and still pace the
    others under the run's mode (``inf`` in lock-step)."""
    P, m = len(block_ms), int(microbatches)
    options = list(range(grain, m + 1, grain)) or [m]
    # each pipeline's iteration at each share, once (a timeline's makespan is not free, and the
    # paces tried are up to P x m)
    table = {(p, k): pipeline_ms(block_ms[p], splits[p], k, schedule)
             for p in range(P) for k in {*options, m}}

    def time(p: int, k: int) -> float:
        return table[(p, k)]

    full = [time(p, m) for p in range(P)]
    fastest = min(full)
    alone = [t > pace_bound * fastest for t in full]
    equal = _rate([m] * P, full, [not a for a in alone])
    if max(full) <= fastest * (1 + SLACK):
        return Balance(tuple([m] * P), equal, equal, "equal speeds")
    # in lock-step everyone goes at the slowest one's pace, whichever it is; where a pipeline
    # may go its own way, the fastest set the pace (they never wait for a slower one)
    paces = ([fastest] if not math.isinf(pace_bound) else
             sorted({time(p, k) for p in range(P) for k in options if time(p, k) >= fastest}))
    best: tuple[float, tuple[int, ...]] | None = None
    for pace in paces:
        shares = _at_pace(pace, P, m, options, time, full, pace_bound)
        rate = _rate(*shares)
        if best is None or rate > best[0]:
            best = (rate, shares[0])
    if best is None or len(set(best[1])) == 1:
        return Balance(tuple([m] * P), equal, equal, "no share keeps the pace")
    if any(alone) and equal > best[0] * (1 + ALONE_MARGIN):
        return Balance(tuple([m] * P), equal, equal, "stragglers left behind")
    return Balance(best[1], best[0], equal, "balanced")


def _at_pace(pace: float, P: int, m: int, options: Sequence[int], time, full: Sequence[float],
             pace_bound: float) -> tuple[tuple[int, ...], list[float], list[bool]]:
    """Each pipeline's micro-batches at ``pace``, their iteration times, and which go together:
    a pipeline no share keeps at the pace takes the whole batch, and is waited for where the
    mode's pace bound says so (together), else goes its own way. Keeping the pace is
    taking the most micro-batches whose iteration fits in it; where the mode lets a pipeline
    go alone (``pace_bound`` finite), that iteration must also not be shorter than the pace: a
    replica a little slower than the others is waited for and stays in phase with them, one a
    little faster runs ahead, and once a late round parts them it meets them by chance (real
    runs, one pipeline 1.6x slower given 2 micro-batches of 4, 4 % faster than the others:
    mean group 2.25-2.72 and 1.047x all-reduce's loss, against 3.87-3.97 in two seeds of
    three at 1.3x given 3, 4 % slower). Such a pipeline keeps the whole batch instead."""
    counts, times, together = [], [], []
    for p in range(P):
        fits = [k for k in options if time(p, k) <= pace * (1 + SLACK)]
        k = max(fits, default=0)
        if k and (math.isinf(pace_bound) or time(p, k) >= pace * (1 - 1e-9)):
            counts.append(k)
            times.append(time(p, k))
            together.append(True)
        else:  # no share keeps the pace: the whole batch, waited for within the pace bound
            counts.append(m)
            times.append(full[p])
            together.append(full[p] <= pace_bound * pace)
    return tuple(counts), times, together


def shares(counts: Sequence[int]) -> tuple[float, ...]:
    """What each pipeline's gradient counts in a mean over all of them: its part of the samples
    (``()`` when every pipeline takes the same, the plain mean)."""
    if len(set(counts)) <= 1:
        return ()
    total = float(sum(counts))
    return tuple(c / total for c in counts)
