"""Executor of one pipeline stage: runs a schedule's actions and moves tensors between stages.

A pipeline of ``S`` stages is ``S`` processes; :class:`PipelineStage` is the part of one
process that, given an action list from :mod:`sdpipe_cli.core.schedule`, computes forwards and
backwards of its blocks and exchanges activations and gradients with its neighbours by
point-to-point ``torch.distributed`` calls (gloo on CPU, NCCL on CUDA):

* forward ``F(i)``: the first stage reads micro-batch ``i``'s tokens; the others receive the
  activation from the previous stage. Non-last stages send their output forward; the last
  stage turns it into ``loss_fn(logits, targets[i]) / m``.
* backward ``B(i)``: the last stage back-propagates the loss; the others receive the gradient
  of their output from the next stage. Non-first stages send the gradient of their input back.

Parameter gradients accumulate in ``.grad`` over the ``m`` micro-batches; the caller zeroes
them and steps the optimizer. A stage keeps a micro-batch's input and output only from its
forward to its backward, so under 1F1B it holds at most ``S - stage`` of them.

Why it does not deadlock
------------------------
In 1F1B's steady state two neighbours send to each other at the same moment (stage ``s`` an
activation, ``s + 1`` a gradient); two blocking sends would wait for each other forever. So
every send is an ``isend`` whose handle and buffer are kept, and a stage waits on a send only
when the receiver cannot be waiting on it in turn:

* the activation of micro-batch ``i`` once its gradient has come back (the next stage used
  it, so the wait returns at once);
* the oldest gradient sends when more than ``S - stage`` are pending: the previous stage
  only ever waits on this one for gradients, all of which up to that one are already posted;
* everything left, at the end of :meth:`PipelineStage.run`.

Each handle is waited on exactly once (gloo hangs on a second wait of a receive, and its
``is_completed()`` stays False until ``wait()``, so it cannot be polled). When the action
after a send receives from the peer just sent to (the exchange above), the send and that
receive are posted together with ``batch_isend_irecv``, as Megatron-LM and
``torch.distributed.pipelining`` do: NCCL serialises a pair's operations on one stream and
runs them concurrently only within one group call; gloo just posts the two.

Messages are matched by order, not by tag (NCCL ignores tags): between two neighbours only
activations flow forward and only gradients backward, p2p messages of a pair arrive in the
order sent, and both neighbours' lists run forwards and backwards in micro-batch order, which
:meth:`PipelineStage.run` checks.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli.core.schedule import Action

__all__ = ["PipelineStage"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineStage:
    """One stage of one pipeline: ``module`` holds blocks ``[a, b)`` of the model.

    ``prev_rank``/``next_rank`` are the neighbours' global ranks (None at the ends);
    ``activation_shape`` is the shape of one micro-batch's activation between stages, of
    ``dtype``, on ``device``. ``before_action(action)`` is called before each action (before
    it waits for its input) and ``on_action(action, seconds)`` after its compute, with the
    compute's wall time (not the waits for neighbours), before its output is sent. Neither is
    called by :meth:`forward_only`. ``before_send(dst,
    tensor)`` is called before every send (the emulated network's delay).
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
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.activation_shape = tuple(activation_shape)
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.dtype = dtype
        self.group = group
        self.before_action = before_action
        self.on_action = on_action
        self.before_send = before_send
        # Pending sends: (what, handles, buffer); "what" is F(i) for the activation of
        # micro-batch i, B(i) for the gradient of its input.
        self._sends: List[Tuple[Action, list, torch.Tensor]] = []
        self._posted: Optional[Tuple[int, torch.Tensor, object]] = None  # (src, buffer, work)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- one iteration ----------------------------------------------------------------------

    def run(
        self,
        actions: Sequence[Action],
        inputs: Optional[Sequence[torch.Tensor]] = None,
        targets: Optional[Sequence[torch.Tensor]] = None,
    ) -> Optional[float]:
        """Run one iteration's ``actions``; return the mean loss on the last stage, else None.

        ``inputs`` (first stage) and ``targets`` (last stage) hold one tensor per micro-batch.
        """
        actions = list(actions)
        m = _check_actions(actions)
        self._check_data(m, inputs, targets)
        stash: Dict[int, Tuple[Optional[torch.Tensor], torch.Tensor]] = {}  # i -> (input, output)
        total = None
        for index, action in enumerate(actions):
            i = action.microbatch
            if self.before_action is not None:
                self.before_action(action)
            outgoing = None  # (tensor, peer)
            if action.kind == "F":
                x = self._input(i, inputs)
                start = time.perf_counter()
                y = self.module(x)
                if self.is_last:
                    y = self.loss_fn(y, targets[i].to(self.device)) / m
                    total = y.detach() if total is None else total + y.detach()
                else:
                    outgoing = (self._checked(y).detach(), self.next_rank)
                stash[i] = (None if self.is_first else x, y)
            else:
                x, y = stash.pop(i)
                grad = None
                if not self.is_last:
                    grad = self._receive(self.next_rank)
                    self._wait_sends(lambda what: what == Action("F", i))
                start = time.perf_counter()
                torch.autograd.backward(y, grad)
                if not self.is_first:
                    outgoing = (x.grad if x.grad is not None else torch.zeros_like(x), self.prev_rank)
                del x, y, grad
            if self.on_action is not None:
                # Before the send: an emulated slow device must also deliver its output late.
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # time the kernels, not their launch
                self.on_action(action, time.perf_counter() - start)
            if outgoing is not None:
                following = actions[index + 1] if index + 1 < len(actions) else None
                self._send(action, *outgoing, following)
                self._wait_sends(lambda what: what.kind == "B", keep=self.num_stages - self.stage)
        self._wait_sends()
        return float(total) if self.is_last else None

    def forward_only(
        self,
        inputs: Optional[Sequence[torch.Tensor]] = None,
        targets: Optional[Sequence[torch.Tensor]] = None,
        microbatches: Optional[int] = None,
    ) -> Optional[float]:
        """Forward micro-batches through the pipeline without autograd; mean loss on the last stage.

        The micro-batch count comes from ``inputs`` or ``targets``; a middle stage has neither,
        so it must be given ``microbatches``. The module's train/eval mode is the caller's.
        """
        known = inputs if self.is_first else targets if self.is_last else None
        m = len(known) if known is not None else microbatches
        if m is None or m < 1:
            raise ValueError(f"stage {self.stage}: forward_only needs microbatches >= 1")
        self._check_data(m, inputs, targets)
        total = None
        with torch.no_grad():
            for i in range(m):
                y = self.module(self._input(i, inputs, requires_grad=False))
                if self.is_last:
                    loss = self.loss_fn(y, targets[i].to(self.device))
                    total = loss if total is None else total + loss
                else:
                    self._send(Action("F", i), self._checked(y), self.next_rank, None)
                    self._wait_sends(lambda what: True, keep=self.num_stages - self.stage)
        self._wait_sends()
        return float(total) / m if self.is_last else None

    # -- helpers --------------------------------------------------------------------------------

    def _check_data(self, m: int, inputs, targets) -> None:
        for name, data, needed in (("inputs", inputs, self.is_first), ("targets", targets, self.is_last)):
            if needed and (data is None or len(data) != m):
                got = "None" if data is None else len(data)
                raise ValueError(f"stage {self.stage} needs {m} {name} (one per micro-batch), got {got}")

    def _input(self, i: int, inputs, requires_grad: bool = True) -> torch.Tensor:
        if self.is_first:
            return inputs[i].to(self.device)
        x = self._receive(self.prev_rank)
        return x.requires_grad_(requires_grad)

    def _checked(self, y: torch.Tensor) -> torch.Tensor:
        # A wrong size would hang or misalign the receiver instead of failing here.
        if tuple(y.shape) != self.activation_shape or y.dtype != self.dtype:
            raise RuntimeError(
                f"stage {self.stage} output is {tuple(y.shape)} {y.dtype}, but the pipeline "
                f"sends activations of {self.activation_shape} {self.dtype}"
            )
        return y.contiguous()

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)

    def _source(self, action: Optional[Action]) -> Optional[int]:
        """The rank ``action`` receives from (None if it receives nothing)."""
        if action is None:
            return None
        return self.prev_rank if action.kind == "F" else self.next_rank

    def _receive(self, src: int) -> torch.Tensor:
        if self._posted is not None:
            posted_src, buffer, work = self._posted
            assert posted_src == src, (posted_src, src)
            self._posted = None
            work.wait()
            return buffer
        buffer = self._buffer()
        dist.recv(buffer, src=src, group=self.group)
        return buffer

    def _send(self, what: Action, tensor: torch.Tensor, dst: int, following: Optional[Action]) -> None:
        """Send without blocking; post ``following``'s receive with it if it comes from ``dst``."""
        if self.before_send is not None:
            self.before_send(dst, tensor)  # an emulated link's transfer time
        if self._source(following) == dst:
            buffer = self._buffer()
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, tensor, dst, self.group),
                    dist.P2POp(dist.irecv, buffer, dst, self.group),
                ]
            )
            # One handle per op (gloo), or a single one for both when the backend coalesces
            # (NCCL); either way the last is waited on by the receive.
            self._posted = (dst, buffer, works[-1])
            works = works[:-1]
        else:
            works = [dist.isend(tensor, dst, group=self.group)]
        self._sends.append((what, works, tensor))

    def _wait_sends(self, which: Callable[[Action], bool] = lambda what: True, keep: int = 0) -> None:
        """Wait on the pending sends selected by ``which``, oldest first, until ``keep`` remain."""
        selected = [entry for entry in self._sends if which(entry[0])]
        done = selected[: max(len(selected) - keep, 0)]
        for _, works, _ in done:
            for work in works:
                work.wait()
        done_ids = {id(entry) for entry in done}
        self._sends = [entry for entry in self._sends if id(entry) not in done_ids]


def _check_actions(actions: List[Action]) -> int:
    """Number of micro-batches of ``actions``; ValueError unless F0..F(m-1) and B0..B(m-1) in
    order with each B after its F (neighbours match messages by order)."""
    forwarded = set()
    for a in actions:
        if a.kind not in ("F", "B"):
            raise ValueError(f"unknown action kind {a.kind!r} in {a}")
        if a.kind == "B" and a.microbatch not in forwarded:
            raise ValueError(f"{a} comes before F{a.microbatch}")
        if a.kind == "F":
            forwarded.add(a.microbatch)
    forwards = [a.microbatch for a in actions if a.kind == "F"]
    backwards = [a.microbatch for a in actions if a.kind == "B"]
    m = len(forwards)
    if m == 0 or forwards != list(range(m)) or backwards != list(range(m)):
        raise ValueError(
            "actions must hold F0..F(m-1) and B0..B(m-1), each in micro-batch order, got "
            + " ".join(str(a) for a in actions)
        )
    return m
