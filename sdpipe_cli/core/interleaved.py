"""Interleaved 1F1B (Megatron-LM's virtual pipeline): each stage holds ``v`` model chunks.

The model is cut into ``V = v x S`` pieces, *virtual stages*, laid out round-robin: stage ``s``
holds chunks ``0 .. v - 1``, chunk ``c`` being virtual stage ``c x S + s``. A micro-batch goes
forward through stages ``0 .. S - 1`` on chunk 0, then from the last stage back to the first for
chunk 1, and so on; its backward takes the same way back. An action does ``1 / v`` of a stage's
work, while the fill and the drain stay ``S - 1`` actions deep, so they cost ``1 / v`` of what
they cost 1F1B: the bubble falls from ``(S - 1) / m`` of an iteration to ``(S - 1) / (v m)``, for
``v`` times the point-to-point messages and a little more activation memory (below).

The order on stage ``s`` (``m`` micro-batches, a multiple of ``S``): the ``k``-th forward is
micro-batch ``(k // (S v)) S + k % S`` on chunk ``(k // S) % v`` (``S`` micro-batches through
chunk 0, the same ``S`` through chunk 1, ..., then the next ``S``); the ``k``-th backward is the
same micro-batch on chunk ``v - 1 - (k // S) % v``. Warm-up: ``S - s - 1 + (v - 1) S``
forwards (all of them, if there are fewer), then one forward and one backward, then the
remaining backwards: with ``v = 1``, 1F1B itself. (Megatron-LM warms up ``S - s - 1`` more
forwards, to have work at hand while a gradient is on its way; with every action's time known
and no transfer time (:func:`~sdpipe_cli.core.schedule.tick_order`) both take the same ticks,
from ``S = 2`` to 8 and ``v = 2`` to 4, backwards 1 to 3 times a forward, and this one holds
fewer activations.) For ``S = 4``, ``v = 2``, ``m = 8`` (``F3.1``: micro-batch 3's forward on
chunk 1), the first and the last stage::

    stage 0: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B0.1 F4 B1.1 F5 B2.1 F6 B3.1 F7 B0 F4.1 B1 F5.1
             B2 F6.1 B3 F7.1 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7
    stage 3: F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4 B0 F5 B1 F6 B2 F7 B3 F4.1
             B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4 B5 B6 B7

With every chunk's action one tick (:func:`~sdpipe_cli.core.schedule.tick_order`, ``chunks=2``)
the iteration takes 38 ticks, where 1F1B, whose actions are two ticks each, takes 44: 6 idle
ticks per stage instead of 12 (``2 (S - 1)`` and ``2 v (S - 1)``), 1.16x the samples/s.

Every stage runs its forwards in the same (micro-batch, chunk) order, and its backwards too, so
two stages exchange messages in the same order on both sides (:func:`channel_of`,
:func:`messages`): activations from virtual stage ``k`` to ``k + 1``, gradients back. The
messages that cross from the last stage to the first (chunk ``c`` to ``c + 1``) and their
gradients go over a *wrap* channel of their own: with two stages the same two processes are
neighbours both ways, and on one channel an activation and a gradient could be posted in
different orders by the two ends.

Memory: stage ``s`` holds up to ``S - s + (v - 1) S`` chunks' activations at once
(:func:`~sdpipe_cli.core.schedule.in_flight`), each ``1 / v`` of the stage's: ``S - s / v``
stages' worth, against 1F1B's ``S - s``; the first stage's, the most, is 1F1B's.

*Interleaved zero bubble* (``interleaved_zb``, :func:`interleaved_zero_bubble`) splits each
backward into ``B`` and ``W`` as ZB-H1 does (:func:`~sdpipe_cli.core.schedule.zero_bubble_h1`)
and lets the ``W`` fill what is left of the bubble: ``S - 1`` ticks of a chunk's third, against
interleaved 1F1B's ``3 (S - 1)`` (``S = 4``, ``v = 2``, ``m = 8``: 51 ticks, against 57 and
1F1B's 66), with ``v S`` micro-batch chunks held on every stage, interleaved 1F1B's first
stage's count. torch's ``ScheduleInterleavedZeroBubble`` runs the same kind of schedule.

A run asks for it with ``pipeline.schedule=interleaved_1f1b`` (or ``interleaved_zb``) and ``pipeline.chunks=v``; its
``pipeline.partition`` then cuts the model into the ``V`` virtual stages (``V - 1``
boundaries), and :func:`stage_blocks` says which blocks each stage holds.

Pure: no torch, no I/O. :class:`~sdpipe_cli.pipeline.interleaved_stage.InterleavedStage` runs
these lists (``scripts/bench_interleaved.py`` times them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple

from sdpipe_cli.core.schedule import Action, Kind, ScheduleFn, get_schedule, zero_bubble_h1

__all__ = ["CHUNKED", "CHUNKED_SCHEDULES", "Channel", "channel_of", "forward_order", "interleaved_1f1b",
           "interleaved_zero_bubble", "messages", "nth", "schedule_of", "stage_blocks", "virtual_stage",
           "warmup", "zero_bubble_lists"]


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """The piece of the model chunk ``chunk`` of ``stage`` holds."""
    return chunk * stages + stage


def warmup(stages: int, microbatches: int, stage: int, chunks: int) -> int:
    """Forwards ``stage`` runs before its first backward."""
    return min(stages - stage - 1 + (chunks - 1) * stages, microbatches * chunks)


def _check(stages: int, microbatches: int, stage: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be >= 1, got {stages} and {chunks}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")
    if microbatches < 1 or microbatches % stages:
        raise ValueError(f"interleaving takes micro-batches in groups of the stages: "
                         f"{microbatches} is not a multiple of {stages}")


def nth(kind: Kind, k: int, stages: int, chunks: int) -> Action:
    """The ``k``-th forward (``kind`` F) or backward (B) every stage of an interleaved schedule
    runs: the orders above, one for all stages, so that neighbours exchange messages in the
    same order."""
    group, chunk = k // (stages * chunks), (k // stages) % chunks
    microbatch = group * stages + k % stages
    return Action(kind, microbatch, chunk if kind is Kind.F else chunks - 1 - chunk)


def forward_order(microbatches: int, stages: int, chunks: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order every stage runs an evaluation's forwards: the
    training order's (:func:`nth`), ``S`` micro-batches through chunk 0, the same through
    chunk 1, ..., then the next ``S``, the last group shorter where ``microbatches`` is not a
    multiple of ``S``. A forward waits only for one before it in this order (its micro-batch's
    on the chunk before, or the same place on the stage before), so stages that post their
    sends and wait on them at the end cannot wait for each other in a cycle."""
    return [(i, c) for start in range(0, microbatches, stages) for c in range(chunks)
            for i in range(start, min(start + stages, microbatches))]


