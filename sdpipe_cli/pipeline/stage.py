"""The flushed executor of one pipeline stage: runs one iteration's action list (1F1B, GPipe, ZB-H1).

Given an action list from :mod:`sdpipe_cli.core.schedule`, :meth:`FlushedStage.run` runs each
action through the stage's :class:`~sdpipe_cli.pipeline.executor.Executor` (the compute of one
forward or backward, shared with the asynchronous executor) and sends its output through the
executor's :class:`~sdpipe_cli.pipeline.p2p.Link` (which also says why this does not deadlock).

Parameter gradients accumulate in ``.grad`` over the ``m`` micro-batches, each loss divided by
``m``; the caller zeroes them and steps the optimizer. A stage keeps a micro-batch's input and
output only from its forward to its backward, so under 1F1B it holds at most ``S - stage`` of
them. Every send is waited on before :meth:`FlushedStage.run` returns: the iteration ends in a
flush. Neighbours match messages by order, so both lists must run forwards and backwards in
micro-batch order, which :meth:`FlushedStage.run` checks.

The per-iteration control message (whether the iteration runs at all) is the worker's, sent
before :meth:`FlushedStage.run` with :func:`sdpipe_cli.pipeline.p2p.send_control`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.pipeline.executor import Deferred, Executor, OnExecutor

__all__ = ["FlushedStage"]


class FlushedStage(OnExecutor):
    """Runs flushed iterations on an :class:`~sdpipe_cli.pipeline.executor.Executor` built from
    the arguments (those of ``Executor``, see there for their meaning); :attr:`executor` is that
    core, which an :class:`~sdpipe_cli.pipeline.async_stage.AsyncStage` may take over."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.executor = Executor(*args, **kwargs)

    def run(
        self,
        actions: Sequence[Action],
        inputs: Sequence[torch.Tensor] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
    ) -> float | None:
        """Run one iteration's ``actions``; return the mean loss on the last stage, else None.

        ``inputs`` (first stage) and ``targets`` (last stage) hold one tensor per micro-batch.
        """
        ex = self.executor
        actions = list(actions)
        m = _check_actions(actions)
        ex.check_data(m, inputs, targets)
        stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # i -> (input, output)
        split = any(a.kind is Kind.W for a in actions)  # a zero-bubble schedule: B, then W
        deferred: dict[int, Deferred] = {}  # i -> what its W needs of its B
        total = None
        for index, action in enumerate(actions):
            i = action.microbatch
            if action.kind is Kind.F:
                x, y, outgoing = ex.forward(action, i, inputs, targets, scale=m)
                if ex.is_last:
                    loss = y.detach() / ex.loss_scale if ex.loss_scale != 1 else y.detach()
                    total = loss if total is None else total + loss
                stash[i] = (x, y)
            elif action.kind is Kind.W:
                ex.backward_weight(action, deferred.pop(i))
                outgoing = None
            else:
                x, y = stash.pop(i)
                if split:
                    outgoing, deferred[i] = ex.backward_input(action, x, y)
                else:
                    outgoing = ex.backward(action, x, y)
                del x, y
            if outgoing is not None:
                ex.send(action, outgoing, actions[index + 1] if index + 1 < len(actions) else None)
        ex.link.wait_sends()
        # the last stage's total is set: _check_actions found m >= 1 forwards
        return float(cast(torch.Tensor, total)) if ex.is_last else None


def _check_actions(actions: list[Action]) -> int:
    """Number of micro-batches of ``actions``; ValueError unless F0..F(m-1) and B0..B(m-1) in
    order with each B after its F (neighbours match messages by order), and, in a zero-bubble
    list, one W of each micro-batch after its B."""
    done: dict[Kind, set[int]] = {Kind.F: set(), Kind.B: set(), Kind.W: set()}
    needs = {Kind.B: Kind.F, Kind.W: Kind.B}
    for a in actions:
        if not isinstance(a.kind, Kind):
            raise ValueError(f"unknown action kind {a.kind!r} in {a}")
        if a.kind in needs and a.microbatch not in done[needs[a.kind]]:
            raise ValueError(f"{a} comes before {needs[a.kind].value}{a.microbatch}")
        done[a.kind].add(a.microbatch)
    forwards = [a.microbatch for a in actions if a.kind is Kind.F]
    backwards = [a.microbatch for a in actions if a.kind is Kind.B]
    weights = sorted(a.microbatch for a in actions if a.kind is Kind.W)
    m = len(forwards)
    if (m == 0 or forwards != list(range(m)) or backwards != list(range(m))
            or weights not in ([], list(range(m)))):
        raise ValueError(
            "actions must hold F0..F(m-1) and B0..B(m-1), each in micro-batch order (and W0..W(m-1) "
            "or no W), got " + " ".join(str(a) for a in actions)
        )
    return m
