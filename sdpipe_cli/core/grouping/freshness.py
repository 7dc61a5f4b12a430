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

    def __init__(self, pipelines: int, stages: int, rule: str = "average"):
        if rule not in STALE_RULES:
            raise ValueError(f"rule must be one of {', '.join(STALE_RULES)}")
        self.P, self.rule = pipelines, rule
        self._last = {(s, p): 0 for s in range(stages) for p in range(pipelines)}

    def staleness(self, stage: int, members: Sequence[int], done: int) -> tuple[int, ...]:
        """Pipeline-iterations begun in the run since each member's last round at ``stage``."""
        return tuple(done - self._last[(stage, p)] for p in members)

    def shares(self, stage: int, members: Sequence[int], done: int
               ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """What each member's weights and gradient count in the round's averages (each sums to
        1); ``((), ())`` when every member counts the same (the plain mean)."""
        if self.rule == "average" or len(members) < 2:
            return (), ()
        ages = self.staleness(stage, members, done)
        freshest = min(ages)
        counts = [age <= freshest + self.P for age in ages]
        if all(counts):
            return (), ()
        pushing = sum(counts)
        weights = tuple(1.0 / pushing if c else 0.0 for c in counts)
        grads = weights if self.rule == "pull" else tuple(1.0 / len(members) for _ in members)
        return weights, grads

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
