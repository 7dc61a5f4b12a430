"""Messages between neighbouring stages: the tags, the control message, and the link that sends
and receives without deadlock.

Every stage of a pipeline talks only to its two neighbours, by point-to-point
``torch.distributed`` calls (gloo on CPU, NCCL on CUDA). Three kinds of message travel:

* activations forward and gradients backward, tag :data:`TENSOR_TAG`, one flat byte message
  each (whatever tensors a boundary carries, packed by :mod:`sdpipe_cli.model.boundary`),
  sent and received through a :class:`Link`;
* the per-iteration :class:`Control` message, forward from the first stage, tag
  :data:`CONTROL_TAG`: the flushed loop (:meth:`sdpipe_cli.training.loop.FlushedLoop._agree`) sends
  it before each iteration, the asynchronous executor
  (:class:`sdpipe_cli.pipeline.async_stage.AsyncStage`) just before each iteration's first
  activation;
* the "drained" word of :meth:`Link.pass_drained`, backward from the last stage at the end of an
  asynchronous segment, tag :data:`DRAINED_TAG`.

Messages are matched by order, not by tag (NCCL ignores tags): p2p messages of a pair arrive in
the order sent, and both neighbours post them in the same order. Between two neighbours only
activations and controls flow forward and only gradients and the drained word backward; both
neighbours' action lists run forwards and backwards in micro-batch order (the executors check
it), and a control is sent and received at the same place relative to the activations.

Why it does not deadlock
------------------------
In 1F1B's steady state two neighbours send to each other at the same moment (stage ``s`` an
activation, ``s + 1`` a gradient); two blocking sends would wait for each other forever. So
every send is an ``isend`` whose handle and buffer a :class:`Link` keeps, and a stage waits on a
send only when the receiver cannot be waiting on it in turn:

* the sends to the next stage up to the activation of micro-batch ``i`` once its gradient has
  come back (:meth:`Link.wait_delivered`): the next stage used that activation, so it received
  it and everything sent before it (a control among them), and the wait returns at once;
* the oldest gradient sends when more than ``S - stage`` are pending
  (:meth:`Link.wait_gradients`): the previous stage only ever waits on this one for gradients,
  all of which up to that one are already posted;
* everything left, at the end of an iteration or a segment (:meth:`Link.wait_sends`).

A control is received blocking, but only where its sender posts it just before the activation
the receiver needs next; receiving it needs nothing the receiver has not already sent, so it
counts as part of that activation in the argument above.

On NCCL a pair of processes in a group shares one stream, both directions, and its operations
run in the order posted: a send whose receiver has its matching receive queued behind a send of
its own to this process waits for ever, where gloo's two directions are independent. 1F1B's
exchange above posts the two together; an interleaved stage, whose chunks talk to the same
neighbours in several orders, gives each direction a group of its own (:class:`Directed`), so
that each stream carries the messages of one direction, posted in the same order at both ends.

Each handle is waited on exactly once (gloo hangs on a second wait of a receive, and its
``is_completed()`` stays False until ``wait()``, so it cannot be polled). When the action after a
send receives from the peer just sent to (the exchange above), the send and that receive are
posted together with ``batch_isend_irecv``, as Megatron-LM and ``torch.distributed.pipelining``
do: NCCL serialises a pair's operations on one stream and runs them concurrently only within one
group call; gloo just posts the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, cast

import torch
import torch.distributed as dist

from sdpipe_cli.core.schedule import Action, Kind

__all__ = [
    "CONTROL_TAG",
    "Control",
    "ControlSend",
    "Directed",
    "EndGroup",
    "DRAINED_TAG",
    "Groups",
    "Link",
    "NEXT",
    "PREV",
    "Pending",
    "TENSOR_TAG",
    "receive_control",
    "send_control",
]

TENSOR_TAG = 0  # activations (forward) and gradients (backward)
PREV, NEXT = "prev", "next"  # a link's two ends: towards the previous stage, and the next
CONTROL_TAG = 7  # the per-iteration control message (forward)
DRAINED_TAG = 8  # a stage and all after it made their last update of a segment (backward)


class Control(NamedTuple):
    """The control message of one iteration, decided by the first stage and passed down.

    The asynchronous executor reads all four. Every iteration of the flushed loop ends in a
    flush, so there ``last`` says instead that the run is to end (a stop was asked for, or the
    time is up) while the strategy still goes on: its replicas meet after this iteration.
    """

    go: bool  # run iteration ``step`` (False: the run is over; async: read at a segment's start)
    step: int  # the iteration it is for; a stage that gets another one fails at once
    save: bool  # checkpoint at the end of this iteration (async: at the drain ending the segment)
    last: bool = False  # async: this iteration ends the segment, drain after its forwards;
    #                     flushed: the run is to end, meet after this iteration

    def tensor(self, device: torch.device) -> torch.Tensor:
        """Its wire form: four int64s ``[go, step, save, last]``."""
        return torch.tensor([int(self.go), self.step, int(self.save), int(self.last)],
                            dtype=torch.int64, device=device)

    @classmethod
    def of(cls, flag: torch.Tensor) -> Control:
        """The control a tensor of :meth:`tensor`'s form holds."""
        if flag.shape != (len(cls._fields),):
            raise ValueError(f"a control message is {len(cls._fields)} ints, got shape "
                             f"{tuple(flag.shape)}")
        go, step, save, last = (int(v) for v in flag.tolist())
        return cls(bool(go), step, bool(save), bool(last))


