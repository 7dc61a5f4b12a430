"""Executor of asynchronous 1F1B (PipeDream) for one stage: a stream of micro-batches, an update
after every backward, weight stashing, and drains only where the worker asks for one.

:class:`AsyncStage` runs *segments*: the micro-batches of consecutive iterations, from a drained
point to the next one, in the order of :func:`sdpipe_cli.core.schedule.async_next`. Unlike
:meth:`PipelineStage.run` it does not flush at the end of an iteration: the forwards of
iteration k + 1 fill the slots where a flushed pipeline would wait for the backwards of
iteration k, so after the warm-up every stage is busy until the segment ends.

* ``F(j)``: take the weights for micro-batch j from the :class:`~sdpipe_cli.pipeline.stash.WeightStash`
  (the live ones, copied if they changed since the last copy) and run the blocks with them
  through ``torch.func.functional_call``; the module is never copied.
* ``B(j)``: differentiate with respect to the input and to the stashed tensors of j's version
  (``torch.autograd.grad``, so micro-batches sharing a version do not mix their gradients), add
  the parameter gradients to the live parameters' ``.grad``, free the version, send the input
  gradient back, and call ``update(j, loss)``: the worker's optimizer step and sync, applied to
  the latest weights, after every micro-batch (PipeDream) or after the last of an iteration,
  the gradients of its micro-batches accumulated (PipeDream-2BW, ``versions=2``).

Where a segment ends
--------------------
Each iteration k has a control message ``[go, step, save, last]`` decided by the first stage and
passed down the pipeline with tag :data:`CONTROL_TAG`, as in the flushed loop. ``last`` says that
iteration k ends the segment: after its forwards, every stage only runs the backwards left, so
the pipeline drains at the same batch id everywhere. ``go`` is only read at a segment's start
(0: the run is over). A stage needs the control of iteration k before it may receive iteration
k's first activation, and it receives it exactly then: just before posting that receive (when
the send of the preceding backward posts it together with the send, as ``batch_isend_irecv``
pairs them), or just before the forward otherwise. The previous stage sends it just before that
activation. So between two neighbours the control is matched by order, like the activations
(NCCL ignores tags): each side posts ``...``, ``control(k)``, ``activation(km)``, ``...`` in the
same order. Receiving it blocks a stage only until its predecessor reaches iteration k, which
needs nothing that this stage has not already sent: the deadlock-freedom argument of
:mod:`sdpipe_cli.pipeline.stage` carries over with the control counted as part of the activation.

Sends are waited on as in :mod:`sdpipe_cli.pipeline.stage`; a control send is waited on together with the
activation it precedes (both have arrived once that micro-batch's gradient came back). At the end
of a segment the stages pass a "drained" word from the last to the first (:meth:`_barrier`), so
the first stage starts the next segment only once the whole pipeline is one consistent model.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.func import functional_call

from sdpipe_cli.core.schedule import Action, async_next
from sdpipe_cli.pipeline.stage import PipelineStage
from sdpipe_cli.pipeline.stash import WeightStash

__all__ = ["AsyncStage", "CONTROL_TAG", "Control"]

CONTROL_TAG = 7  # the worker's control messages (activations and gradients use tag 0)
DRAINED_TAG = 8  # a stage and all after it made their last update of a segment

Batch = Tuple[Optional[Sequence[torch.Tensor]], Optional[Sequence[torch.Tensor]]]


class Control(NamedTuple):
    """The control message of one iteration, decided by the first stage."""

    go: bool  # at a segment's start: run iteration ``step`` (False: the run is over)
    step: int  # the iteration it is for; a stage that gets another one fails at once
    save: bool  # checkpoint at the drain that ends this segment
    last: bool  # this iteration ends the segment: drain after its forwards

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([int(self.go), self.step, int(self.save), int(self.last)],
                            dtype=torch.int64, device=device)

    @classmethod
    def of(cls, flag: torch.Tensor) -> "Control":
        go, step, save, last = (int(v) for v in flag.tolist())
        return cls(bool(go), step, bool(save), bool(last))


class AsyncStage(PipelineStage):
    """A :class:`PipelineStage` that runs asynchronous 1F1B segments with weight stashing.

    It takes over a configured ``stage`` (module, neighbours, activation shape, device, hooks), so
    that whatever the worker set up for the flushed executor applies here too; ``forward_only``
    (evaluation at drained points, with the live weights) is inherited. ``microbatches`` is m,
    the micro-batches of one iteration. ``versions`` bounds the weight versions kept (None: as
    many as micro-batches in flight, S - stage; 2 for PipeDream-2BW, whose weights change once
    per iteration). Set ``trace`` to a list to record ``(kind, batch id, weight version)`` for
    every action (tests).
    """

    def __init__(self, stage: PipelineStage, microbatches: int, versions: Optional[int] = None):
        vars(self).update(vars(stage))
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.microbatches = microbatches
        in_flight = self.num_stages - self.stage
        self.stash = WeightStash(self.module, in_flight if versions is None
                                 else min(in_flight, versions))
        self.trace: Optional[List[Tuple[str, int, int]]] = None

    def run_segment(
        self,
        start: int,
        decide: Optional[Callable[[int], Control]],
        load: Callable[[int], Batch],
        update: Callable[[int, Optional[float]], None],
    ) -> Tuple[int, Control]:
        """Run iterations from ``start`` until one whose control says ``last``, and drain.

        ``decide(k)`` (first stage only) gives iteration k's control; the other stages receive
        it. ``load(k)`` gives iteration k's micro-batches (inputs on the first stage, targets on
        the last, None elsewhere) once it begins. ``update(j, loss)`` runs after the backward of
        batch id ``j = k * m + i``, with the gradient in the live ``.grad`` and, on the last
        stage, that micro-batch's loss. Returns the iterations done at the drain (``start`` if
        the first control said stop) and the last control (its ``save`` is for the drain).
        """
        m, S, s = self.microbatches, self.num_stages, self.stage
        control = self._control(start, decide)
        if not control.go:
            self._wait_sends()  # the stop must reach the next stage before this one exits
            return start, control
        first_id = start * m
        batches: Dict[int, Batch] = {start: load(start)}
        begun = 1  # iterations of the segment whose control arrived
        end: Optional[int] = m if control.last else None  # the segment's length, once known
        in_flight: Dict[int, Tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        losses: Dict[int, float] = {}
        forwarded = backwarded = 0
        action = async_next(S, s, 0, 0, end)
        while action is not None:
            i = action.microbatch
            j = first_id + i
            if action.kind == "F" and i == begun * m:  # no send posted its receive: take it now
                control, end, begun = self._next_control(start, begun, decide, load, batches)
            if self.before_action is not None:
                self.before_action(Action(action.kind, j))
            outgoing = None  # (tensor, peer)
            if action.kind == "F":
                k, r = divmod(i, m)
                inputs, targets = batches[start + k]
                x = self._input(r, inputs)
                started = time.perf_counter()  # compute only, as PipelineStage.run times it
                version, weights = self.stash.acquire(j)
                y = functional_call(self.module, weights, (x,))
                if self.is_last:
                    y = self.loss_fn(y, targets[r].to(self.device))
                    losses[j] = float(y.detach())
                else:
                    outgoing = (self._checked(y).detach(), self.next_rank)
                in_flight[j] = (None if self.is_first else x, y)
                if r == m - 1:
                    del batches[start + k]
                forwarded += 1
            else:
                x, y = in_flight.pop(j)
                grad = None
                if not self.is_last:
                    grad = self._receive(self.next_rank)
                    control_of = j // m if j % m == 0 else None
                    self._wait_sends(lambda what: what == Action("F", j)
                                     or what == Action("C", control_of))
                started = time.perf_counter()
                version, weights = self.stash.get(j)
                names = list(weights)
                wrt = ([x] if x is not None else []) + [weights[n] for n in names]
                grads = torch.autograd.grad(y, wrt, grad, allow_unused=True)
                taken = set()  # autograd may return one tensor for several inputs: never share
                if x is not None:
                    outgoing = (grads[0] if grads[0] is not None else torch.zeros_like(x),
                                self.prev_rank)
                    taken.add(id(outgoing[0]))
                    grads = grads[1:]
                live = dict(self.module.named_parameters())
                for name, g in zip(names, grads):
                    p = live[name]
                    if g is None:
                        g = torch.zeros_like(p)
                    elif id(g) in taken:  # .grad is modified in place (clipping, all-reduce)
                        g = g.clone()
                    taken.add(id(g))
                    p.grad = g if p.grad is None else p.grad.add_(g)  # the caller zeroes it
                self.stash.release(j)
                del x, y, grad, grads
                backwarded += 1
            if self.trace is not None:
                self.trace.append((action.kind, j, version))
            if self.on_action is not None:  # before the send: a slow device delivers late too
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.on_action(Action(action.kind, j), time.perf_counter() - started)
            following = async_next(S, s, forwarded, backwarded, end)
            if (following is not None and following.kind == "F" and following.microbatch == begun * m
                    and outgoing is not None and outgoing[1] == self._source(following)):
                # This send posts the receive of the next iteration's first activation, which
                # the control of that iteration precedes.
                control, end, begun = self._next_control(start, begun, decide, load, batches)
            if outgoing is not None:
                after = None if following is None else Action(following.kind,
                                                              first_id + following.microbatch)
                self._send(Action(action.kind, j), *outgoing, after)
                self._wait_sends(lambda what: what.kind == "B", keep=S - s)
            if action.kind == "B":
                update(j, losses.pop(j, None))
            action = following
        self._wait_sends()
        self._barrier()
        return start + begun, control

    # -- control ----------------------------------------------------------------------------------
    def _control(self, k: int, decide: Optional[Callable[[int], Control]]) -> Control:
        """Iteration k's control: decided here on the first stage, else received; passed on."""
        if self.is_first:
            if decide is None:
                raise ValueError("the first stage needs decide()")
            control = decide(k)
            flag = control.tensor(self.device)
        else:
            flag = torch.empty(4, dtype=torch.int64, device=self.device)
            dist.recv(flag, src=self.prev_rank, tag=CONTROL_TAG, group=self.group)
            control = Control.of(flag)
        if control.step != k:
            raise RuntimeError(f"stage {self.stage} expected the control of iteration {k}, "
                               f"got {control.step}")
        if not self.is_last:
            work = dist.isend(flag, self.next_rank, tag=CONTROL_TAG, group=self.group)
            self._sends.append((Action("C", k), [work], flag))
        return control

    def _barrier(self) -> None:
        """Return on the first stage only once every stage made its last update of the segment.

        A drained point is where the pipeline is one consistent model, which it is only when
        every stage has also finished its update's sync round (a global sync's average, say).
        Without this the first stage, done first, would start the next segment, and ask the
        scheduler about it, while a later stage is still in the global round it drained for.
        Each stage passes the word up once the stage after it did: from the last stage, after
        its last gradient, in the same direction as the gradients, so matched by order too.
        """
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        if not self.is_last:
            dist.recv(flag, src=self.next_rank, tag=DRAINED_TAG, group=self.group)
        if not self.is_first:
            dist.send(flag, self.prev_rank, tag=DRAINED_TAG, group=self.group)

    def _next_control(self, start: int, begun: int, decide, load, batches: Dict[int, Batch]):
        """The control of the segment's next iteration, which must say go; its data is loaded."""
        k = start + begun
        control = self._control(k, decide)
        if not control.go:
            raise RuntimeError(f"stage {self.stage}: iteration {k} was stopped in the middle "
                               "of a segment (only the previous iteration's control may end it)")
        batches[k] = load(k)
        end = (begun + 1) * self.microbatches if control.last else None
        return control, end, begun + 1