def interleaved_1f1b(chunks: int) -> ScheduleFn:
    """The interleaved 1F1B schedule of stages holding ``chunks`` model chunks each: a function
    ``(stages, microbatches, stage) -> list[Action]`` like the other schedules."""

    def actions(stages: int, microbatches: int, stage: int) -> list[Action]:
        _check(stages, microbatches, stage, chunks)
        total = microbatches * chunks
        first = warmup(stages, microbatches, stage, chunks)
        out = [nth(Kind.F, k, stages, chunks) for k in range(first)]
        for k in range(total - first):
            out += [nth(Kind.F, first + k, stages, chunks), nth(Kind.B, k, stages, chunks)]
        return out + [nth(Kind.B, k, stages, chunks) for k in range(total - first, total)]

    return actions


def interleaved_zero_bubble(chunks: int) -> ScheduleFn:
    """Interleaved zero bubble: interleaved 1F1B's forwards and backwards, each backward split
    into ``B`` and ``W`` (:func:`~sdpipe_cli.core.schedule.zero_bubble_h1`), placed by
    :func:`zero_bubble_lists`. A function ``(stages, microbatches, stage) -> list[Action]``;
    with one chunk, ZB-H1 itself (whose ``S - s`` warm-up reaches the bound below for ``v = 1``,
    where this rule takes a tick or three more)."""
    if chunks == 1:
        return zero_bubble_h1

    def actions(stages: int, microbatches: int, stage: int) -> list[Action]:
        _check(stages, microbatches, stage, chunks)
        return list(zero_bubble_lists(stages, microbatches, chunks)[stage])

    return actions


