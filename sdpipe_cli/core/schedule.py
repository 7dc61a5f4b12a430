"""Pipeline schedules: the order in which one stage runs its forwards and backwards.

A schedule is a pure function ``(stages, microbatches, stage) -> list[Action]``: no torch, no
I/O, so it can be printed, diffed and property-tested. An :class:`Action` is a :class:`Kind`
(``F`` or ``B``, and ``W`` in a zero-bubble schedule: :func:`zero_bubble_h1`) and a micro-batch,
printed ``F0``, ``B3``. The flushed executor
(:class:`sdpipe_cli.pipeline.stage.FlushedStage`) runs the list; since each stage receives from
its neighbours in list order, two neighbours' lists must agree on the order of micro-batches,
which both schedules here guarantee (forwards and backwards each go in micro-batch order).

:func:`gpipe` runs every forward, then every backward. :func:`one_f_one_b` (PipeDream-Flush,
"1F1B") has three phases on stage ``s`` of ``S``:

* warm-up: ``S - s - 1`` forwards (or all ``m`` if fewer). The gradient of micro-batch 0 comes back to stage ``s``
  only after it has gone forward and backward through the ``S - s - 1`` later stages, so
  the stage fills that wait with forwards;
* steady state: one forward, then one backward (of the oldest micro-batch in flight);
* cool-down: the remaining backwards.

Both are flushed (every micro-batch is done before the optimizer step), so with equal
forward and backward times they take the same number of ticks, ``2 * (m + S - 1)``: the
bubble is the same. What 1F1B buys is memory: stage ``s`` keeps the activations of at
most ``S - s`` micro-batches alive instead of all ``m``, because after warm-up every new
forward is paired with a backward that frees one. This is the table :func:`timeline`
prints for ``S = 4, m = 8`` (one column per tick, ``.`` is idle)::

    stage 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
    stage 1: .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
    stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

:func:`async_one_f_one_b` (PipeDream's asynchronous 1F1B, :data:`ASYNC_SCHEDULES`) has the same
order within a *segment* that spans many iterations, with an update after every backward and no
flush until the segment ends; :func:`async_next` is its rule, one action at a time, and
:func:`stash_versions` says which weight version each forward uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import NamedTuple

__all__ = [
    "ASYNC_SCHEDULES",
    "Action",
    "Kind",
    "SCHEDULES",
    "SPLIT_SCHEDULES",
    "SPLIT_SHARE",
    "ScheduleFn",
    "async_next",
    "async_one_f_one_b",
    "flushed",
    "format_actions",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "tick_order",
    "stash_versions",
    "timeline",
    "updates_per_iteration",
    "zero_bubble_h1",
]


class Kind(StrEnum):
    """What an action does to its micro-batch; the value is the letter schedules print.

    A ``StrEnum`` so that ``Kind.F == "F"`` and ``Kind("F") is Kind.F``: a schedule's text, the
    events and the logs keep their one-letter form, and any other letter fails at once.
    """

    F = "F"  # forward: the input (read, or received from the previous stage) through the blocks
    B = "B"  # backward: the output's gradient (received, or of the loss) back through them; in a
    #          zero-bubble schedule, the input's gradient only (what the previous stage waits for)
    W = "W"  # weight gradient (zero-bubble schedules): the parameters' part of a backward whose B
    #          ran, which nobody waits for, so that it can fill the pipeline's idle ticks


class _Action(NamedTuple):
    kind: Kind
    microbatch: int
    chunk: int = 0


class Action(_Action):
    """One unit of work of a stage: the forward (``F``) or backward (``B``) of a micro-batch, on
    the stage's model chunk ``chunk`` (0 but in an interleaved schedule, whose stages hold several:
    :mod:`sdpipe_cli.core.interleaved`).

    ``Action("F", 0)`` and ``Action(Kind.F, 0)`` are the same action: the kind is converted to
    :class:`Kind` on construction, so an unknown kind is a ValueError where it is made. Printed
    ``F0``, and ``F0.1`` on chunk 1.
    """

    __slots__ = ()

    def __new__(cls, kind: Kind | str, microbatch: int, chunk: int = 0) -> Action:
        return super().__new__(cls, Kind(kind), microbatch, chunk)

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


ScheduleFn = Callable[[int, int, int], list[Action]]


def _check(stages: int, microbatches: int, stage: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[Action]:
    """PipeDream-Flush (1F1B) actions of ``stage``: warm-up forwards, F/B pairs, cool-down."""
    _check(stages, microbatches, stage)
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action(Kind.F, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [Action(Kind.F, warmup + i), Action(Kind.B, i)]
    actions += [Action(Kind.B, i) for i in range(microbatches - warmup, microbatches)]
    return actions


def gpipe(stages: int, microbatches: int, stage: int) -> list[Action]:
    """GPipe actions of ``stage``: every forward, then every backward."""
    _check(stages, microbatches, stage)
    return [Action(Kind.F, i) for i in range(microbatches)] + [
        Action(Kind.B, i) for i in range(microbatches)
    ]


def zero_bubble_h1(stages: int, microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) actions of ``stage``.

    Each backward is split in two: ``B`` computes the gradient of the stage's input, which the
    previous stage waits for, and ``W`` the gradients of the stage's parameters, which nobody
    waits for. Gradients then travel back through the pipeline at the pace of ``B`` alone, and
    the ``W`` of each micro-batch fills ticks its stage would otherwise spend waiting.

    Stage ``s`` runs 1F1B's order of forwards and backwards (``S - s`` forwards, then a ``B``
    before each further ``F``), and the ``W`` of each micro-batch ``s`` backwards after its ``B``;
    the ``W`` still pending when the forwards run out close the list. The lag is what removes
    the drain's bubble: the later a stage, the sooner in the cool-down its gradients must go on
    to the stages before it, so it holds its ``W`` back and passes each gradient on the tick it
    arrives; the first stage, which passes nothing on, runs each ``W`` right after its ``B``.
    With ``F``, ``B`` and ``W`` a tick each and ``m >= S``, every stage is busy from its first
    forward to the end but for ``S - 1`` ticks (the paper's bubble, ``(S - 1)(F + B - W)``), so
    the iteration takes ``3 m + S - 1`` ticks, the least its work and the first forward's way
    down and back allow. For ``S = 4, m = 8`` (:func:`timeline`)::

        stage 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
        stage 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
        stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
        stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

    27 ticks, where 1F1B with its backward as long as ``B`` and ``W`` together takes 33
    (``tick_order(one_f_one_b, 4, 8, ticks={Kind.B: 2})``): 3 idle ticks per stage instead of 9.

    Memory: forwards wait for their ``B`` as in 1F1B (fewer than ``S - s`` at once), and a
    stage keeps what its weight gradients need for at most ``S`` micro-batches
    (:func:`in_flight`): the first stage's count, 1F1B's peak, on every stage. In bytes a
    micro-batch between its ``B`` and its ``W`` holds more than its forward saved (torch's split
    keeps the graph and the gradients reaching the weights: 1.3-1.6x on gpt_tiny), so where a
    later stage holds more layers than the first, the pipeline peaks above 1F1B's
    (``scripts/bench_schedule_memory.py``).
    """
    _check(stages, microbatches, stage)
    warmup = min(stages - stage, microbatches)
    actions = [Action(Kind.F, i) for i in range(warmup)]
    forwarded, weighted = warmup, 0
    for i in range(microbatches):
        actions.append(Action(Kind.B, i))
        if i >= stage:
            actions.append(Action(Kind.W, weighted))
            weighted += 1
        if forwarded < microbatches:
            actions.append(Action(Kind.F, forwarded))
            forwarded += 1
    return actions + [Action(Kind.W, i) for i in range(weighted, microbatches)]


