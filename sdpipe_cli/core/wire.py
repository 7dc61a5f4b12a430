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

from dataclasses import dataclass
from typing import Sequence

from sdpipe_cli.core.meetings import BYTES, Choice, choose

__all__ = ["LinkFit", "Probe", "Measured", "ring_bytes", "decide"]

FLOAT_BYTES = BYTES["fp32"]


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
    round_s = {p: max(r.probe.fit().seconds(ring_bytes(r.probe.members, r.values * size))
                      for r in reports)
               for p, size in BYTES.items()}
    return choose(iteration_s, round_s, share, every, precision, most)