class ControlSend(NamedTuple):
    """What a pending send carries when it is iteration ``step``'s control (not an action)."""

    step: int

    def __str__(self) -> str:
        return f"C{self.step}"


Sent = Action | ControlSend


class Directed(NamedTuple):
    """An end's two process groups: one for the messages that travel forward (activations, the
    control) and one for those that travel backward (gradients, the drained word). On NCCL
    each group is a communicator of its own, and so a stream of its own for each pair of
    processes: with both directions on one stream, a send queued ahead of a receive from the
    same peer waits for that peer, whose own send may be queued ahead of the matching
    receive; with one direction a stream, a pair's sends and receives are posted in the same
    order at both ends and cannot wait for each other (see the module docstring)."""

    forward: dist.ProcessGroup | None
    backward: dist.ProcessGroup | None


# An end's group: one for both directions, or :class:`Directed`; given once for both ends, or
# as a pair (the prev end's, the next end's)
EndGroup: TypeAlias = "dist.ProcessGroup | Directed | None"
Groups: TypeAlias = "EndGroup | tuple[EndGroup, EndGroup]"


@dataclass
class Pending:
    """A send in flight: what it carries, where to, its handles and its buffer (kept alive until
    the send is waited on, which happens exactly once)."""

    what: Sent
    dst: str  # the link's end it goes out of: PREV or NEXT
    works: list
    buffer: torch.Tensor

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_control(control: Control, dst: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, offset: int = 0) -> Pending:
    """Post ``control`` to ``dst`` without blocking; the caller waits on the result once.
    ``offset``: the global rank of the process group's rank 0 (see :class:`Link`)."""
    flag = control.tensor(device)
    work = dist.isend(flag, dst - offset, group=group, tag=CONTROL_TAG)
    return Pending(ControlSend(control.step), NEXT, [work], flag)


def receive_control(src: int, step: int, device: torch.device,
                    group: dist.ProcessGroup | None = None, stage: int | None = None,
                    offset: int = 0) -> Control:
    """Receive (blocking) the control of iteration ``step`` from ``src``; RuntimeError if the
    message is for another iteration (the stages would run different iterations)."""
    flag = torch.empty(len(Control._fields), dtype=torch.int64, device=device)
    dist.recv(flag, src=src - offset, group=group, tag=CONTROL_TAG)
    control = Control.of(flag)
    if control.step != step:
        raise RuntimeError(f"stage {stage} expected the control of iteration {step}, "
                           f"got {control.step}")
    return control