SCHEDULES: dict[str, ScheduleFn] = {"1f1b": one_f_one_b, "gpipe": gpipe, "zb_h1": zero_bubble_h1}
# The schedules whose backward is split into B and W (the executor's input and weight parts),
# and the share of a backward's time each of B and W takes where time is modelled (the simulator,
# the emulated compute): the input's and the weights' gradients are a matrix product each.
SPLIT_SCHEDULES = ("zb_h1", "interleaved_zb")
SPLIT_SHARE = 0.5


def async_next(stages: int, stage: int, forwarded: int, backwarded: int,
               end: int | None) -> Action | None:
    """The next action of ``stage`` in a segment of asynchronous 1F1B (PipeDream), or None at its end.

    ``forwarded`` and ``backwarded`` count the segment's micro-batches this stage has run forward
    and backward so far; ``end`` is the segment's length, or None while the stage does not know
    it yet (the micro-batch stream goes on). The rule: run a forward while fewer than
    ``S - stage`` micro-batches are in flight and the segment has one left, otherwise the
    backward of the oldest one in flight. It gives 1F1B's order (warm-up, one forward and one
    backward, drain) without knowing the length in advance, which is what lets a stage decide
    where the stream drains only when the control message of an iteration arrives.
    """
    if forwarded - backwarded < stages - stage and (end is None or forwarded < end):
        return Action(Kind.F, forwarded)
    if backwarded < forwarded:
        return Action(Kind.B, backwarded)
    return None


