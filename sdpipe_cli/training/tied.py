"""Parameters that several stages hold a copy of (tied input and output embeddings), kept equal.

GPT-2 and BERT use one weight for the input embedding (the first stage) and the output
projection (the last stage). When those are different processes each holds a copy, and
Megatron-LM's rule keeps them one parameter: both start equal (every process builds the model
from the same seed), and after each backward the copies' gradients are summed between the
stages that hold them, so each takes the step the single weight would take. This happens
before the replicas of a stage average anything, so the stage groups see the tied gradient.

Sync modes that average weights within one stage's group (sdpipe, AD-PSGD, the parameter
server) average the first stage's copy with different replicas than the last stage's, so the
copies drift apart; after such a mode's weight sync the copies are averaged between the stages
again (:meth:`TiedCopies.retie`), one all-reduce of the shared weight per update. The gradient
norm counts a tied weight once, on the first stage that holds it
(:meth:`TiedCopies.counted_elsewhere`), as one process holding the model would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sdpipe_cli.core.placement import Placement
from sdpipe_cli.sync.groups import GroupCache

__all__ = ["TiedCopies"]


class TiedCopies:
    """This stage's copies of shared parameters: ``ties`` lists, for each, the stages holding
    one and its name in this stage's module (:func:`sdpipe_cli.model.models.stage_ties`)."""

    def __init__(self, ties: Sequence[tuple[tuple[int, ...], str]], where: Placement,
                 incarnation: int = 0):
        self.ties, self.where, self.incarnation = list(ties), where, incarnation

    def __bool__(self) -> bool:
        return bool(self.ties)

    def _ranks(self, stages: tuple[int, ...]) -> list[int]:
        return [self.where.rank_of(self.where.pipeline, s) for s in stages]

    def reduce_gradients(self, module: nn.Module, groups: GroupCache) -> None:
        """Sum each copy's gradient over the stages holding one (before any replica sync)."""
        for stages, name in self.ties:
            p = module.get_parameter(name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            ranks = self._ranks(stages)
            groups.all_reduce(p.grad, ranks, incarnations=[self.incarnation] * len(ranks))

    def retie(self, module: nn.Module, groups: GroupCache) -> None:
        """Average each copy over the stages holding one (after a weight-mixing sync)."""
        with torch.no_grad():
            for stages, name in self.ties:
                p = module.get_parameter(name)
                ranks = self._ranks(stages)
                groups.all_reduce(p.data, ranks, incarnations=[self.incarnation] * len(ranks))
                p.data /= len(ranks)

    def counted_elsewhere(self, module: nn.Module) -> set[int]:
        """ids of the copies whose gradient an earlier stage already counts in the norm."""
        return {id(module.get_parameter(name)) for stages, name in self.ties
                if stages[0] != self.where.stage}
