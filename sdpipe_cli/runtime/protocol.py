"""The coordination protocol: every message launcher, scheduler and workers exchange through the
store, as a typed record, and the one place that turns them into JSON and back.

The processes share nothing but the store, so a message is the only contract between them. Each
one is a frozen dataclass here: a renamed field breaks the sender and the receiver in the same
file, and :func:`decode` checks every value read against the field's type before anything acts on
it. A value that does not conform (another version's process, a key written by hand, a damaged
store) raises :class:`ProtocolError` naming the key and the field: the reading process ends with
that line, not a ``KeyError`` later, a hang or a quietly wrong metric.

Messages (who sends each and who reads it: :data:`ROUTES`): the events on the ``events``
queue, told apart by ``type`` (:data:`EVENTS`, and :class:`Report`, whose open ``fields`` are
checked against :data:`REPORT_FIELDS`); the answers, one key each (:class:`Group`,
:class:`BeginAnswer`, :class:`HealAnswer`, :class:`Hung`, :class:`Split`, the measured wire's
:class:`WireReport` and :class:`MeetingChoice`); the progress snapshot
(:func:`decode_progress`).

Whether an event's sender may send it (its rank, its incarnation) depends on the run, which only
the scheduler knows; it checks that, with :class:`ProtocolError` for what no process could send.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union


class ProtocolError(RuntimeError):
    """A value in the store that no process of this run could have written."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"malformed message under store key {key!r}: {reason}")
        self.key, self.reason = key, reason


# -- events: worker or launcher -> scheduler ------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """The scheduler's own ticker: a deadline passed, or it is time for a heartbeat check."""

    type = "tick"


@dataclass(frozen=True)
class Ready:
    """A replica finished ``iteration``'s backward (or update) and waits for its group.
    ``stage``: what it averages, its stage, or the segment where pipelines are split
    differently (:mod:`~sdpipe_cli.core.segments`), which ``rank`` holds. ``steps``: the local
    steps it has done, where the run's end cut its meeting's block short or blocks follow the
    wire (None: the meetings' count, ``(iteration + 1) * sync.every``); then also its last
    round's seconds and bytes through its link (``wire_s``, ``wire_bytes``) and its block's
    seconds (``block_s``)."""

    type = "ready"
    rank: int
    pipeline: int
    stage: int
    iteration: int
    incarnation: int = 0
    steps: int | None = None
    wire_s: float | None = None
    wire_bytes: float | None = None
    block_s: float | None = None


@dataclass(frozen=True)
class Begin:
    """Asynchronous schedules: the first stage of ``pipeline`` is about to start ``iteration``
    (the fields of :class:`Ready` but ``steps``: asynchronous schedules meet every iteration)."""

    type = "begin"
    rank: int
    pipeline: int
    stage: int
    iteration: int
    incarnation: int = 0


@dataclass(frozen=True)
class Rejoin:
    """A restarted replica asks for a source to heal from (``stage`` as in :class:`Ready`)."""

    type = "rejoin"
    rank: int
    pipeline: int
    stage: int
    incarnation: int


@dataclass(frozen=True)
class Saved:
    """A worker wrote its shard of checkpoint ``checkpoint`` at its iteration ``step``; or, with
    ``dropped``, why it did not: its replicas were never made one model there (the global sync
    the checkpoint follows failed), so the checkpoint must not be made."""

    type = "saved"
    rank: int
    pipeline: int
    stage: int
    checkpoint: int
    step: int
    incarnation: int = 0
    time: float = 0.0
    dropped: str | None = None


@dataclass(frozen=True)
class Lost:
    """The launcher stopped ``pipeline`` after its worker ``rank`` failed (``restart``: it will
    start it again)."""

    type = "lost"
    rank: int
    pipeline: int
    reason: str = ""
    restart: bool = False
    time: float = 0.0


@dataclass(frozen=True)
class Restart:
    """The launcher is starting a lost pipeline's processes again, as ``incarnation``."""

    type = "restart"
    rank: int
    pipeline: int
    incarnation: int
    restart: int = 1  # restarts in the run so far, this one included
    backoff_s: float = 0.0
    time: float = 0.0
    resplit: bool = False  # on the new split the scheduler asked for (a re-split in place)