def async_one_f_one_b(stages: int, microbatches: int, stage: int) -> list[Action]:
    """Asynchronous 1F1B (PipeDream) actions of ``stage`` for a segment of ``microbatches``.

    A segment is the stream of micro-batches between two drained points; it crosses iteration
    boundaries (``microbatches`` is then a multiple of ``pipeline.microbatches``). The order is
    1F1B's, but the meaning differs: the stage updates its weights after *every* backward, and
    there is no flush until the segment ends, so after the warm-up every stage is busy. Since up
    to ``S - stage`` micro-batches are in flight across those updates, each one's backward must
    use the weights its forward used (:func:`stash_versions`). For ``S = 4`` and a segment of two
    iterations of ``m = 4``, with every action one tick (:func:`timeline`)::

        stage 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        stage 1: .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

    22 ticks, where two flushed 1F1B iterations take 2 x 14 = 28 (:func:`flushed`): the fill and
    drain bubble, ``(S - 1) / (m + S - 1)`` of a flushed iteration, is paid once per segment
    instead of once per iteration.
    """
    _check(stages, microbatches, stage)
    actions: list[Action] = []
    forwarded = backwarded = 0
    while True:
        action = async_next(stages, stage, forwarded, backwarded, microbatches)
        if action is None:
            return actions
        actions.append(action)
        if action.kind is Kind.F:
            forwarded += 1
        else:
            backwarded += 1


def stash_versions(actions: list[Action]) -> dict[int, int]:
    """The weight version each micro-batch's forward uses, when an update follows every backward.

    Version ``v`` is the weights after ``v`` updates of the segment, so it is the number of
    backwards before the forward. Weight stashing keeps that version until the micro-batch's
    backward; in the steady state the weights have moved on by ``S - stage - 1`` updates by then
    (PipeDream's staleness), and at most ``S - stage`` versions are in flight.
    """
    versions: dict[int, int] = {}
    updates = 0
    for action in actions:
        if action.kind is Kind.F:
            versions[action.microbatch] = updates
        elif action.kind is Kind.B:
            updates += 1
    return versions


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches between their forward and their backward at once: whose
    activations a stage holds together (1F1B: ``S - stage``; GPipe: all of them). A backward
    split into ``B`` and ``W`` ends at its ``W``: until then the weights' gradients need what
    the forward saved."""
    split = any(action.kind is Kind.W for action in actions)
    most = held = 0
    for action in actions:
        if action.kind is Kind.F:
            held += 1
        elif action.kind is (Kind.W if split else Kind.B):
            held -= 1
        most = max(most, held)
    return most


def flushed(schedule_fn: ScheduleFn, iterations: int) -> ScheduleFn:
    """``iterations`` consecutive iterations of a flushed schedule as one action list per stage.

    Micro-batches are numbered across iterations. Fed to :func:`tick_order`, the flush appears by
    itself: the first stage starts an iteration only after its last backward of the previous one,
    which comes after every other stage's.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")

    def repeated(stages: int, microbatches: int, stage: int) -> list[Action]:
        one = schedule_fn(stages, microbatches, stage)
        return [a._replace(microbatch=k * microbatches + a.microbatch)
                for k in range(iterations) for a in one]

    return repeated


# Schedules without a flush: their executor is :class:`sdpipe_cli.pipeline.async_stage.AsyncStage`, which
# runs segments of many iterations and updates after every backward.
ASYNC_SCHEDULES: dict[str, ScheduleFn] = {"async_1f1b": async_one_f_one_b}


def updates_per_iteration(schedule: str, microbatches: int, weight_versions: int | None) -> int:
    """Optimizer updates (and sync rounds) per iteration on each stage.

    Flushed schedules update once per iteration. Asynchronous 1F1B updates after every
    micro-batch (PipeDream, ``weight_versions`` None), or, with ``weight_versions = 2``
    (PipeDream-2BW), accumulates the gradients of an iteration's micro-batches and updates once at
    its end: the weights change once per m micro-batches, so at most two versions are in flight
    when ``m >= S``, and each update sees the iteration's batch, as a flushed one does.
    """
    if schedule in ASYNC_SCHEDULES and weight_versions is None:
        return microbatches
    return 1


