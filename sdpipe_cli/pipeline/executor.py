"""The core both pipeline executors share: one stage's blocks, its place in the pipeline, its hooks,
its :class:`~sdpipe_cli.pipeline.p2p.Link`, and the compute of one forward or one backward.

A pipeline of ``S`` stages is ``S`` processes, one :class:`Executor` each. Which action runs
when is the loops' business: :meth:`sdpipe_cli.pipeline.stage.PipelineStage.run` runs a flushed
schedule's list (1F1B, GPipe), :meth:`sdpipe_cli.pipeline.async_stage.AsyncStage.run_segment`
the asynchronous stream. What one action does is the same for both and lives here:

* forward ``F(i)``: the first stage reads micro-batch ``i``'s tokens; the others receive the
  activation from the previous stage. Non-last stages return their output to send forward; the
  last stage turns it into ``loss_fn(logits, targets[i])`` (divided by ``scale``).
* backward ``B(i)``: the last stage back-propagates the loss; the others receive the gradient
  of their output from the next stage. Non-first stages return the gradient of their input to
  send back.

Both run on the live parameters (gradients accumulate in ``.grad``), or, given ``weights``, on
a stashed version of them through ``torch.func.functional_call``, the parameter gradients
still added to the live ``.grad`` (asynchronous 1F1B's weight stashing). Moving the tensors,
and when a send may be waited on, is :mod:`sdpipe_cli.pipeline.p2p`'s.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.pipeline.p2p import Link

__all__ = ["Executor", "LossFn", "OnExecutor"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Weights = Callable[[], Mapping[str, torch.Tensor]]


class Executor:
    """One stage of one pipeline: ``module`` holds blocks ``[a, b)`` of the model.

    ``prev_rank``/``next_rank`` are the neighbours' global ranks (None at the ends);
    ``activation_shape`` is the shape of one micro-batch's activation between stages, of
    ``dtype``, on ``device``. ``before_action(action)`` is called before each action (before
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
        prev_rank: Optional[int],
        next_rank: Optional[int],
        activation_shape: Sequence[int],
        device: torch.device,
        loss_fn: LossFn,
        dtype: torch.dtype = torch.float32,
        group: Optional[dist.ProcessGroup] = None,
        before_action: Optional[Callable[[Action], None]] = None,
        on_action: Optional[Callable[[Action, float], None]] = None,
        before_send: Optional[Callable[[int, torch.Tensor], None]] = None,
        rank_offset: int = 0,
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
        self.link = Link(prev_rank, next_rank, activation_shape, dtype, self.device, group,
                         before_send, stage=stage, rank_offset=rank_offset)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- one action ---------------------------------------------------------------------------

    def forward(self, action: Action, index: int, inputs, targets, scale: int = 1,
                weights: Optional[Weights] = None
                ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """Run forward ``action`` on micro-batch ``index`` of ``inputs``/``targets`` (the first
        and the last stage's data; the others receive). Returns the input to keep for the
        backward (None on the first stage), the output (the loss on the last stage, divided by
        ``scale``) and the tensor to send forward (None on the last stage). ``weights()``, if
        given, is called once the input is in and gives the tensors to run the blocks with."""
        self._before(action)
        x = self.input(index, inputs)
        started = time.perf_counter()  # compute only, not the wait for the input
        y = self.module(x) if weights is None else functional_call(self.module, weights(), (x,))
        outgoing = None
        if self.is_last:
            y = self.loss_fn(y, targets[index].to(self.device))
            if scale != 1:
                y = y / scale
        else:
            outgoing = self.checked(y).detach()
        self._after(action, started)
        return (None if self.is_first else x), y, outgoing

    def backward(self, action: Action, x: Optional[torch.Tensor], y: torch.Tensor,
                 weights: Optional[Weights] = None) -> Optional[torch.Tensor]:
        """Run backward ``action`` of a forward that took ``x`` (None on the first stage) to
        ``y``: receive the output's gradient (unless last), add the parameter gradients to the
        live ``.grad`` and return the input's gradient to send back (None on the first stage).
        ``weights()``, if given, gives the tensors the forward ran the blocks with."""
        self._before(action)
        grad = None
        if not self.is_last:
            grad = self.link.receive(self.link.next_rank)
            self.link.wait_delivered(action.microbatch)
        started = time.perf_counter()
        if weights is None:
            torch.autograd.backward(y, grad)
            dx = None if x is None else x.grad if x.grad is not None else torch.zeros_like(x)
        else:
            dx = self._stashed_backward(x, y, grad, weights())
        self._after(action, started)
        return dx

    def send(self, action: Action, tensor: torch.Tensor, following: Optional[Action]) -> None:
        """Send ``action``'s output (forward: to the next stage, backward: to the previous one);
        ``following`` is the next action, whose receive the send may post."""
        self.link.send(action, tensor, self.link.destination(action), following)
        self.link.wait_gradients(keep=self.num_stages - self.stage)

    # -- evaluation ------------------------------------------------------------------------------

    def forward_only(
        self,
        inputs: Optional[Sequence[torch.Tensor]] = None,
        targets: Optional[Sequence[torch.Tensor]] = None,
        microbatches: Optional[int] = None,
    ) -> Optional[float]:
        """Forward micro-batches through the pipeline without autograd; mean loss on the last stage.

        The micro-batch count comes from ``inputs`` or ``targets``; a middle stage has neither,
        so it must be given ``microbatches``. The module's train/eval mode is the caller's. It
        runs on the live parameters, so an asynchronous pipeline calls it only when drained.
        """
        known = inputs if self.is_first else targets if self.is_last else None
        m = len(known) if known is not None else microbatches
        if m is None or m < 1:
            raise ValueError(f"stage {self.stage}: forward_only needs microbatches >= 1")
        self.check_data(m, inputs, targets)
        total = None
        with torch.no_grad():
            for i in range(m):
                y = self.module(self.input(i, inputs, requires_grad=False))
                if self.is_last:
                    loss = self.loss_fn(y, targets[i].to(self.device))
                    total = loss if total is None else total + loss
                else:
                    self.link.send(Action(Kind.F, i), self.checked(y), self.link.next_rank, None)
                    self.link.wait_sends(keep=self.num_stages - self.stage)
        self.link.wait_sends()
        return float(total) / m if self.is_last else None

    # -- helpers ------------------------------------------------------------------------------------

    def check_data(self, m: int, inputs, targets) -> None:
        """ValueError unless the first stage has ``m`` inputs and the last ``m`` targets."""
        for name, data, needed in (("inputs", inputs, self.is_first), ("targets", targets, self.is_last)):
            if needed and (data is None or len(data) != m):
                got = "None" if data is None else len(data)
                raise ValueError(f"stage {self.stage} needs {m} {name} (one per micro-batch), got {got}")

    def input(self, i: int, inputs, requires_grad: bool = True) -> torch.Tensor:
        """Micro-batch ``i``'s input: read on the first stage, received on the others."""
        if self.is_first:
            return inputs[i].to(self.device)
        x = self.link.receive(self.link.prev_rank)
        return x.requires_grad_(requires_grad)

    def checked(self, y: torch.Tensor) -> torch.Tensor:
        """``y``, contiguous, if it is what the next stage expects; a wrong size would hang or
        misalign the receiver instead of failing here."""
        shape, dtype = self.link.activation_shape, self.link.dtype
        if tuple(y.shape) != shape or y.dtype != dtype:
            raise RuntimeError(
                f"stage {self.stage} output is {tuple(y.shape)} {y.dtype}, but the pipeline "
                f"sends activations of {shape} {dtype}"
            )
        return y.contiguous()

    def _before(self, action: Action) -> None:
        if self.before_action is not None:
            self.before_action(action)

    def _after(self, action: Action, started: float) -> None:
        if self.on_action is not None:
            # Before the send: an emulated slow device must also deliver its output late.
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the kernels, not their launch
            self.on_action(action, time.perf_counter() - started)

    def _stashed_backward(self, x: Optional[torch.Tensor], y: torch.Tensor,
                          grad: Optional[torch.Tensor],
                          weights: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Differentiate with respect to the input and the stashed ``weights`` (``autograd.grad``,
        so micro-batches sharing a version do not mix their gradients), and add the parameter
        gradients to the live parameters' ``.grad``; returns the input's gradient."""
        names = list(weights)
        wrt = ([x] if x is not None else []) + [weights[n] for n in names]
        grads = torch.autograd.grad(y, wrt, grad, allow_unused=True)
        taken = set()  # autograd may return one tensor for several inputs: never share
        dx = None
        if x is not None:
            dx = grads[0] if grads[0] is not None else torch.zeros_like(x)
            taken.add(id(dx))
            grads = grads[1:]
        live: Dict[str, nn.Parameter] = dict(self.module.named_parameters())
        for name, g in zip(names, grads):
            p = live[name]
            if g is None:
                g = torch.zeros_like(p)
            elif id(g) in taken:  # .grad is modified in place (clipping, all-reduce)
                g = g.clone()
            taken.add(id(g))
            p.grad = g if p.grad is None else p.grad.add_(g)  # the caller zeroes it
        return dx


class OnExecutor:
    """What both stage loops share: the :class:`Executor` they run on, its module, and
    evaluation, which runs at points where the live weights are the pipeline's model."""

    executor: Executor

    @property
    def module(self) -> nn.Module:
        return self.executor.module

    def forward_only(
        self,
        inputs: Optional[Sequence[torch.Tensor]] = None,
        targets: Optional[Sequence[torch.Tensor]] = None,
        microbatches: Optional[int] = None,
    ) -> Optional[float]:
        """:meth:`Executor.forward_only`."""
        return self.executor.forward_only(inputs, targets, microbatches)
