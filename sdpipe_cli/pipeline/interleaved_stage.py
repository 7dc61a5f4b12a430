"""The executor of an interleaved stage: one process running ``v`` model chunks
(:mod:`sdpipe_cli.core.interleaved`).

Chunk ``c`` of stage ``s`` is virtual stage ``k = c S + s`` of a pipeline of ``V = v S``, and
each chunk is an :class:`~sdpipe_cli.pipeline.executor.Executor` of its own, built for that
place: its neighbours are the processes holding virtual stages ``k - 1`` and ``k + 1``, the
first virtual stage reads the inputs and the last computes the loss. A chunk whose neighbour is
across the wrap channel (the first stage's chunk ``c > 0`` and the last stage's chunk
``c < v - 1``) talks to it in the wrap group, so that every channel carries one kind of message
in one direction, posted in the same order at both ends.

:meth:`InterleavedStage.run` runs one iteration's actions, each on its chunk, as
:class:`~sdpipe_cli.pipeline.stage.FlushedStage` runs a stage's, with gradients accumulating in
each chunk's ``.grad``. Sends are posted without blocking; a chunk waits on its activation sends
up to micro-batch ``i`` once ``i``'s gradient came back (the receiver used them), and on the
rest at the iteration's end: the one-chunk rule that bounds gradient sends in flight
(``Link.wait_gradients``) assumes the previous stage runs nothing else between them. In a
zero-bubble list (``interleaved_zb``) each chunk's backward is its ``B`` (the input's gradient,
sent back) and, later, its ``W`` (the weights'), as
:class:`~sdpipe_cli.pipeline.stage.FlushedStage` runs ZB-H1's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from sdpipe_cli.core.interleaved import forward_order, virtual_stage
from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.pipeline.executor import Deferred, Executor, LossFn, StageBoundaries
from sdpipe_cli.pipeline.p2p import EndGroup

__all__ = ["InterleavedStage"]


class InterleavedStage:
    """Stage ``stage`` of ``stages``, holding ``modules[c]`` as its chunk ``c``.

    ``ranks[s]``: the global rank of stage ``s``; ``boundaries[c]``: what chunk ``c`` receives
    and sends (see :class:`~sdpipe_cli.pipeline.executor.Executor`); ``group`` carries the
    pipeline's messages and ``wrap`` those between its last stage and its first (a second group
    of the same processes), each one group or a :class:`~sdpipe_cli.pipeline.p2p.Directed` pair
    (forward, backward), which NCCL needs: the worker passes pairs. ``kwargs`` go to each
    chunk's executor (hooks, precision, ...).
    """

    def __init__(self, modules: Sequence[nn.Module], stage: int, stages: int,
                 ranks: Sequence[int], boundaries: Sequence[StageBoundaries],
                 device: torch.device, loss_fn: LossFn, group: EndGroup = None,
                 wrap: EndGroup = None, **kwargs: Any):
        chunks = len(modules)
        if chunks > 1 and stages < 2:
            raise ValueError("interleaving needs two stages or more: one stage holds its chunks "
                             "as one module")
        if chunks > 1 and stages == 2 and wrap is None:
            raise ValueError("two stages of several chunks are each other's neighbours both "
                             "ways: the wrap channel needs a process group of its own (wrap=)")
        last = stages * chunks - 1
        self.stages = stages
        self.chunks: list[Executor] = []
        for c, module in enumerate(modules):
            k = virtual_stage(stage, c, stages)
            prev_group = wrap if stage == 0 and c > 0 else group
            next_group = wrap if stage == stages - 1 and c < chunks - 1 else group
            self.chunks.append(Executor(
                module, k, stages * chunks,
                None if k == 0 else ranks[(k - 1) % stages],
                None if k == last else ranks[(k + 1) % stages],
                boundaries[c], device, loss_fn, group=(prev_group, next_group), **kwargs))

    @property
    def holds_loss(self) -> bool:
        """Whether this stage computes the loss (its last chunk is the model's end)."""
        return self.chunks[-1].is_last

    def run(self, actions: Sequence[Action], inputs: Sequence[torch.Tensor] | None = None,
            targets: Sequence[torch.Tensor] | None = None) -> float | None:
        """Run one iteration's ``actions`` (each naming its chunk); the mean loss where this
        stage computes it, else None. ``inputs`` (the first stage's) and ``targets`` (the last
        stage's) hold one tensor per micro-batch."""
        actions = list(actions)
        m = _check_actions(actions, len(self.chunks))
        for ex in self.chunks:
            ex.check_data(m, inputs, targets)
        stash: dict[tuple[int, int], tuple[Any, Any]] = {}  # (chunk, i) -> (input, output)
        split = any(a.kind is Kind.W for a in actions)  # interleaved zero bubble: B, then W
        deferred: dict[tuple[int, int], Deferred] = {}  # (chunk, i) -> what its W needs of its B
        total = None
        for index, action in enumerate(actions):
            ex, key = self.chunks[action.chunk], (action.chunk, action.microbatch)
            if action.kind is Kind.F:
                x, y, outgoing = ex.forward(action, action.microbatch, inputs, targets, scale=m)
                if ex.is_last:
                    loss = y.detach() / ex.loss_scale if ex.loss_scale != 1 else y.detach()
                    total = loss if total is None else total + loss
                stash[key] = (x, y)
            elif action.kind is Kind.W:
                ex.backward_weight(action, deferred.pop(key))
                outgoing = None
            else:
                x, y = stash.pop(key)
                if split:
                    outgoing, deferred[key] = ex.backward_input(action, x, y)
                else:
                    outgoing = ex.backward(action, x, y)
                del x, y
            if outgoing is not None:
                after = actions[index + 1] if index + 1 < len(actions) else None
                receiver = self.chunks[after.chunk].link if after is not None else None
                ex.link.send(action, outgoing, cast(str, ex.link.destination(action)), after,
                             receiver)
        for ex in self.chunks:
            ex.link.wait_sends()
        return float(cast(torch.Tensor, total)) if self.holds_loss else None

    @property
    def executors(self) -> list[Executor]:
        """The chunks' executors, in chunk order (set a loss scale on each)."""
        return list(self.chunks)

    def forward_only(self, inputs: Sequence[Any] | None = None,
                     targets: Sequence[Any] | None = None, microbatches: int | None = None,
                     observe: Callable[[Any, Any], None] | None = None) -> float | None:
        """Every micro-batch forward through the chunks without autograd, pipelined as training
        runs its forwards (:func:`~sdpipe_cli.core.interleaved.forward_order`): the mean loss
        where this stage computes it, else None. Sends are posted and waited on at the end:
        the order is the same on every stage and each forward waits only for one before it,
        so no stage waits for another that waits for it (a chunk that waited on each send
        before the next could, across the wrap)."""
        known = inputs if self.chunks[0].is_first else targets if self.holds_loss else None
        m = len(known) if known is not None else microbatches
        if m is None or m < 1:
            raise ValueError("forward_only needs microbatches >= 1")
        for ex in self.chunks:
            ex.check_data(m, inputs, targets)
        total = None
        for i, c in forward_order(m, self.stages, len(self.chunks)):
            ex = self.chunks[c]
            loss = ex.forward_one(i, inputs, targets, observe)
            if loss is not None:
                total = loss if total is None else total + loss
        for ex in self.chunks:
            ex.link.wait_sends()
        return float(cast(torch.Tensor, total)) / m if self.holds_loss else None


def _check_actions(actions: list[Action], chunks: int) -> int:
    """Micro-batches of an interleaved iteration's ``actions``; ValueError unless each chunk
    runs F0..F(m-1) and B0..B(m-1) in order, each B after its F (a chunk's neighbours match its
    messages by order), and, in a zero-bubble list, one W of each micro-batch after its B."""
    if any(a.chunk >= chunks or a.chunk < 0 for a in actions):
        raise ValueError(f"an action names a chunk outside 0..{chunks - 1}")
    split = any(a.kind is Kind.W for a in actions)
    needs = {Kind.B: Kind.F, Kind.W: Kind.B}
    m = sum(1 for a in actions if a.chunk == 0 and a.kind is Kind.F)
    for c in range(chunks):
        mine = [a for a in actions if a.chunk == c]
        done: dict[Kind, set[int]] = {kind: set() for kind in Kind}
        for a in mine:
            if a.kind in needs and a.microbatch not in done[needs[a.kind]]:
                raise ValueError(f"{a} comes before {needs[a.kind].value}{a.microbatch}.{c}")
            done[a.kind].add(a.microbatch)
        forwards = [a.microbatch for a in mine if a.kind is Kind.F]
        backwards = [a.microbatch for a in mine if a.kind is Kind.B]
        weights = sorted(a.microbatch for a in mine if a.kind is Kind.W)
        if (m == 0 or forwards != list(range(m)) or backwards != list(range(m))
                or weights != (list(range(m)) if split else [])):
            raise ValueError(f"chunk {c}'s actions must be F0..F{m - 1} and B0..B{m - 1}, each in "
                             "micro-batch order" + (f", and W0..W{m - 1}" if split else "")
                             + ", got " + " ".join(str(a) for a in mine))
    return m