# The fields of each report kind that a reader acts on, and their types: (required, optional).
# A report may carry more (a sync mode's statistics), left as they are.
REPORT_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "start": ({"pid": int}, {}),
    "step": ({"step": int, "samples": int, "samples_per_s": float, "step_s": float},
             {"lr": float, "compute_s": float, "sync_s": float, "loss": float | None,
              "data_s": float, "group_size": int, "round": int, "skipped_steps": int,
              "busy_s": float, "behind_s": float, "behind_wait_s": float}),
    "eval": ({"step": int, "val_loss": float | None},
             {"samples": int, "val_accuracy": float | None}),
    "consensus": ({"iteration": int, "round": int, "members": list[int],
                   "consensus": float | None}, {}),
    "healed": ({"source": int, "iteration": int}, {"bytes": int, "seconds": float}),
    "unreadable": ({"sample": str, "error": str, "step": int}, {}),
    "done": ({"steps": int, "samples": int}, {}),
}


@dataclass(frozen=True)
class Report:
    """What a worker reports for the metrics (``type`` one of :data:`REPORT_FIELDS`); on the wire
    its ``fields`` sit beside the header, as one flat JSON object."""

    type: str
    rank: int
    pipeline: int
    stage: int
    time: float
    incarnation: int = 0
    fields: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The flat record, as a metrics line is made from it."""
        return {"type": self.type, "rank": self.rank, "pipeline": self.pipeline,
                "stage": self.stage, "time": self.time, **self.fields}


Event = Tick | Ready | Begin | Rejoin | Saved | Lost | Restart | Report
EVENTS: dict[str, type] = {cls.type: cls for cls in (Tick, Ready, Begin, Rejoin, Saved, Lost, Restart)}


# -- answers: scheduler -> worker or launcher ------------------------------------------------------


@dataclass(frozen=True)
class HealTarget:
    """A restarted replica that a group's first member heals after its update."""

    pipeline: int
    incarnation: int
    round: int
    order: int = 0  # the scheduler's count of heals: sources give, and replicas take, in it


@dataclass(frozen=True)
class Group:
    """The scheduler's decision for one member: average with ``members`` now."""

    members: list[int]
    round: int
    kind: str  # "group" or "global"
    stop: bool  # the members' pipelines stop after this iteration
    incarnations: list[int]  # of the members, in order: they name the communicator
    checkpoint: int | None = None  # global syncs: the checkpoint to write after it
    done: int | None = None  # pipeline-iterations begun in the run (the lr schedule's clock)
    twins: bool = False  # the members hold the same weights already
    heal: list[HealTarget] = field(default_factory=list)  # to the first member only
    # what each member's weights and gradient count in the averages, in ``members`` order
    # (``sync.stale``); empty: the plain mean
    weight_shares: list[float] = field(default_factory=list)
    grad_shares: list[float] = field(default_factory=list)
    # blocks that follow the wire: each member's next one, and the run's pipeline-steps
    nexts: list[int] = field(default_factory=list)
    done_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("group", "global"):
            raise ValueError(f"kind: {self.kind!r} is neither 'group' nor 'global'")
        if not self.members or len(self.incarnations) != len(self.members):
            raise ValueError("members and incarnations must be non-empty and of one length")
        for name in ("weight_shares", "grad_shares"):
            shares = getattr(self, name)
            if shares and (len(shares) != len(self.members) or min(shares) < 0
                           or abs(sum(shares) - 1) > 1e-6):
                raise ValueError(f"{name}: one share per member, none negative, summing to 1")
        if self.nexts and (len(self.nexts) != len(self.members) or min(self.nexts) < 1):
            raise ValueError("nexts: one block of at least one step per member")


@dataclass(frozen=True)
class BeginAnswer:
    """Asynchronous schedules: whether the iteration about to begin ends a segment."""

    last: bool


@dataclass(frozen=True)
class HealAnswer:
    """The scheduler's answer to a :class:`Rejoin`: take ``source``'s state, or stop."""

    stop: bool
    iteration: int | None = None  # where the replica goes on from (stop: where it was)
    source: int | None = None
    source_incarnation: int | None = None
    done: int | None = None
    round: int | None = None
    order: int = 0  # as the source's :class:`HealTarget` says

    def __post_init__(self) -> None:
        if not self.stop and None in (self.iteration, self.source, self.source_incarnation,
                                      self.round):
            raise ValueError("a heal names its iteration, source, source_incarnation and round")


