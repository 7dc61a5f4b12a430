"""The core both pipeline executors share: one stage's blocks, its place in the pipeline, its hooks,
its :class:`~sdpipe_cli.pipeline.p2p.Link`, and the compute of one forward or one backward.

A pipeline of ``S`` stages is ``S`` processes, one :class:`Executor` each. Which action runs
when is the loops' business: :meth:`sdpipe_cli.pipeline.stage.FlushedStage.run` runs a flushed
schedule's list (1F1B, GPipe), :meth:`sdpipe_cli.pipeline.async_stage.AsyncStage.run_segment`
the asynchronous stream. What one action does is the same for both and lives here:

* forward ``F(i)``: the first stage reads micro-batch ``i``'s inputs; the others receive the
  activation from the previous stage. Non-last stages return their output to send forward; the
  last stage turns it into ``loss_fn(output, targets[i])`` (divided by ``scale``).
* backward ``B(i)``: the last stage back-propagates the loss; the others receive the gradient
  of their output from the next stage. Non-first stages return the gradient of their input to
  send back.

An activation is whatever the stage's blocks return, a tensor or a tuple or dict of tensors; its
layout at each boundary (:class:`~sdpipe_cli.model.boundary.Boundary`) is fixed when the
pipeline is set up, checked on every send, and travels as one message; gradients travel back
for its floating-point tensors.

Both run on the live parameters (gradients accumulate in ``.grad``), or, given ``weights``, on
a stashed version of them through ``torch.func.functional_call``, the parameter gradients
still added to the live ``.grad`` (asynchronous 1F1B's weight stashing). Moving the tensors,
and when a send may be waited on, is :mod:`sdpipe_cli.pipeline.p2p`'s.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.model.boundary import Boundary, map_tensors
from sdpipe_cli.pipeline.p2p import NEXT, PREV, Groups, Link

__all__ = ["Deferred", "Executor", "LossFn", "OnExecutor", "SPLIT_BACKWARD", "StageBoundaries"]

# torch's split of a backward into its input and weight parts; importing it takes seconds (its
# package loads torch's whole pipelining), so a run of a zero-bubble schedule has its fork
# server import it once for all workers (the launcher's preload), and no other run does.
SPLIT_BACKWARD = "torch.distributed.pipelining._backward"

LossFn = Callable[[Any, Any], torch.Tensor]
Weights = Callable[[], Mapping[str, torch.Tensor]]
# What a stage receives from the previous one and sends to the next (None at the ends); or one
# tensor shape, the same at every boundary of the pipeline.
StageBoundaries = tuple[Boundary | None, Boundary | None] | Sequence[int]


@dataclass
class Deferred:
    """What a zero-bubble ``W`` needs of its micro-batch's ``B``: the gradients reaching the
    stage's weights (``groups``, torch's split), or, on the first stage, the whole backward's
    outputs and their gradients."""

    outputs: list[torch.Tensor] | None = None
    grads: Any = None
    groups: list[dict[str, Any]] | None = None


def device_timed(device_type: str, hook: Any) -> bool:
    """Whether an action's compute is given to ``hook`` as two CUDA events (its
    ``timed(start, end)``, read at the iteration's end) rather than as seconds after a
    ``torch.cuda.synchronize``: on CUDA, where the hook says nothing in it needs the kernels
    done when the action ends (``times_on_device``: the busy-time sum of a default run, which
    would otherwise make every forward and backward wait for the device). An emulated slow
    device sleeps after its kernels, and a trace times them: those synchronize."""
    return device_type == "cuda" and bool(getattr(hook, "times_on_device", False))


class Executor:
    """One stage of one pipeline: ``module`` holds blocks ``[a, b)`` of the model.

    ``prev_rank``/``next_rank`` are the neighbours' global ranks (None at the ends);
    ``boundaries`` the layouts of one micro-batch's activation coming in and going out (or one
    shape of ``dtype`` for both), on ``device``. ``before_action(action)`` is called before each action (before
    it waits for its input) and ``on_action(action, seconds)`` after its compute, with the
    compute's wall time (not the waits for neighbours), before its output is sent. Neither is
    called by :meth:`forward_only`. ``before_send(dst, tensor)`` is called before every send
    (the emulated network's delay). ``rank_offset``: the global rank of ``group``'s rank 0
    (see :class:`~sdpipe_cli.pipeline.p2p.Link`).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        prev_rank: int | None,
        next_rank: int | None,
        boundaries: StageBoundaries,
        device: torch.device,
        loss_fn: LossFn,
        dtype: torch.dtype = torch.float32,
        group: Groups = None,
        before_action: Callable[[Action], None] | None = None,
        on_action: Callable[[Action, float], None] | None = None,
        before_send: Callable[[int, torch.Tensor], None] | None = None,
        rank_offset: int = 0,
        autocast: torch.dtype | None = None,
        checkpointing: bool = False,
    ):
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        if (prev_rank is None) != (stage == 0):
            raise ValueError(f"stage {stage}: prev_rank must be None exactly on the first stage")
        if (next_rank is None) != (stage == num_stages - 1):
            raise ValueError(f"stage {stage}: next_rank must be None exactly on the last stage")
        self.module = module
        self.stage = stage
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.before_action = before_action
        self.on_action = on_action
        self._start_event: torch.cuda.Event | None = None  # see _started
        self.autocast, self.checkpointing = autocast, checkpointing
        self.loss_scale = 1.0  # fp16: the last stage multiplies the loss by it before backward
        if not (isinstance(boundaries, tuple) and len(boundaries) == 2
                and all(b is None or isinstance(b, Boundary) for b in boundaries)):
            same = Boundary.tensor(cast(Sequence[int], boundaries), dtype)  # not a pair: a shape
            boundaries = (same, same)
        pair = cast("tuple[Boundary | None, Boundary | None]", boundaries)  # checked, or built
        self.incoming = None if self.is_first else pair[0]
        self.outgoing = None if self.is_last else pair[1]
        sizes = (0 if self.incoming is None else self.incoming.nbytes,
                 0 if self.outgoing is None else self.outgoing.grads().nbytes)
        self.link = Link(prev_rank, next_rank, sizes, self.device, group,
                         before_send, stage=stage, rank_offset=rank_offset)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- one action ---------------------------------------------------------------------------

    def forward(self, action: Action, index: int, inputs, targets, scale: int = 1,
                weights: Weights | None = None
                ) -> tuple[list[torch.Tensor] | None, Any, torch.Tensor | None]:
        """Run forward ``action`` on micro-batch ``index`` of ``inputs``/``targets`` (the first
        and the last stage's data; the others receive). Returns what the backward needs of the
        input (None on the first stage), of the output (the loss on the last stage, divided by
        ``scale``) and the message to send forward (None on the last stage). ``weights()``, if
        given, is called once the input is in and gives the tensors to run the blocks with."""
        self._before(action)
        x, leaves = self.input(index, inputs)
        started = self._started()  # compute only, not the wait for the input
        # the stashed weights, if given: a recompute in the backward (activation checkpointing)
        # calls ``run`` again, so nothing below may rebind the name
        stashed = None if weights is None else weights()
        run = ((lambda v: self.module(v)) if stashed is None else
               (lambda v: functional_call(self.module, stashed, (v,))))
        with self._precision():
            y = checkpoint(run, x, use_reentrant=False) if self.checkpointing else run(x)
            if self.is_last:
                y = self.loss_fn(y, to_device(targets[index], self.device))
        outgoing = None
        if self.is_last:
            if scale != 1:
                y = y / scale
            if self.loss_scale != 1:
                y = y.float() * self.loss_scale
        else:
            boundary = cast(Boundary, self.outgoing)  # set on every stage but the last
            tensors = boundary.flatten(y, f"stage {self.stage}'s output")
            outgoing = boundary.pack(tensors, self.device)
            y = [tensors[i] for i in boundary.differentiable()]
        self._after(action, started)
        return leaves, y, outgoing

    def backward(self, action: Action, x: list[torch.Tensor] | None, y: Any,
                 weights: Weights | None = None) -> torch.Tensor | None:
        """Run backward ``action`` of a forward that returned ``x`` and ``y``: receive the
        output's gradient (unless last), add the parameter gradients to the live ``.grad`` and
        return the input's gradient to send back (None on the first stage). ``weights()``, if
        given, gives the tensors the forward ran the blocks with."""
        self._before(action)
        outputs, grads = self._output_gradients(action, y)
        started = self._started()
        if weights is None:
            if outputs:
                torch.autograd.backward(outputs, grads)
            dxs = None if x is None else [t.grad if t.grad is not None else torch.zeros_like(t) for t in x]
        else:
            dxs = self._stashed_backward(x, outputs, grads, weights())
        self._after(action, started)
        # dxs is set only past the first stage, which has an incoming boundary
        return None if dxs is None else cast(Boundary, self.incoming).grads().pack(dxs, self.device)

    def backward_input(self, action: Action, x: list[torch.Tensor] | None, y: Any
                       ) -> tuple[torch.Tensor | None, Deferred]:
        """A zero-bubble schedule's ``B``: as :meth:`backward`, but only the input's gradient
        (the message to send back, None on the first stage); the parameters' is left to
        :meth:`backward_weight`, given what is returned with it. torch's own split of the
        backward (``torch.distributed.pipelining``'s, which its zero-bubble schedules run)
        keeps the gradients reaching each block's weights, so the ``W`` does not go through the
        graph again. The first stage sends nothing back: its ``W`` is the whole backward."""
        self._before(action)
        outputs, grads = self._output_gradients(action, y)
        started = self._started()
        if x is None or not outputs:
            deferred, message = Deferred(outputs, grads), None
        else:
            params = [p for p in self.module.parameters() if p.requires_grad]
            dinputs, groups = importlib.import_module(SPLIT_BACKWARD).stage_backward_input(
                outputs, grads, x, iter(params))
            dxs = [d if d is not None else torch.zeros_like(t) for d, t in zip(dinputs, x)]
            incoming = cast(Boundary, self.incoming)  # x is set: not the first stage
            deferred, message = Deferred(groups=groups), incoming.grads().pack(dxs, self.device)
        self._after(action, started)
        return message, deferred

    def backward_weight(self, action: Action, deferred: Deferred) -> None:
        """A zero-bubble schedule's ``W``: add the parameter gradients of a micro-batch whose
        ``B`` (:meth:`backward_input`) gave ``deferred`` to the live ``.grad``."""
        self._before(action)
        started = self._started()
        if deferred.groups is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            importlib.import_module(SPLIT_BACKWARD).stage_backward_weight(iter(params), deferred.groups)
        elif deferred.outputs:
            torch.autograd.backward(deferred.outputs, deferred.grads)
        self._after(action, started)

    def _output_gradients(self, action: Action, y: Any) -> tuple[list[torch.Tensor], Any]:
        """What a backward differentiates and by what: the loss on the last stage (None: by
        one), else the outputs that need a gradient and theirs, received from the next stage."""
        if self.is_last:
            return [y], None
        # not the last stage: it has a next rank and an outgoing boundary
        buffer = self.link.receive(NEXT)
        self.link.wait_delivered(action.microbatch)
        outgoing = cast(Boundary, self.outgoing)
        pairs = [(t, g.to(t.dtype)) for t, g in zip(y, outgoing.grads().unpack(buffer))
                 if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def send(self, action: Action, tensor: torch.Tensor, following: Action | None) -> None:
        """Send ``action``'s output (forward: to the next stage, backward: to the previous one);
        ``following`` is the next action, whose receive the send may post."""
        # an action with an output to send has a destination
        self.link.send(action, tensor, cast(str, self.link.destination(action)), following)
        self.link.wait_gradients(keep=self.num_stages - self.stage)

    # -- evaluation ------------------------------------------------------------------------------

    def forward_only(
        self,
        inputs: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        microbatches: int | None = None,
        observe: Callable[[Any, Any], None] | None = None,
    ) -> float | None:
        """Forward micro-batches through the pipeline without autograd; mean loss on the last stage.

        The micro-batch count comes from ``inputs`` or ``targets``; a middle stage has neither,
        so it must be given ``microbatches``. The module's train/eval mode is the caller's. It
        runs on the live parameters, so an asynchronous pipeline calls it only when drained.
        ``observe(output, target)`` sees each micro-batch's output on the last stage (accuracy).
        """
        known = inputs if self.is_first else targets if self.is_last else None
        m = len(known) if known is not None else microbatches
        if m is None or m < 1:
            raise ValueError(f"stage {self.stage}: forward_only needs microbatches >= 1")
        self.check_data(m, inputs, targets)
        total = None
        for i in range(m):
            loss = self.forward_one(i, inputs, targets, observe)
            total = loss if total is None or loss is None else total + loss
            self.link.wait_sends(keep=self.num_stages - self.stage)
        self.link.wait_sends()
        # the last stage's total is set: it summed m >= 1 losses
        return float(cast(torch.Tensor, total)) / m if self.is_last else None

    def forward_one(self, i: int, inputs, targets,
                    observe: Callable[[Any, Any], None] | None = None) -> torch.Tensor | None:
        """Micro-batch ``i`` forward without autograd (:meth:`forward_only`'s step): its loss on
        the last stage, else None, its output's send posted and left to the caller to wait on."""
        with torch.no_grad():
            with self._precision():
                y = self.module(self.input(i, inputs, requires_grad=False)[0])
            if self.is_last:
                # the caller checked that the last stage has its targets
                target = to_device(cast(Sequence[Any], targets)[i], self.device)
                with self._precision():
                    loss = self.loss_fn(y, target).float()
                if observe is not None:
                    observe(y, target)
                return loss
            boundary = cast(Boundary, self.outgoing)  # set: not the last stage
            tensors = boundary.flatten(y, f"stage {self.stage}'s output")
            self.link.send(Action(Kind.F, i), boundary.pack(tensors, self.device), NEXT, None)
            return None

    # -- helpers ------------------------------------------------------------------------------------

    def check_data(self, m: int, inputs, targets) -> None:
        """ValueError unless the first stage has ``m`` inputs and the last ``m`` targets."""
        for name, data, needed in (("inputs", inputs, self.is_first), ("targets", targets, self.is_last)):
            if needed and (data is None or len(data) != m):
                got = "None" if data is None else len(data)
                raise ValueError(f"stage {self.stage} needs {m} {name} (one per micro-batch), got {got}")

    def input(self, i: int, inputs, requires_grad: bool = True) -> tuple[Any, list[torch.Tensor] | None]:
        """Micro-batch ``i``'s input, read on the first stage, received on the others, and the
        received floating-point tensors that the backward differentiates (None on the first)."""
        if self.is_first:
            return to_device(inputs[i], self.device), None
        incoming = cast(Boundary, self.incoming)  # set: not the first stage
        tensors = incoming.unpack(self.link.receive(PREV))
        leaves = [tensors[k].requires_grad_(requires_grad) for k in incoming.differentiable()]
        return incoming.unflatten(tensors), leaves

    def _precision(self):
        """Autocast of the stage's compute (mixed precision), or nothing."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _before(self, action: Action) -> None:
        if self.before_action is not None:
            self.before_action(action)

    def _started(self) -> float:
        """An action's compute begins: the wall clock, and on a device whose ``on_action``
        hook can take the compute as two CUDA events (:func:`device_timed`), the first."""
        if device_timed(self.device.type, self.on_action):
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        return time.perf_counter()

    def _after(self, action: Action, started: float) -> None:
        if self.on_action is None:
            return
        if self._start_event is not None:  # read at the iteration's end, without a wait here
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            # a hook that times on the device (device_timed) takes the events: its timed()
            cast(Any, self.on_action).timed(self._start_event, end)
            self._start_event = None
            return
        # Before the send: an emulated slow device must also deliver its output late.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the kernels, not their launch
        self.on_action(action, time.perf_counter() - started)

    def _stashed_backward(self, x: list[torch.Tensor] | None, outputs: list[torch.Tensor],
                          grads: list[torch.Tensor] | None,
                          weights: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """Differentiate with respect to the input and the stashed ``weights`` (``autograd.grad``,
        so micro-batches sharing a version do not mix their gradients), and add the parameter
        gradients to the live parameters' ``.grad``; returns the input's gradients."""
        names = list(weights)
        inputs = list(x or [])
        wrt = inputs + [weights[n] for n in names]
        found = (torch.autograd.grad(outputs, wrt, grads, allow_unused=True) if outputs
                 else (None,) * len(wrt))
        taken: set[int] = set()  # autograd may return one tensor for several inputs: never share
        dxs = None
        if x is not None:
            dxs = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, found)]
            taken.update(id(g) for g in dxs)
        live: dict[str, nn.Parameter] = dict(self.module.named_parameters())
        for name, g in zip(names, found[len(inputs):]):
            p = live[name]
            if g is None:
                g = torch.zeros_like(p)
            elif id(g) in taken:  # .grad is modified in place (clipping, all-reduce)
                g = g.clone()
            taken.add(id(g))
            p.grad = g if p.grad is None else p.grad.add_(g)  # the caller zeroes it
        return dxs


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or a tuple, list or dict of them) on ``device``."""
    return map_tensors(lambda t: t.to(device), value)


class OnExecutor:
    """What both stage loops share: the :class:`Executor` they run on, its module, and
    evaluation, which runs at points where the live weights are the pipeline's model."""

    executor: Executor

    @property
    def module(self) -> nn.Module:
        return self.executor.module

    @property
    def executors(self) -> list[Executor]:
        """The executors this stage runs on (one; an interleaved stage has one per chunk)."""
        return [self.executor]

    def forward_only(
        self,
        inputs: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        microbatches: int | None = None,
        observe: Callable[[Any, Any], None] | None = None,
    ) -> float | None:
        """:meth:`Executor.forward_only`."""
        return self.executor.forward_only(inputs, targets, microbatches, observe)
