"""The wire between a stage's replicas, as a run measures it, and the meetings it asks for.

A cluster file may describe its links (``cluster.links``), and the launcher then chooses how
often sdpipe's replicas meet from those numbers (:func:`~sdpipe_cli.core.meetings.choose`). A
real cluster's links are rarely described, and described ones are a guess: shared with other
jobs, rate-limited, a rack away. Meeting every iteration in float32 over 15 Mbit/s put 61 % of a
replica's time on the wire, and sent twice all-reduce's bytes, while the same run with H = 14
and bfloat16 set by hand went 7x faster at all-reduce's loss.

So where a run's stage replicas sit on different nodes and nothing is described, the workers
measure before they meet for the first time: each stage's replicas time a few all-reduces of
their stage's own size over the real links (:class:`Probe`, fitted to :class:`LinkFit`), and
every worker times its first iteration's compute. :func:`decide` turns those reports into the
same :class:`~sdpipe_cli.core.meetings.Choice` the described links would have given: the
fastest pipeline's iteration against one meeting of every replica of the costliest stage.

Pure: no I/O, no torch. The transport (who probes, who decides, the store keys) is
:mod:`sdpipe_cli.sync.wire_probe`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sdpipe_cli.core.meetings import BYTES, Choice, choose

__all__ = ["LinkFit", "Probe", "Measured", "ring_bytes", "decide", "WirePace", "Blocks"]


def ring_bytes(members: int, nbytes: float) -> float:
    """What a ring all-reduce of ``nbytes`` over ``members`` puts through each member's link:
    2 (k - 1) / k of it (and as much in)."""
    return 0.0 if members < 2 else 2 * (members - 1) / members * nbytes


@dataclass(frozen=True)
class LinkFit:
    """A link's cost as ``latency_s + moved / bytes_per_s`` for the bytes a member moves."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, moved: float) -> float:
        return self.latency_s + moved / self.bytes_per_s

    @property
    def mbit_s(self) -> float:
        return self.bytes_per_s * 8 / 1e6


def meeting_s(links: Iterable[tuple[LinkFit, int, int]]) -> dict[str, float]:
    """A meeting's seconds in each precision: the slowest of ``(link, members, values)``
    rings, each moving its values through its link."""
    links = list(links)
    return {p: max(fit.seconds(ring_bytes(k, n * size)) for fit, k, n in links)
            for p, size in BYTES.items()}


@dataclass(frozen=True)
class Probe:
    """What one replica timed: the fastest of its small all-reduces (``small_s``, of
    ``small_bytes``: the latency) and its all-reduce of the whole stage (``large_s``, of
    ``large_bytes``), over ``members`` replicas."""

    members: int
    small_bytes: int
    small_s: float
    large_bytes: int
    large_s: float

    def fit(self) -> LinkFit:
        """The link from two points. The bandwidth is the large all-reduce's bytes over its time
        beyond the small one's; a large all-reduce no slower than the small one (a link much
        faster than the clock can tell) is taken as the bytes over the whole time, a lower bound
        that is still fast."""
        small = ring_bytes(self.members, self.small_bytes)
        large = ring_bytes(self.members, self.large_bytes)
        latency = max(0.0, self.small_s)
        beyond = self.large_s - latency
        if large <= small or beyond <= 0:
            return LinkFit(latency, max(large, 1.0) / max(self.large_s, 1e-9))
        return LinkFit(latency, (large - small) / beyond)


@dataclass(frozen=True)
class Measured:
    """One worker's report: where it is, its first iteration's compute (``step_s``), the values
    its stage averages in a round (``values``) and its probe of the links to its replicas."""

    pipeline: int
    stage: int
    step_s: float
    values: int
    probe: Probe


