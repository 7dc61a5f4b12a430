"""Twins (``sync.average=weights_grads``): which pipelines are known to hold the same state.

Averaging the weights of replicas that hold the same weights changes nothing; only their gradients
need averaging then. The policy sees every round, so it can tell: it folds each round into its
members' *lineage*, and a group round whose members share one lineage is flagged ``twins``.
"""

from __future__ import annotations

import itertools
import operator

from sdpipe_cli.core.grouping.state import Decision

_IS_GLOBAL = operator.itemgetter(0)  # of a round's key in Lineage.note


class Lineage:
    """Each pipeline's lineage: equal lineages mean the same weights and optimizer state."""

    def __init__(self, pipelines: int, stages: int, enabled: bool):
        self.S, self.enabled = stages, enabled
        self._lineage = {p: 0 for p in range(pipelines)}  # equal: the same state (all start alike)
        self._rounds_of: dict[int, dict[int, tuple]] = {p: {} for p in range(pipelines)}
        self._fresh = itertools.count(1)

    def alike(self, members: list[int]) -> bool:
        """Whether a group round of ``members`` is between twins (never, when not enabled)."""
        return (self.enabled and len(members) > 1
                and len({self._lineage[p] for p in members}) == 1)

    def note(self, d: Decision) -> None:
        """Fold round ``d`` into its members' lineage; equal lineages mean the same state.

        With weights_grads a round gives its members the same weights and gradients, and each
        member's step depends only on those, its optimizer state and the learning rate its
        decision carries, except for clipping, whose norm sums over the pipeline's stages. So two
        pipelines that held the same state and took an iteration in the same round at *every*
        stage hold the same state again (any iteration numbers: AdamW's step count is averaged
        at global syncs too). An iteration whose rounds were all global syncs leaves every
        replica alike whatever came before. Replicas start alike (seeded), and a resume starts
        from a global sync. The flushed schedules make every stage of a pipeline finish an
        iteration before any stage of it signals the next, so its lineage is folded before its
        next round is decided."""
        if not self.enabled:
            return
        stage, S, rounds_of, lineage = d.stage, self.S, self._rounds_of, self._lineage
        key = (d.kind == "global", stage, d.round)  # (is it global, the round's own number)
        for p in d.members:
            rounds = rounds_of[p]
            rounds[stage] = key
            if len(rounds) == S:
                keys = tuple(map(rounds.__getitem__, range(S)))
                lineage[p] = hash(keys if all(map(_IS_GLOBAL, keys)) else (lineage[p], keys))
                rounds.clear()

    def forget(self, gone: int) -> None:
        """A pipeline left: a round it was in may have failed, leaving its other members on
        their own state, so nobody counts as anybody's twin until the next global sync."""
        for p in self._lineage:
            self._lineage[p] = hash(("own", p, next(self._fresh)))
        self._rounds_of[gone] = {}

    def reset(self) -> None:
        """Everyone alike again: a resume starts from a checkpoint, taken after a global sync."""
        self._lineage = {p: 0 for p in self._lineage}
        self._rounds_of = {p: {} for p in self._lineage}