@lru_cache(maxsize=64)
def zero_bubble_lists(stages: int, microbatches: int, chunks: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's interleaved zero-bubble actions, found by running the pipeline on a clock
    where every chunk's ``F``, ``B`` and ``W`` takes one tick (a chunk's forward, and each half
    of its backward, a third of its work).

    Forwards and backwards keep the interleaved order (:func:`nth`), the same on every stage,
    so the messages match as interleaved 1F1B's do; what is decided is when each stage runs
    which. At every tick a free stage runs, of what is ready: its next ``B``, which a stage
    before it waits for; else its next ``F``, while fewer than ``v S`` micro-batch chunks wait
    for their ``W`` (interleaved 1F1B's first stage's count, on every stage); else its oldest
    pending ``W``, which nobody waits for. The ``W`` thus fill the ticks the stage would idle,
    and the drain's. With ``m >= S`` every stage is busy but for ``S - 1`` ticks: the
    iteration takes ``3 v m + S - 1`` ticks (checked for ``S`` 2 to 8, ``v`` 2 to 4, ``m`` up
    to ``4 S``), the least its work and the first forward's way
    to the last virtual stage and back allow (interleaved 1F1B: ``3 v m + 3 (S - 1)`` and
    more, with its backward two ticks; 1F1B: ``3 v m + 3 v (S - 1)``).

    Running the lists in order cannot deadlock whatever the actions' real times: each action
    was placed only once what it waits for had run.
    """
    _check(stages, microbatches, 0, chunks)
    total, last, limit = microbatches * chunks, stages * chunks - 1, stages * chunks
    ended: dict[tuple[Kind, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> end tick
    forwards, backwards, held = [0] * stages, [0] * stages, [0] * stages
    pending: list[deque[Action]] = [deque() for _ in range(stages)]
    out: list[list[Action]] = [[] for _ in range(stages)]
    tick = 0
    while any(len(row) < 3 * total for row in out):
        def ran(kind: Kind, where: int, i: int, now: int = tick) -> bool:
            return ended.get((kind, where, i), now + 1) <= now

        for s in range(stages):
            action = None
            b = nth(Kind.B, backwards[s], stages, chunks) if backwards[s] < total else None
            f = nth(Kind.F, forwards[s], stages, chunks) if forwards[s] < total else None
            if b is not None and ran(Kind.F, k := virtual_stage(s, b.chunk, stages), b.microbatch) \
                    and (k == last or ran(Kind.B, k + 1, b.microbatch)):
                action, backwards[s] = b, backwards[s] + 1
                pending[s].append(b)
            elif f is not None and held[s] < limit and (
                    (k := virtual_stage(s, f.chunk, stages)) == 0 or ran(Kind.F, k - 1, f.microbatch)):
                action, forwards[s], held[s] = f, forwards[s] + 1, held[s] + 1
            elif pending[s] and ran(*_key(pending[s][0], s, stages)):  # its B has ended
                w = pending[s].popleft()
                action, held[s] = Action(Kind.W, w.microbatch, w.chunk), held[s] - 1
            if action is not None:
                ended[_key(action, s, stages)] = tick + 1
                out[s].append(action)
        if not any(row and ended[_key(row[-1], s, stages)] == tick + 1 for s, row in enumerate(out)):
            # every action takes a tick: a tick that runs none would be followed by the same
            raise ValueError(f"no zero-bubble order for {stages} stages, {microbatches} "
                             f"micro-batches, {chunks} chunks")
        tick += 1
    return tuple(tuple(row) for row in out)


def _key(action: Action, stage: int, stages: int) -> tuple[Kind, int, int]:
    return action.kind, virtual_stage(stage, action.chunk, stages), action.microbatch


class Channel(NamedTuple):
    """Where a message goes: from stage ``src`` to stage ``dst``, on the wrap channel (between
    the last stage's chunk ``c`` and the first stage's chunk ``c + 1``) or the pipeline's own."""

    src: int
    dst: int
    wrap: bool