@dataclass(frozen=True)
class Hung:
    """Workers the scheduler found silent past ``run.heartbeat_timeout``: (rank, incarnation)."""

    ranks: list[tuple[int, int]]


@dataclass(frozen=True)
class Split:
    """A pipeline re-split in place (``fault.replan_in_place``): from its ``incarnation`` on, its
    workers hold the blocks ``partition`` gives them (its peers find its segments there)."""

    pipeline: int
    incarnation: int
    partition: list[int]


@dataclass(frozen=True)
class WireReport:
    """A worker's first iteration (``step_s``) and its timed all-reduces over its stage's
    replicas, before its first meeting (:mod:`~sdpipe_cli.sync.wire_probe`)."""

    pipeline: int
    stage: int
    step_s: float
    values: int
    members: int
    small_bytes: int
    small_s: float
    large_bytes: int
    large_s: float


@dataclass(frozen=True)
class StageLink:
    """A stage's link as measured (its slowest replica's fit)."""

    stage: int
    members: int
    values: int
    mbit_s: float
    latency_ms: float


@dataclass(frozen=True)
class MeetingChoice:
    """The meetings settled from every :class:`WireReport` (``core.meetings.Choice``'s fields),
    each stage's link, and whether blocks then follow the wire (``adapt``)."""

    every: int
    precision: str
    iteration_s: float
    round_s: float
    share: float
    stages: list[StageLink]
    describe: str
    adapt: bool = False


#: Who sends each message, and who reads it (docs/ARCHITECTURE.md's table is generated from this
#: module: ``python -m sdpipe_cli.runtime.protocol_reference --write docs/ARCHITECTURE.md``).
ROUTES: dict[type, tuple[str, str]] = {
    Tick: ("the scheduler's ticker thread", "scheduler"),
    Ready: ("worker", "scheduler"),
    Begin: ("worker (first stage)", "scheduler"),
    Rejoin: ("restarted worker", "scheduler"),
    Saved: ("worker", "scheduler"),
    Lost: ("launcher", "scheduler"),
    Restart: ("launcher", "scheduler"),
    Report: ("worker", "scheduler (metrics.jsonl, progress)"),
    Group: ("scheduler", "worker"),
    BeginAnswer: ("scheduler", "worker (first stage)"),
    HealAnswer: ("scheduler", "restarted worker"),
    Hung: ("scheduler", "launcher"),
    Split: ("scheduler", "worker (its peers' segments)"),
    WireReport: ("worker", "scheduler (before its policy is built)"),
    MeetingChoice: ("scheduler", "worker"),
}


# progress snapshot: an open record (training and profiling publish different ones); these keys
# are checked where present
PROGRESS_FIELDS: dict[str, Any] = {
    "iterations": int, "target": int, "samples": int, "samples_per_s": float,
    "loss": float | None, "val_loss": float | None, "val_accuracy": float | None,
    "started": int, "done": int, "pipelines": dict[str, dict[str, Any]],
    "rounds": list[list[int]], "mean_group_size": float | None, "restarts": int, "heals": int,
    "scheduler_restarts": int, "unreadable": list[str], "phase": str, "turn": int, "turns": int,
    "stragglers": list[dict[str, Any]], "slowed": dict[str, float],
    # the console's lines about slow devices: {"count": n, "recent": [the latest lines]}
    "straggler_news": dict[str, Any],
    # the pipelines to re-split in place, and how: {"version": n, "partitions": {"p": [...]}}
    "resplit": dict[str, Any],
    "wire": dict[str, Any],  # the meetings settled from the measured wire (MeetingChoice)
}


# -- encoding and decoding -------------------------------------------------------------------------


def record(message: Any) -> dict[str, Any]:
    """An event as the flat record a metrics line is made from."""
    if isinstance(message, Report):
        return message.record()
    return {"type": message.type, **dataclasses.asdict(message)}



def encode(message: Any) -> str:
    """One message as JSON (events carry their ``type``; a :class:`Report` is flat)."""
    if isinstance(message, Report):
        return json.dumps(message.record() | {"incarnation": message.incarnation})
    if isinstance(message, Hung):
        return json.dumps([list(pair) for pair in message.ranks])
    body = dataclasses.asdict(message)
    if type(message) in EVENTS.values():
        body = {"type": message.type, **body}
    return json.dumps(body)