class Link:
    """One stage's point-to-point link with its neighbours: posts sends, receives, and waits.

    ``prev_rank``/``next_rank`` are the neighbours' global ranks (None at the ends), the link's
    two ends (:data:`PREV`, :data:`NEXT`); an activation or gradient is one flat ``uint8``
    message on ``device`` (:class:`~sdpipe_cli.model.boundary.Boundary` packs and unpacks it),
    of ``sizes = (bytes from prev_rank, bytes from next_rank)``. ``group`` carries both ends'
    messages, or, given as a pair, ``(the prev end's, the next end's)``: an interleaved stage's
    chunk whose neighbour is on the wrap channel (:mod:`sdpipe_cli.core.interleaved`) talks to it
    in a group of its own, and with two stages both ends may be the same process.
    ``before_send(dst, tensor)`` is called before every activation or gradient send (the
    emulated network's delay). ``rank_offset``: the global rank of the process group's rank 0,
    when the group is the pipeline rather than the run (a restarted pipeline cannot rejoin a
    group of the whole run, so its stages talk in a group of their own). It keeps the sends in
    flight until a rule of the module docstring allows waiting on them, and at most one receive
    posted along with a send.
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        sizes: tuple[int, int],
        device: torch.device,
        group: Groups = None,
        before_send: Callable[[int, torch.Tensor], None] | None = None,
        stage: int | None = None,
        rank_offset: int = 0,
    ):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.rank_offset = rank_offset
        self.ranks = {PREV: prev_rank, NEXT: next_rank}
        self.sizes = {PREV: int(sizes[0]), NEXT: int(sizes[1])}
        prev_group, next_group = (group if isinstance(group, tuple) and not isinstance(group, Directed)
                                  else (group, group))
        self.groups: dict[str, EndGroup] = {PREV: prev_group, NEXT: next_group}
        self.device = torch.device(device)
        self.before_send = before_send
        self.stage = stage  # for messages only
        # Oldest first: the activation of micro-batch i is F(i), the gradient of its input B(i),
        # the control of iteration k ControlSend(k).
        self._sends: list[Pending] = []
        self._posted: tuple[str, torch.Tensor, dist.Work] | None = None  # (end, buffer, work)

    @property
    def idle(self) -> bool:
        """Nothing in flight: no send pending, no receive posted."""
        return not self._sends and self._posted is None

    # -- activations and gradients ------------------------------------------------------------

    def source(self, action: Action | None) -> str | None:
        """The end ``action`` receives from (None if it receives nothing: a ``W`` works on
        what its ``B`` received)."""
        if action is None or action.kind is Kind.W:
            return None
        return PREV if action.kind is Kind.F else NEXT

    def destination(self, action: Action) -> str | None:
        """The end ``action``'s output goes out of (None for a ``W``, which sends nothing; the
        pipeline's first and last stage have no rank at their outer end)."""
        if action.kind is Kind.W:
            return None
        return NEXT if action.kind is Kind.F else PREV

    def buffer(self, end: str) -> torch.Tensor:
        """A buffer for the next message coming in at ``end``."""
        return torch.empty(self.sizes[end], dtype=torch.uint8, device=self.device)

    def _peer(self, end: str) -> int:
        return cast(int, self.ranks[end]) - self.rank_offset  # an end used has a rank

    def group(self, end: str, sending: bool) -> dist.ProcessGroup | None:
        """The group of a message ``sending`` out of ``end`` (else coming in): what goes out of
        the next end or comes in at the previous one travels forward."""
        group = self.groups[end]
        if isinstance(group, Directed):
            return group.forward if (end == NEXT) == sending else group.backward
        return group

    def receive(self, end: str) -> torch.Tensor:
        """The next activation or gradient coming in at ``end``: the posted receive if there is
        one."""
        if self._posted is not None:
            posted_end, buffer, work = self._posted
            assert posted_end == end, (posted_end, end)
            self._posted = None
            work.wait()
            return buffer
        buffer = self.buffer(end)
        dist.recv(buffer, src=self._peer(end), group=self.group(end, sending=False), tag=TENSOR_TAG)
        return buffer

    def send(self, what: Action, tensor: torch.Tensor, end: str, following: Action | None,
             receiver: Link | None = None) -> None:
        """Send out of ``end`` without blocking; post ``following``'s receive with it if it
        comes from the same process in the same group. ``receiver``: the link ``following``
        receives on, where it is another's (an interleaved stage's next action may be another
        chunk's: the message is the next on that channel all the same)."""
        if self.before_send is not None:
            self.before_send(cast(int, self.ranks[end]), tensor)  # an emulated link's time
        peer, group = self._peer(end), self.group(end, sending=True)
        receiver = self if receiver is None else receiver
        source = receiver.source(following)
        if (source is not None and receiver.ranks[source] == self.ranks[end]
                and receiver.group(source, sending=False) is group):
            assert receiver._posted is None, receiver._posted
            buffer = receiver.buffer(source)
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, tensor, peer, group, TENSOR_TAG),
                    dist.P2POp(dist.irecv, buffer, peer, group, TENSOR_TAG),
                ]
            )
            # One handle per op (gloo), or a single one for both when the backend coalesces
            # (NCCL); either way the last is waited on by the receive.
            receiver._posted = (source, buffer, works[-1])
            works = works[:-1]
        else:
            works = [dist.isend(tensor, peer, group=group, tag=TENSOR_TAG)]
        self._sends.append(Pending(what, end, works, tensor))

    # -- the control message -------------------------------------------------------------------

    def send_control(self, control: Control) -> None:
        """Pass ``control`` on to the next stage; waited on like the activation it precedes."""
        # only a stage with a next one passes the control on (AsyncStage._control)
        self._sends.append(send_control(control, cast(int, self.next_rank), self.device,
                                        self.group(NEXT, sending=True), self.rank_offset))

    def receive_control(self, step: int) -> Control:
        """Iteration ``step``'s control from the previous stage (blocking)."""
        # only a stage with a previous one receives it (AsyncStage._control)
        return receive_control(cast(int, self.prev_rank), step, self.device, self.group(PREV, sending=False),
                               self.stage, self.rank_offset)

    def pass_drained(self) -> None:
        """Return once the stages after this one passed the drained word; pass it on.

        The word goes from the last stage to the first, in the same direction as the gradients
        and after the last of them, so it is matched by order too. On the first stage, the
        return means every stage got there.
        """
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.next_rank is not None:
            dist.recv(flag, src=self._peer(NEXT), group=self.group(NEXT, sending=False), tag=DRAINED_TAG)
        if self.prev_rank is not None:
            dist.send(flag, self._peer(PREV), group=self.group(PREV, sending=True), tag=DRAINED_TAG)

    # -- waiting on sends -------------------------------------------------------------------------

    def wait_sends(self, which: Callable[[Sent], bool] = lambda what: True, keep: int = 0) -> None:
        """Wait on the pending sends selected by ``which``, oldest first, until ``keep`` remain."""
        selected = [entry for entry in self._sends if which(entry.what)]
        done = selected[: max(len(selected) - keep, 0)]
        for entry in done:
            entry.wait()
        done_ids = {id(entry) for entry in done}
        self._sends = [entry for entry in self._sends if id(entry) not in done_ids]

    def wait_delivered(self, microbatch: int) -> None:
        """The gradient of ``microbatch`` came back: wait on the sends to the next stage up to
        its activation, all received already."""
        upto = next((n for n, entry in enumerate(self._sends)
                     if entry.what == Action(Kind.F, microbatch)), None)
        if upto is None:
            return
        delivered = [entry for entry in self._sends[: upto + 1] if entry.dst == NEXT]
        for entry in delivered:
            entry.wait()
        done_ids = {id(entry) for entry in delivered}
        self._sends = [entry for entry in self._sends if id(entry) not in done_ids]

    def wait_gradients(self, keep: int) -> None:
        """Wait on the oldest gradient sends until ``keep`` remain (``S - stage`` in a pipeline)."""
        self.wait_sends(lambda what: isinstance(what, Action) and what.kind is Kind.B, keep=keep)
