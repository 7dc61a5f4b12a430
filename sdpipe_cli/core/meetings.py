"""How often a replica meets its group, and what a meeting sends: sdpipe on slow links.

On fast links a replica of sdpipe meets a group after every iteration. Across machines joined by
1-25 Gbit/s, one all-reduce of a stage can take longer than several iterations of compute, and
meeting every iteration puts most of a replica's time on the wire. Two settings cut that:

* ``sync.every`` (H): a replica meets after every H-th local step, and trains alone in between
  (local SGD in the scheduler's partial groups: fast replicas still never wait for slow ones).
  The scheduler's policy then counts in *meetings*: its "iteration" k is a replica's block of
  local steps ``k*H .. k*H + H - 1``, and its budget, global-sync period and evaluation period are
  the run's divided by H. :class:`Meetings` is the one place that converts between the two.
* ``sync.precision``: a group round (not a global sync, which stays exact) averages each
  member's change since the stage's *anchor*, the weights at the last global sync (which every
  replica holds alike), in bfloat16 instead of float32 (half the bytes), or in int8 with a
  float32 scale per :data:`INT8_CHUNK` values (about a quarter). What rounding lost of a
  member's change is kept and added to its next one (error feedback), so it is delayed, not lost.

``sync.every=0`` and ``sync.precision=auto`` let the launcher choose (:func:`choose`) from the
cluster's described links: nothing changes where the links are fast, which is every cluster that
describes none.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdpipe_cli.core.modes import mode

__all__ = ["Meetings", "Choice", "choose", "setting", "meetings_of", "precision_of", "average_of",
           "SYNC_PRECISIONS", "BYTES", "INT8_CHUNK"]

SYNC_PRECISIONS = ("auto", "fp32", "bf16", "int8")
# int8 changes: one float32 scale (absmax / 127) per this many values. Finer chunks follow the
# changes' magnitudes more closely (a smaller rounding step) for more bytes of scales
INT8_CHUNK = 256
# bytes per value a group round sends (int8: a byte, and its share of its chunk's scale)
BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / INT8_CHUNK}


@dataclass(frozen=True)
class Meetings:
    """A replica's meetings: one after every ``every``-th local step (0-based ``step``)."""

    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("every must be >= 1")

    def meets(self, step: int) -> bool:
        """Whether the replica meets its group after local step ``step``."""
        return (step + 1) % self.every == 0

    def meeting(self, step: int) -> int:
        """The meeting (the policy's iteration) local step ``step`` belongs to."""
        return step // self.every

    def last_step(self, meeting: int) -> int:
        """The local step after which a replica holds ``meeting``."""
        return meeting * self.every + self.every - 1

    def steps(self, meetings: int) -> int:
        """Local steps done once ``meetings`` meetings are done."""
        return meetings * self.every

    def meetings(self, steps: int) -> int:
        """Meetings that cover ``steps`` local steps (a budget rounds up: at most H - 1 more)."""
        return -(-steps // self.every)

    def period(self, steps: int) -> int:
        """A period in local steps (``sync.global_every``, ``train.eval_every``) in meetings:
        0 stays 0 (never), anything else at least 1."""
        return 0 if steps <= 0 else max(1, round(steps / self.every))

    def patience(self, patience: float, share: float) -> float:
        """How long a round waits for its forecast members, as a share of a meeting's time (the
        policy's pace): ``sync.patience`` meeting every step; with H > 1 at most ``share``.
        Waiting for the group, like time on the wire, is time a replica does not compute; half
        of a meeting's H steps (``sync.patience`` taken as it is) held gpt_tiny's fast replicas
        up to 7 steps a meeting (0.67 of the limit); half of one step (patience over H) let
        equal replicas with noisy timing (ResNet-20, 15-20 % overruns, H = 25) miss each other
        (mean group 1.6, the final average of replicas that drifted apart at 64 % accuracy);
        ``share`` (0.1: 1.4 and 2.5 steps there) kept both (0.87 of the limit, mean group 2.7,
        98.6 %)."""
        return patience if self.every == 1 else min(patience, share)

    def global_period(self, global_every: int, share: float) -> int:
        """Meetings between global syncs: ``sync.global_every`` in meetings, and with H > 1 at
        least 1 / ``share`` of them. A global sync waits for every replica, and with meetings H
        steps apart the fast ones wait for the slow one's whole block (up to H of its steps)
        before it; at every ``global_every`` = 50 steps with H = 17, one meeting in three was
        global and the fast replicas of a simulated GPT-2 run spent a quarter of their time
        waiting there. One in 1 / ``share`` keeps that wait within the share of time a replica
        may spend on meetings (checkpoints, which fall on global syncs, come as rarely)."""
        meetings = self.period(global_every)
        if meetings == 0 or self.every == 1:
            return meetings
        return max(meetings, math.ceil(1 / share - 1e-9))


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided, and what it decided from (for the launcher's line)."""

    every: int
    precision: str
    iteration_s: float  # the fastest pipeline's iteration, as estimated
    round_s: float  # one meeting of every replica of the costliest stage, fp32
    share: float  # the share of its time a replica may spend on the wire

    def describe(self) -> str:
        return (f"sync.every={self.every} sync.precision={self.precision}: a meeting of all "
                f"replicas takes {self.round_s * 1e3:.1f} ms in float32 against "
                f"{self.iteration_s * 1e3:.1f} ms of compute per iteration "
                f"(sync.wire_share={self.share:g})")


def choose(iteration_s: float, round_s: dict[str, float], share: float, every: int = 0,
           precision: str = "auto", most: int = 0) -> Choice:
    """The meeting period and payload precision for a replica whose iteration takes
    ``iteration_s`` and whose meeting with every replica of the stage takes ``round_s[p]`` in
    precision ``p`` (every precision of :data:`BYTES`), so that meetings use at most ``share``
    of its time: where one float32 meeting per iteration fits, nothing changes (H = 1, float32);
    otherwise int8, the smallest payload, and H the fewest iterations over which one meeting
    fits, but at most ``most`` (a pipeline's share of the budget, ``train.steps``; 0: no bound),
    past which a replica would train beyond the run's end before its first meeting. int8 rather
    than bfloat16: for the same bytes on the wire it meets about twice as often; on
    ``cluster=slow_links`` (six seeds, H = 8 against bfloat16's 14) its final loss per sample was
    0.049 lower on the mean, never more than 0.025 higher, at the same samples/s
    (docs/BENCHMARKS.md). ``every`` and ``precision`` given (not 0 or ``auto``) are kept."""
    if iteration_s <= 0 or min(round_s.values()) < 0 or not 0 < share <= 1:
        raise ValueError("iteration_s must be > 0, round_s >= 0 and 0 < share <= 1")
    fits = round_s["fp32"] <= share * iteration_s
    if precision == "auto":
        precision = "fp32" if fits and every in (0, 1) else "int8"
    if every == 0:
        every = max(1, math.ceil(round_s[precision] / (share * iteration_s) - 1e-9))
        every = min(every, most) if most > 0 else every
    return Choice(every, precision, iteration_s, round_s["fp32"], share)


def setting(section: Any, key: str, default: Any) -> Any:
    """``section``'s ``key``, or ``default`` where it has none: a config's section (a mapping)
    or the same section typed (a dataclass of :mod:`sdpipe_cli.config.schema`, which has the keys
    of its own mode only)."""
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def meetings_of(sync) -> Meetings:
    """A run's meetings, from its ``sync`` section: ``every`` as the launcher resolved it; 0
    (left to choose, in a config nothing resolved: an older run) and a missing key are 1, as is
    every mode but sdpipe."""
    return Meetings(max(1, int(setting(sync, "every", 1) or 1)) if mode(sync.name).meets else 1)


def precision_of(sync) -> str:
    """What a run's rounds send their changes in, from its ``sync`` section: sdpipe's group
    rounds and diloco's outer gradients, ``precision`` as resolved; ``auto`` left unresolved
    (and any other mode) is float32."""
    chosen = setting(sync, "precision", "fp32") if mode(sync.name).low_precision else "fp32"
    return "fp32" if chosen == "auto" else chosen


def average_of(sync) -> str:
    """What sdpipe's group rounds average, as the workers, the policy and the simulator must all
    take it: ``sync.average``, except that meetings every H > 1 steps and low-precision changes
    average the weights after the step (``weights``): a gradient of one step in H, or rounded
    to bfloat16 or int8 beside exact weights, would buy little for twice the bytes."""
    if mode(sync.name).group_policy and (meetings_of(sync).every > 1
                                         or precision_of(sync) != "fp32"):
        return "weights"
    return setting(sync, "average", "weights_grads")