def decide(reports: Sequence[Measured], share: float, every: int = 0, precision: str = "auto",
           most: int = 0) -> Choice:
    """The meetings the measured wire asks for (:func:`~sdpipe_cli.core.meetings.choose`): the
    fastest pipeline's iteration (a pipeline's iteration is its slowest stage's, which every
    stage of a flushed schedule waits for), against the costliest stage's meeting of all its
    replicas in each precision, each replica's fit applied to its stage's bytes (the slowest
    replica's link bounds the ring). ``every``, ``precision`` and ``most`` as in ``choose``."""
    if not reports:
        raise ValueError("no measurements")
    per_pipeline: dict[int, float] = {}
    for r in reports:
        per_pipeline[r.pipeline] = max(per_pipeline.get(r.pipeline, 0.0), r.step_s)
    iteration_s = max(min(per_pipeline.values()), 1e-6)
    round_s = meeting_s((r.probe.fit(), r.probe.members, r.values) for r in reports)
    return choose(iteration_s, round_s, share, every, precision, most)


WINDOW = 12  # rounds per stage the link is the median of (about three meetings of four members)
# ...unless the median of the last RECENT rounds (about one meeting's) is more than SLUMP times
# slower: a link that drops is taken at once, where noise (rounds 7.5 to 16 Mbit/s on one
# steady link, a median of four within a third of the window's) never goes that far
RECENT = 4
SLUMP = 2.0
# a new period is taken only when the current one puts more than STEADY x the share of a
# replica's time on the wire, or less than the share / STEADY
STEADY = 1.3
# a stage's first WINDOW rounds calibrate its link against the probe: by a factor on the rate
# where the probe's rate accounts for at least this share of their time (the bytes dominate),
# else by a fixed cost per round (a fast link, where latencies, the decision, and int8's two
# collectives and its quantizing dominate: a factor learned there made a 15 Mbit/s link, met
# later, look 45 Mbit/s, and the period stayed at 2 to 3 where 6 fits)
BYTES_BOUND = 0.5