def get_schedule(name: str) -> ScheduleFn:
    """The schedule function called ``name`` (a key of :data:`SCHEDULES` or :data:`ASYNC_SCHEDULES`)."""
    try:
        return SCHEDULES[name] if name in SCHEDULES else ASYNC_SCHEDULES[name]
    except KeyError:
        names = [*sorted(SCHEDULES), *sorted(ASYNC_SCHEDULES)]
        raise ValueError(f"unknown schedule {name!r}; valid choices: {', '.join(names)}") from None


def format_actions(actions: list[Action]) -> str:
    """``"F0 F1 B0 ..."``: the compact form used in logs and tests."""
    return " ".join(str(a) for a in actions)


def tick_order(schedule_fn: ScheduleFn, stages: int, microbatches: int,
               ticks: Mapping[Kind, int] | None = None,
               chunks: int = 1) -> list[list[Action | None]]:
    """Run every stage's actions on a clock where each action takes one tick (or ``ticks[kind]``).

    Returns one row per stage, one entry per tick: the action running then (an action of
    several ticks fills as many entries), or None when the stage is idle (waiting for a
    neighbour, or done). An action starts at the first tick at which it is next in its stage's
    list and its inputs were finished: F(i) on s needs F(i) on s - 1; B(i) on s needs F(i) on s
    and B(i) on s + 1; W(i) on s needs B(i) on s. With ``chunks`` model chunks per stage (an
    interleaved schedule), "s - 1" and "s + 1" are the virtual stages before and after the
    action's own, ``chunk x stages + s``: chunk c of the last stage feeds chunk c + 1 of the
    first. Raises ValueError if the stages' lists deadlock. (``ticks={Kind.B: 2}`` is a
    backward twice a forward's length; a zero-bubble schedule's ``B`` and ``W`` then take one
    tick each.)
    """
    _check(stages, microbatches, 0)
    length = {kind: 1 for kind in Kind} | dict(ticks or {})
    plans = [schedule_fn(stages, microbatches, s) for s in range(stages)]
    last = stages * chunks - 1  # the last virtual stage
    finished: dict[tuple, int] = {}  # (kind, virtual stage, microbatch) -> the tick it ended at

    def ready(action: Action, at: int, tick: int) -> bool:
        def ran(kind: Kind, where: int) -> bool:
            return finished.get((kind, where, action.microbatch), tick + 1) <= tick

        if action.kind is Kind.F:
            return at == 0 or ran(Kind.F, at - 1)
        if action.kind is Kind.W:
            return ran(Kind.B, at)
        return ran(Kind.F, at) and (at == last or ran(Kind.B, at + 1))

    rows: list[list[Action | None]] = [[] for _ in range(stages)]
    position = [0] * stages
    running: list[Action | None] = [None] * stages
    free_at = [0] * stages
    tick = 0
    while any(position[s] < len(plans[s]) for s in range(stages)) or max(free_at) > tick:
        progressed = False
        for s in range(stages):
            if free_at[s] > tick:  # still running an action of several ticks
                rows[s].append(running[s])
                progressed = True
                continue
            action = plans[s][position[s]] if position[s] < len(plans[s]) else None
            at = 0 if action is None else action.chunk * stages + s
            if action is not None and ready(action, at, tick):
                finished[(action.kind, at, action.microbatch)] = free_at[s] = tick + length[action.kind]
                position[s] += 1
                progressed = True
            else:
                action = None
            running[s] = action
            rows[s].append(action)
        if not progressed:
            raise ValueError(f"schedule deadlocks at tick {tick}: positions {position}")
        tick += 1
    return rows


def timeline(schedule_fn: ScheduleFn, stages: int, microbatches: int,
             ticks: Mapping[Kind, int] | None = None, chunks: int = 1) -> str:
    """ASCII table of :func:`tick_order`: one row per stage, one column per tick, ``.`` = idle,
    ``-`` = the action before it still running."""
    rows = tick_order(schedule_fn, stages, microbatches, ticks, chunks)
    width = max(len(str(a)) for row in rows for a in row if a is not None)
    digits = len(str(stages - 1))
    lines = []
    for s, row in enumerate(rows):
        cells = [("." if a is None else "-" if k and row[k - 1] is a else str(a)).ljust(width)
                 for k, a in enumerate(row)]
        lines.append(f"stage {s:>{digits}}: " + " ".join(cells).rstrip())
    return "\n".join(lines)
