"""Stale members (``sync.stale``): how much each member of a round counts in its average.

A straggler's replica was last averaged many updates of the others ago. When it joins a group,
the plain mean pulls every fresh member back towards its old weights by 1/k of the way, and
mixes in its gradient, computed at those old weights. Replaying recorded runs in one process, one
change at a time (docs/SYNC.md, "Where the loss per sample goes"), with one 3x straggler: the
groups themselves cost nothing per sample, the straggler's stale contribution does; leaving out
its weights but not its gradient is worse than the plain mean (the stale gradient then lands on
weights it was not computed for), leaving out both is the best of the three. So a stale member
*pulls* (``pull``): it takes the group's weights and step without counting in either average;
its replica stays in step and counts again, fresh, from its next round.

Staleness of a member at a round is the run's progress (pipeline-iterations begun, the learning
rate's clock) since that member's last round at this stage. A member is stale when its staleness
exceeds the freshest member's by more than P, one iteration of every pipeline: replicas at one
pace differ by less (jitter moves a round by a fraction of an iteration), a straggler k times
slower by about (k - 1)(P - 1), so with P = 4 a 3x straggler is stale and a 2x one is not. The
freshest member always counts, so every round has someone to average.

Pipelines that take unequal shares of the global batch (``pipeline.balance=speed``,
:mod:`~sdpipe_cli.core.balance`) count by their samples as well: a member's weight in the mean is
its samples per iteration, zero where it is stale, so that a round of everyone averages the
gradient of all their samples, as one of equal shares does.

Pure: the policy calls :meth:`Freshness.shares` as it closes a round and :meth:`note` after.
"""

from __future__ import annotations

from collections.abc import Sequence

STALE_RULES = ("average", "pull_weights", "pull")  # sync.stale


class Freshness:
    """Each replica's progress at its last round, and the shares a round's members count by.

    ``rule``: ``average`` (every member counts 1/k: the paper's mean), ``pull_weights`` (stale
    members' weights count 0, their gradients 1/k), ``pull`` (stale members count 0 in both).
    """

    def __init__(self, pipelines: int, stages: int, rule: str = "average",
                 samples: Sequence[int] = ()):
        if rule not in STALE_RULES:
            raise ValueError(f"rule must be one of {', '.join(STALE_RULES)}")
        if samples and (len(samples) != pipelines or min(samples) < 1):
            raise ValueError("samples needs a positive count for every pipeline")
        self.P, self.rule = pipelines, rule
        self.samples = tuple(samples) if len(set(samples)) > 1 else ()  # () : all alike
        self._last = {(s, p): 0 for s in range(stages) for p in range(pipelines)}

    def staleness(self, stage: int, members: Sequence[int], done: int) -> tuple[int, ...]:
        """Pipeline-iterations begun in the run since each member's last round at ``stage``."""
        return tuple(done - self._last[(stage, p)] for p in members)

    def shares(self, stage: int, members: Sequence[int], done: int, twins: bool = False
               ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """What each member's weights and gradient count in the round's averages (each sums to
        1); ``((), ())`` when every member counts the same (the plain mean). ``twins``: the
        members hold the same weights already, so only their gradients are averaged."""
        if len(members) < 2:
            return (), ()
        sizes = [float(self.samples[p]) if self.samples else 1.0 for p in members]
        if twins:
            return (), _normed(sizes) if len(set(sizes)) > 1 else ()
        if self.rule == "average":
            counts = [True] * len(members)
        else:
            ages = self.staleness(stage, members, done)
            counts = [age <= min(ages) + self.P for age in ages]
        if all(counts) and len(set(sizes)) == 1:
            return (), ()
        weights = _normed([n if c else 0.0 for n, c in zip(sizes, counts)])
        return weights, weights if self.rule == "pull" else _normed(sizes)

    def note(self, stage: int, members: Sequence[int], done: int) -> None:
        """A round of ``members`` closed at ``done``: their replicas are that fresh now."""
        for p in members:
            self._last[(stage, p)] = done

    def healed(self, stage: int, pipeline: int, source: int) -> None:
        """A restarted replica took ``source``'s state: it is as fresh as its source."""
        self._last[(stage, pipeline)] = self._last[(stage, source)]

    def reset(self, done: int) -> None:
        """Everyone equal at ``done`` (a resume starts from a global sync)."""
        for key in self._last:
            self._last[key] = done


def _normed(values: Sequence[float]) -> tuple[float, ...]:
    total = sum(values)
    return tuple(v / total for v in values)