class WirePace:
    """The period during the run, from what the rounds themselves measure: sdpipe's meetings
    follow a link that slows or recovers, and a compute pace that changes.

    Every member of a round reports, with its next ready signal, how long the round's
    all-reduce took and what it moved (:meth:`round_done`), and how long its block of local
    steps took (:meth:`block_done`). The start's probe gives each stage's link *level*, the
    rounds its *changes*: a round on a real link is slower than the probe of one stage alone
    (the other stage's round shares the link at once, the decision that starts it queues
    behind other traffic; on 15 Mbit/s rounds ran at 8-12 Mbit/s where the probe measured 14),
    and the rule that chose well (H = 12 to 14 there, as described links choose) is the one
    taken on the probe's figure. So the first :data:`WINDOW` rounds of a stage set its
    calibration (the probe's rate over their median), and from then on its link is the median
    of its last :data:`WINDOW` rounds times that: a link that slows 13x makes the rounds 13x
    slower, and the period follows once half a window of rounds is slow. Where those first
    rounds are mostly fixed costs (:data:`BYTES_BOUND`), the calibration is that cost instead,
    taken off every later round before its rate. (The fastest of 8
    rounds instead followed the rounds' own noise, 7.5 to 16 Mbit/s on one link, to H = 23
    and back.) The compute is
    the fastest pipeline's latest seconds per step. :meth:`every` applies the start's rule
    (:func:`~sdpipe_cli.core.meetings.choose`) to them, one period for every pipeline: a
    slower pipeline's meetings then come after more time, so that it is a stale member of
    the fast ones' groups (``sync.stale``) as at a fixed period. (A period per pipeline, each
    filling the same time, made a 3x slower replica's meetings as frequent as the others' and
    no longer stale: its smaller changes pulled the group's mean back, and the validation loss
    rose 5-7 % at the same samples/s.) A period is changed only when the current one puts
    more than :data:`STEADY` x the share on the wire, or less than the share over it, so that
    noise does not move it. (Changed when the rule's period differed from the current by more
    than that factor, it flipped between 1 and 2 thirty times in thirty seconds on a
    200 Mbit/s link where a meeting costs 17 % of a step: no integer between them.)

    Pure: fed by the scheduler, no clock of its own.
    """

    def __init__(self, share: float, precision: str, every: int, most: int, members: int,
                 links: dict[int, LinkFit], values: dict[int, int], step_s: dict[int, float]):
        self.share, self.precision, self.most, self.members = share, precision, most, members
        self.current = every
        self.probed = dict(links)
        self.values = dict(values)
        self.seen: dict[int, list[tuple[float, float]]] = {s: [] for s in links}  # (bytes, s)
        self.calibration: dict[int, float] = {}  # stage -> the probe's rate over its rounds'
        self.overhead = {s: fit.latency_s for s, fit in links.items()}  # s off every round
        self.step_s = dict(step_s)

    def round_done(self, stage: int, moved: float, seconds: float) -> None:
        """A round of ``stage`` moved ``moved`` bytes through a member's link in ``seconds``."""
        if moved <= 0 or seconds <= 0 or stage not in self.seen:
            return
        self.seen[stage] = (self.seen[stage] + [(moved, seconds)])[-WINDOW:]
        if stage not in self.calibration and len(self.seen[stage]) == WINDOW:
            self._calibrate(stage)

    def _calibrate(self, stage: int) -> None:
        """The stage's first window of rounds against the probe (see :data:`BYTES_BOUND`)."""
        probe, window = self.probed[stage], self.seen[stage]
        if _median([m / probe.bytes_per_s / t for m, t in window]) >= BYTES_BOUND:
            self.calibration[stage] = probe.bytes_per_s / _median(self.rates(stage))
        else:
            self.overhead[stage] = max(probe.latency_s, _median(
                [t - m / probe.bytes_per_s for m, t in window]))
            self.calibration[stage] = 1.0

    def rates(self, stage: int) -> list[float]:
        """Bytes per second of the stage's window of rounds, their fixed cost taken off (at
        most nine tenths of a round: a round quicker than that cost is a faster link)."""
        cost = self.overhead[stage]
        return [m / max(t - cost, 0.1 * t) for m, t in self.seen[stage]]

    def block_done(self, pipeline: int, steps: int, seconds: float) -> None:
        """``pipeline`` took ``seconds`` for its last ``steps`` local steps (its compute)."""
        if steps > 0 and seconds > 0:
            self.step_s[pipeline] = seconds / steps

    def link(self, stage: int) -> LinkFit:
        """The stage's link now: the probe's until its rounds are calibrated, then the median
        of its window of rounds, or of its last few where the link dropped, in the probe's
        terms."""
        if stage not in self.calibration:
            return self.probed[stage]
        rates = self.rates(stage)
        rate, recent = _median(rates), _median(rates[-RECENT:])
        if recent * SLUMP < rate:
            rate = recent
        return LinkFit(self.overhead[stage], rate * self.calibration[stage])

    def every(self) -> int:
        """The period the next blocks take (a pace with no link to follow keeps its own)."""
        if not self.step_s or not self.values:
            return self.current
        round_s = meeting_s((self.link(s), self.members, n) for s, n in self.values.items())
        step_s = max(min(self.step_s.values()), 1e-6)
        wanted = choose(step_s, round_s, self.share, 0, self.precision, self.most)
        # the share of its time the period now would put on the wire, in the rule's precision
        used = round_s[wanted.precision] / (self.current * step_s)
        if ((wanted.every > self.current and used > STEADY * self.share)
                or (wanted.every < self.current and used < self.share / STEADY)):
            self.current = wanted.every
        return self.current


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class Blocks:
    """A replica's meetings when they follow the wire: each block of local steps is as long as
    its last meeting's decision said (``Group.nexts``), so the meeting after a step is the
    count of meetings so far, not ``step // H``. Until the first decision, blocks of the
    start's ``every`` from where the replica starts (a resume's first block ends where a fixed
    period's would, as the scheduler numbers it)."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.next: int | None = None  # the local step after which the replica meets next
        self.met = -1  # the last meeting it went to

    def meets(self, step: int) -> bool:
        if self.next is None:
            self.next = step + self.every - 1 - step % self.every
            self.met = step // self.every - 1
        return step == self.next

    def meeting(self) -> int:
        """The number of the replica's coming meeting."""
        return self.met + 1

    def went(self, step: int, next_every: int | None) -> None:
        """It met after local step ``step``; its next block takes ``next_every`` steps (None:
        as long as the last)."""
        self.met += 1
        if next_every is not None:
            self.every = next_every
        self.next = step + self.every