def channel_of(lower: int, stages: int, gradient: bool) -> Channel:
    """The channel of the message between virtual stages ``lower`` and ``lower + 1``: an
    activation (up) or, with ``gradient``, its gradient (down)."""
    below, above = lower % stages, (lower + 1) % stages
    wrap = below == stages - 1
    return Channel(above, below, wrap) if gradient else Channel(below, above, wrap)


def messages(actions: list[Action], stage: int, stages: int,
             chunks: int) -> tuple[list[tuple[Channel, Action]], list[tuple[Channel, Action]]]:
    """What ``stage``'s ``actions`` send and receive, in order: (channel, the action whose output
    it is) each. A forward sends its activation up unless it is on the last virtual stage and
    receives one unless on the first; a backward the other way round."""
    last = stages * chunks - 1
    sent, received = [], []
    for a in actions:
        here = virtual_stage(stage, a.chunk, stages)
        if a.kind is Kind.F:
            if here < last:
                sent.append((channel_of(here, stages, gradient=False), a))
            if here > 0:
                received.append((channel_of(here - 1, stages, gradient=False),
                                 Action(Kind.F, a.microbatch, (here - 1) // stages)))
        elif a.kind is Kind.B:
            if here > 0:
                sent.append((channel_of(here - 1, stages, gradient=True), a))
            if here < last:
                received.append((channel_of(here, stages, gradient=True),
                                 Action(Kind.B, a.microbatch, (here + 1) // stages)))
    return sent, received


# The schedules whose stages hold several model chunks (``pipeline.chunks``), by their name.
CHUNKED: dict[str, Callable[[int], ScheduleFn]] = {"interleaved_1f1b": interleaved_1f1b,
                                                    "interleaved_zb": interleaved_zero_bubble}
CHUNKED_SCHEDULES = tuple(CHUNKED)


def schedule_of(name: str, chunks: int = 1) -> ScheduleFn:
    """The schedule ``name`` of stages holding ``chunks`` model chunks: an interleaved one, or,
    with one chunk, any of :func:`~sdpipe_cli.core.schedule.get_schedule`'s (interleaved 1F1B
    of one chunk is 1F1B)."""
    if name in CHUNKED:
        return CHUNKED[name](chunks)
    if chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk a stage, not {chunks}")
    return get_schedule(name)


def stage_blocks(bounds: Sequence[int], blocks: int, stages: int) -> list[list[tuple[int, int]]]:
    """For each of ``stages`` stages, the block ranges ``[(start, stop), ...]`` of its chunks in
    chunk order, when ``bounds`` cuts ``blocks`` blocks into ``v x stages`` virtual stages (the
    ``V - 1`` block indices where one starts). With ``S - 1`` bounds: one range per stage, the
    partition's own."""
    pieces = len(bounds) + 1
    if stages < 1 or pieces % stages:
        raise ValueError(f"{pieces} pieces of the model do not make {stages} stages of equal "
                         "chunk counts")
    edges = [0, *(int(b) for b in bounds), int(blocks)]
    return [[(edges[k], edges[k + 1]) for k in range(s, pieces, stages)] for s in range(stages)]