def decode(raw: str | bytes, cls: type, key: str) -> Any:
    """The message of class ``cls`` stored under ``key``; :class:`ProtocolError` if it is not
    one."""
    value = _json(raw, key)
    if cls is Hung:
        return Hung([tuple(pair) for pair in _conform(value, list[tuple[int, int]], key, "ranks")])
    return _build(cls, value, key)


def decode_event(raw: str | bytes, key: str = "events") -> Event:
    """One record of the ``events`` queue, as its typed event."""
    value = _json(raw, key)
    if not isinstance(value, dict):
        raise ProtocolError(key, f"an event is a JSON object, not {_show(value)}")
    kind = value.get("type")
    if kind in EVENTS:
        return _build(EVENTS[kind], {k: v for k, v in value.items() if k != "type"}, key)
    if kind in REPORT_FIELDS:
        header = {k: value[k] for k in ("rank", "pipeline", "stage", "time", "incarnation")
                  if k in value}
        rest = {k: v for k, v in value.items() if k not in header and k != "type"}
        required, optional = REPORT_FIELDS[kind]
        for name, hint in {**required, **optional}.items():
            if name in rest:
                rest[name] = _conform(rest[name], hint, key, name)
            elif name in required:
                raise ProtocolError(key, f"a {kind} report lacks field {name!r}")
        return _build(Report, {"type": kind, **header, "fields": rest}, key)
    raise ProtocolError(key, f"unknown event type {_show(kind)}")


def decode_progress(raw: str | bytes, key: str) -> dict[str, Any]:
    """The progress snapshot, its known keys checked."""
    value = _json(raw, key)
    if not isinstance(value, dict):
        raise ProtocolError(key, f"the progress snapshot is a JSON object, not {_show(value)}")
    for name, hint in PROGRESS_FIELDS.items():
        if name in value:
            _conform(value[name], hint, key, name)
    return value


def _json(raw: str | bytes, key: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(key, f"not JSON ({err})") from None


def _build(cls: type, value: Any, key: str) -> Any:
    if not isinstance(value, dict):
        raise ProtocolError(key, f"{cls.__name__} is a JSON object, not {_show(value)}")
    hints, names, required = _schema(cls)
    unknown = sorted(set(value) - names)
    if unknown:
        raise ProtocolError(key, f"{cls.__name__} has no field {unknown[0]!r}")
    missing = [name for name in required if name not in value]
    if missing:
        raise ProtocolError(key, f"{cls.__name__} lacks field {missing[0]!r}")
    args = {name: _conform(v, hints[name], key, name) for name, v in value.items()}
    try:
        return cls(**args)
    except ValueError as err:
        raise ProtocolError(key, f"{cls.__name__}: {err}") from None


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], frozenset, tuple[str, ...]]:
    """A message class's field types, names and required names: read once per class (the
    scheduler decodes an event per worker and iteration)."""
    fields = dataclasses.fields(cls)
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    return typing.get_type_hints(cls), frozenset(f.name for f in fields), required


_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float),
                                          str: (str,)}


def _conform(value: Any, hint: Any, key: str, name: str) -> Any:
    """``value`` checked against the type ``hint`` (and nested dataclasses built)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                return _conform(value, option, key, name)
            except ProtocolError:
                pass
        raise _wrong(key, name, hint, value)
    if hint is type(None):
        if value is None:
            return None
        raise _wrong(key, name, hint, value)
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type, hint), value, key)  # a dataclass hint is its class
    if hint in _SCALARS:  # a bool is no number here, an int is a float
        if isinstance(value, _SCALARS[hint]) and (hint is bool or not isinstance(value, bool)):
            return float(typing.cast(float, value)) if hint is float else value  # int or float
        raise _wrong(key, name, hint, value)
    if origin is list and isinstance(value, list):
        return [_conform(v, args[0], key, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, list) and len(value) == len(args):
        return tuple(_conform(v, a, key, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, collections.abc.Mapping):
        if isinstance(value, dict):
            inner = args[1] if args else Any
            return {k: _conform(v, inner, key, f"{name}.{k}") for k, v in value.items()}
    raise _wrong(key, name, hint, value)


def _wrong(key: str, name: str, hint: Any, value: Any) -> ProtocolError:
    expected = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    expected = expected or str(hint).replace("typing.", "").replace("NoneType", "None")
    return ProtocolError(key, f"field {name!r} should be {expected}, not {_show(value)}")


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return f"{type(value).__name__} {text[:40]}"
