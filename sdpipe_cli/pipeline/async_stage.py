"""Executor of asynchronous 1F1B (PipeDream) for one stage: a stream of micro-batches, an update
after every backward, weight stashing, and drains only where the worker asks for one.

:class:`AsyncStage` runs *segments*: the micro-batches of consecutive iterations, from a drained
point to the next one, in the order of :func:`sdpipe_cli.core.schedule.async_next`. Unlike
:meth:`FlushedStage.run <sdpipe_cli.pipeline.stage.FlushedStage.run>` it does not flush at the
end of an iteration: the forwards of iteration k + 1 fill the slots where a flushed pipeline
would wait for the backwards of iteration k, so after the warm-up every stage is busy until the
segment ends. Each action's compute is the shared
:class:`~sdpipe_cli.pipeline.executor.Executor`'s, run on stashed weights:

* ``F(j)``: take the weights for micro-batch j from the :class:`~sdpipe_cli.pipeline.stash.WeightStash`
  (the live ones, copied if they changed since the last copy) and run the blocks with them
  through ``torch.func.functional_call``; the module is never copied.
* ``B(j)``: differentiate with respect to the input and to the stashed tensors of j's version,
  add the parameter gradients to the live parameters' ``.grad``, free the version, send the
  input gradient back, and call ``update(j, loss)``: the worker's optimizer step and sync,
  applied to the latest weights, after every micro-batch (PipeDream) or after the last of an
  iteration, the gradients of its micro-batches accumulated (PipeDream-2BW, ``versions=2``).

Where a segment ends
--------------------
Each iteration k has a :class:`~sdpipe_cli.pipeline.p2p.Control` message ``(go, step, save,
last)`` decided by the first stage and passed down the pipeline, as in the flushed loop.
``last`` says that iteration k ends the segment: after its forwards, every stage only runs the
backwards left, so the pipeline drains at the same batch id everywhere. ``go`` is only read at a
segment's start (False: the run is over). A stage needs the control of iteration k before it may
receive iteration k's first activation, and it receives it exactly then: just before posting
that receive (when the send of the preceding backward posts it together with the send, as
``batch_isend_irecv`` pairs them), or just before the forward otherwise. The previous stage sends
it just before that activation, so each side posts ``...``, ``control(k)``, ``activation(km)``,
``...`` in the same order, and the deadlock-freedom argument of :mod:`sdpipe_cli.pipeline.p2p`
covers it.

At the end of a segment the stages pass a "drained" word from the last to the first
(:meth:`Link.pass_drained <sdpipe_cli.pipeline.p2p.Link.pass_drained>`), so the first stage
starts the next segment only once the whole pipeline is one consistent model: every stage has
made its last update of the segment and finished that update's sync round (a global sync's
average, say). Without it the first stage, done first, would start the next segment, and ask
the scheduler about it, while a later stage is still in the global round it drained for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from sdpipe_cli.core.schedule import Action, Kind, async_next
from sdpipe_cli.pipeline.executor import Executor, OnExecutor, Weights
from sdpipe_cli.pipeline.p2p import Control
from sdpipe_cli.pipeline.stash import WeightStash

__all__ = ["AsyncStage", "Batch"]

Batch = tuple[Sequence[torch.Tensor] | None, Sequence[torch.Tensor] | None]


class AsyncStage(OnExecutor):
    """Runs asynchronous 1F1B segments with weight stashing on ``executor``.

    The executor (module, neighbours, activation shape, device, hooks, link) is the one the
    worker configured for the flushed loop (a :class:`~sdpipe_cli.pipeline.stage.FlushedStage`'s
    ``executor``), so whatever it set up applies here too; :meth:`forward_only` (evaluation at
    drained points, with the live weights) is the executor's. ``microbatches`` is m, the
    micro-batches of one iteration. ``versions`` bounds the weight versions kept (None: as many
    as micro-batches in flight, S - stage; 2 for PipeDream-2BW, whose weights change once per
    iteration). Set ``trace`` to a list to record ``(kind, batch id, weight version)`` for every
    action (tests).
    """

    def __init__(self, executor: Executor, microbatches: int, versions: int | None = None):
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.executor = executor
        self.microbatches = microbatches
        in_flight = executor.num_stages - executor.stage
        self.stash = WeightStash(executor.module, in_flight if versions is None
                                 else min(in_flight, versions))
        self.trace: list[tuple[Kind, int, int]] | None = None

    def run_segment(
        self,
        start: int,
        decide: Callable[[int], Control] | None,
        load: Callable[[int], Batch],
        update: Callable[[int, float | None], None],
    ) -> tuple[int, Control]:
        """Run iterations from ``start`` until one whose control says ``last``, and drain.

        ``decide(k)`` (first stage only) gives iteration k's control; the other stages receive
        it. ``load(k)`` gives iteration k's micro-batches (inputs on the first stage, targets on
        the last, None elsewhere) once it begins. ``update(j, loss)`` runs after the backward of
        batch id ``j = k * m + i``, with the gradient in the live ``.grad`` and, on the last
        stage, that micro-batch's loss. Returns the iterations done at the drain (``start`` if
        the first control said stop) and the last control (its ``save`` is for the drain).
        """
        ex, link, stash = self.executor, self.executor.link, self.stash
        m, S, s = self.microbatches, ex.num_stages, ex.stage
        control = self._control(start, decide)
        if not control.go:
            link.wait_sends()  # the stop must reach the next stage before this one exits
            return start, control
        first_id = start * m
        batches: dict[int, Batch] = {start: load(start)}
        begun = 1  # iterations of the segment whose control arrived
        end: int | None = m if control.last else None  # the segment's length, once known
        in_flight: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: dict[int, float] = {}
        forwarded = backwarded = 0
        action = async_next(S, s, 0, 0, end)
        while action is not None:
            i = action.microbatch
            j = first_id + i
            now = Action(action.kind, j)  # numbered by batch id, as the hooks and the link see it
            if action.kind is Kind.F and i == begun * m:  # no send posted its receive: take it now
                control, end, begun = self._next_control(start, begun, decide, load, batches)
            if action.kind is Kind.F:
                k, r = divmod(i, m)
                inputs, targets = batches[start + k]
                # cast: mypy cannot infer a lambda with a default against a no-argument type
                x, y, outgoing = ex.forward(now, r, inputs, targets,
                                            weights=cast(Weights, lambda j=j: stash.acquire(j)[1]))
                version = stash.get(j)[0]
                if ex.is_last:
                    losses[j] = float(y.detach()) / ex.loss_scale
                in_flight[j] = (x, y)
                if r == m - 1:
                    del batches[start + k]
                forwarded += 1
            else:
                x, y = in_flight.pop(j)
                version = stash.get(j)[0]
                outgoing = ex.backward(now, x, y,
                                       weights=cast(Weights, lambda j=j: stash.get(j)[1]))
                stash.release(j)
                del x, y
                backwarded += 1
            if self.trace is not None:
                self.trace.append((action.kind, j, version))
            following = async_next(S, s, forwarded, backwarded, end)
            if (following is not None and following.kind is Kind.F and following.microbatch == begun * m
                    and outgoing is not None and link.destination(now) == link.source(following)):
                # This send posts the receive of the next iteration's first activation, which
                # the control of that iteration precedes.
                control, end, begun = self._next_control(start, begun, decide, load, batches)
            if outgoing is not None:
                after = None if following is None else Action(following.kind,
                                                              first_id + following.microbatch)
                ex.send(now, outgoing, after)
            if action.kind is Kind.B:
                update(j, losses.pop(j, None))
            action = following
        link.wait_sends()
        link.pass_drained()
        return start + begun, control

    # -- control ----------------------------------------------------------------------------------
    def _control(self, k: int, decide: Callable[[int], Control] | None) -> Control:
        """Iteration k's control: decided here on the first stage, else received; passed on."""
        ex = self.executor
        if ex.is_first:
            if decide is None:
                raise ValueError("the first stage needs decide()")
            control = decide(k)
            if control.step != k:
                raise RuntimeError(f"stage {ex.stage} expected the control of iteration {k}, "
                                   f"got {control.step}")
        else:
            control = ex.link.receive_control(k)
        if not ex.is_last:
            ex.link.send_control(control)
        return control

    def _next_control(self, start: int, begun: int, decide, load, batches: dict[int, Batch]):
        """The control of the segment's next iteration, which must say go; its data is loaded."""
        k = start + begun
        control = self._control(k, decide)
        if not control.go:
            raise RuntimeError(f"stage {self.executor.stage}: iteration {k} was stopped in the "
                               "middle of a segment (only the previous iteration's control may "
                               "end it)")
        batches[k] = load(k)
        end = (begun + 1) * self.microbatches if control.last else None
        return control, end, begun + 1
