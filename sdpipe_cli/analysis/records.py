"""The lines of ``metrics.jsonl``: one typed record class per ``kind``, the one schema.

A class names its kind's fields and their types; its docstring says what the line is and what
each field means. From these come the reader's checks (:data:`SCHEMA`, :data:`CHECKED`,
:data:`REQUIRED`: :func:`~sdpipe_cli.analysis.read_metrics`), the writers' lines (:meth:`Record.line`
refuses a field its class does not declare), the table of docs/RUNS.md (:mod:`.records_reference`)
and the suite's check of every line its runs write (``tests/helpers.py``). A line may lack a
field its class declares (a sync mode that does not measure it, a run of an older version); the
reader insists only on :attr:`Record.required`, and checks the types of :attr:`Record.checked`.

Part of :mod:`sdpipe_cli.analysis` (import from there).
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar

from sdpipe_cli.core.grouping.state import Joined, LeftOut, Reason

# a field's type as the reader checks it: int, number (int or float), str, bool, list, dict, any;
# "?": may be null
_SPECS = {int: "int", float: "number", str: "str", bool: "bool", list: "list", dict: "dict",
          Any: "any"}


class Record:
    """A kind of line. Subclasses declare their fields as annotations (``x: int``; ``x: float |
    None`` where it may be null)."""

    kind: ClassVar[str]
    required: ClassVar[tuple[str, ...]] = ()  # a line of the kind without one is refused
    checked: ClassVar[tuple[str, ...]] = ()  # typed where present (what the figures read)

    @classmethod
    def fields(cls) -> dict[str, str]:
        """Each field's type spec (see :data:`SCHEMA`), in declaration order (a copy)."""
        return dict(_fields_of(cls))

    @classmethod
    def line(cls, **values: Any) -> dict[str, Any]:
        """A line of this kind holding ``values``; a name the class does not declare is a
        writer's mistake, raised as TypeError."""
        unknown = values.keys() - _fields_of(cls).keys()
        if unknown:
            raise TypeError(f"a {cls.kind!r} line has no field {', '.join(sorted(unknown))}")
        return {"kind": cls.kind, **values}


_CLASS_VARS = {"kind", "required", "checked"}
_FIELDS: dict[type, dict[str, str]] = {}  # each class's, read once (a line per decision)


def _fields_of(record: type[Record]) -> dict[str, str]:
    found = _FIELDS.get(record)
    if found is None:
        found = _FIELDS[record] = {
            name: _spec(hint) for name, hint in typing.get_type_hints(record).items()
            if name not in _CLASS_VARS}
    return found


def _spec(hint: Any) -> str:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _spec(inner) + "?"
    if typing.get_origin(hint) is typing.Literal:  # words (see choices_of)
        return "str"
    return _SPECS[typing.get_origin(hint) or hint]


def choices_of(record: type[Record]) -> dict[str, frozenset[str]]:
    """The words a field may hold where its type names them (a ``Literal``, or dict values)."""
    found = {}
    for name, hint in typing.get_type_hints(record).items():
        if typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]
        if typing.get_origin(hint) is typing.Literal:
            found[name] = frozenset(typing.get_args(hint))
    return found


class _Iteration(Record):
    """What a stage's iteration reports, in the ``train`` line of a pipeline's last stage and
    the ``sync`` lines of the others (not a kind of its own)."""

    step_s: float
    compute_s: float
    sync_s: float
    straggled: int
    data_s: float
    group_size: int
    round: int
    group_kind: str
    wait_s: float
    comm_s: float
    stash_versions: int
    stash_bytes: int
    skipped_steps: int
    sent_bytes: int
    recv_bytes: int
    links: list
    busy_s: float
    behind_s: float
    behind_wait_s: float
    loss_scale: float


class TrainLine(_Iteration):
    """`pipeline`, `step`, `time`, `loss` (mean over the iteration's micro-batches), `samples`
    (cumulative, that pipeline), `samples_per_s` (that pipeline: samples since its first
    iteration ended, over the seconds since then, so one-off set-up is left out;
    `core/cadence.py`'s `Throughput`, the same under every schedule), `lr`, and `step_s`,
    `compute_s`, `sync_s` (seconds of the last iteration on the last stage; `compute_s` is
    `step_s - sync_s`); with `async_1f1b` also `stash_versions`, `stash_bytes` (the last stage's
    peak stashed weight versions and their bytes so far); `skipped_steps` (steps skipped so far:
    fp16 overflows, or non-finite gradients with `train.on_nonfinite=skip`); `data_s` (the last
    stage's wait for its batch); with `sync.overlap`, at a step where a round running behind was
    merged, `behind_s` (what its all-reduce took, in its thread) and `behind_wait_s` (how long
    the replica then waited for it: the part its steps did not hide); a non-finite `loss` is
    `null`; `straggled` (that worker's actions slowed by an emulated random straggler so far);
    under the group modes the last stage's round of the iteration: `group_size`, `round`,
    `group_kind` (`group` or `global`), `wait_s` (ready signal to decision), `comm_s` (the
    all-reduce); `sent_bytes`, `recv_bytes` and `links` (see below); with `fault.on_slowdown`
    `busy_s` (the stage's compute per iteration since its previous line); with fp16 `loss_scale`
    (the dynamic loss scale)"""

    kind: ClassVar[str] = "train"
    required: ClassVar[tuple[str, ...]] = ("time", "pipeline", "samples")
    checked: ClassVar[tuple[str, ...]] = ("time", "pipeline", "samples", "loss", "wait_s", "comm_s",
                                          "sync_s", "step_s", "samples_per_s")
    step: int
    time: float
    pipeline: int
    loss: float | None
    samples: float
    samples_per_s: float
    lr: float


class DataLine(Record):
    """the first stage's wait for its batch, each iteration: `pipeline`, `stage`, `step`,
    `time`, `step_s`, `data_s`"""

    kind: ClassVar[str] = "data"
    step: int
    time: float
    pipeline: int
    stage: int
    step_s: float
    data_s: float


class UnreadableLine(Record):
    """a sample the loader could not read, the first time a reading stage met it (replaced by
    the next sample of its class): `pipeline`, `stage`, `step`, `sample` (its file), `error`,
    `time`"""

    kind: ClassVar[str] = "unreadable"
    pipeline: int
    stage: int
    step: int
    sample: str
    error: str
    time: float


class EvalLine(Record):
    """`pipeline`, `step`, `time`, `val_loss` (mean over `data.eval_batches` fixed validation
    batches), `samples`; classifiers also `val_accuracy` (top-1)"""

    kind: ClassVar[str] = "eval"
    required: ClassVar[tuple[str, ...]] = ("time", "val_loss")
    checked: ClassVar[tuple[str, ...]] = ("time", "val_loss", "val_accuracy")
    step: int
    time: float
    pipeline: int
    val_loss: float | None
    samples: float
    val_accuracy: float | None


class SyncLine(_Iteration):
    """`sync=sdpipe`/`adpsgd`, stages other than the last (whose `train` lines carry the same
    fields): `pipeline`, `stage`, `step`, `group_size`, `round`, `group_kind`, `wait_s` (ready
    signal to decision), `comm_s` (the group all-reduce); and, as in `train` lines, `time`,
    `step_s`, `compute_s`, `sync_s`, `straggled`, `data_s`, `stash_versions`, `stash_bytes`,
    `skipped_steps`, `sent_bytes`, `recv_bytes`, `links`, `busy_s`, `behind_s`, `behind_wait_s`,
    `loss_scale`"""

    kind: ClassVar[str] = "sync"
    checked: ClassVar[tuple[str, ...]] = ("wait_s", "comm_s", "sync_s")
    step: int
    time: float
    pipeline: int
    stage: int


class GroupLine(Record):
    """`sync=sdpipe`, one per scheduler decision: `stage`, `round`, `members`, `iterations`
    (each member's), `size`, `group` (`group` or `global`), `stop`, `twins` (the members held
    the same state: gradients only, see SYNC.md), `max_wait_s`, `waits` (each member's wait for
    the decision, in `members` order), `reason` (why it closed: `all` every live replica was
    there, `expected` the replicas its forecasts awaited came, `late` one of them had not by its
    horizon, `window` nobody was awaited and its window passed, `cap` `max_group` were there,
    `connected` held until it merged another component, `global`, `stop` the run's last global
    sync), `outside` (each live pipeline the round left out, by pipeline, with why: `late`
    awaited and not there by the horizon, `capped` there past `max_group`, `global` at its
    iteration of the pending global sync, `busy` still computing and not awaited), `inside`
    (a group round's members, by pipeline, with why each is in: `opened` it opened the round,
    `expected` the round awaited it and it came, `ready` it was there, not awaited); `time`;
    `done` (the pipeline-iterations begun in the run, the lr schedule's clock, which a replay
    takes from here); `every` (where meetings are H iterations apart: `iterations` count
    meetings of this many); where meetings follow the wire, `nexts` (each member's next block)
    and `done_steps` (the run's pipeline-steps); `heal` (the restarted replicas the first member
    heals: [pipeline, iteration]); `weight_shares` and `grad_shares` (each member's share: a stale
    member counts less, `sync.stale`; by samples, `pipeline.balance`; twins: grads only)"""

    kind: ClassVar[str] = "group"
    required: ClassVar[tuple[str, ...]] = ("time", "stage", "round", "size")
    checked: ClassVar[tuple[str, ...]] = ("time", "stage", "round", "size")
    time: float
    stage: int
    round: int
    members: list
    iterations: list
    size: int
    group: str
    stop: bool
    twins: bool
    max_wait_s: float
    waits: list
    every: int
    nexts: list
    done_steps: int
    reason: Reason
    outside: dict[str, LeftOut]
    inside: dict[str, Joined]
    done: int | None
    heal: list
    weight_shares: list
    grad_shares: list


class ConsensusLine(Record):
    """`sync=sdpipe`, one per stage at every global sync: `stage`, `iteration`, `round`,
    `members`, `consensus` = sqrt(mean over replicas of ‖w_p − w_mean‖²) / ‖w_mean‖ just before
    the average: how far the replicas had drifted apart; `time`; `segment` (where sync units are
    not stages)"""

    kind: ClassVar[str] = "consensus"
    required: ClassVar[tuple[str, ...]] = ("stage", "consensus")
    checked: ClassVar[tuple[str, ...]] = ("stage", "consensus", "time", "round")
    stage: int
    iteration: int
    round: int
    members: list
    consensus: float | None
    time: float
    segment: int


class WireLine(Record):
    """`sync=sdpipe`, once, when the run settled its meetings from its wire probe
    ([SYNC.md](SYNC.md)): `every` (H, iterations between meetings), `precision` (of a meeting's
    values), `iteration_s` and `round_s` (the fastest pipeline's first iteration, and one
    meeting of every replica of the costliest stage in float32, that it compared), `share` (the
    meeting's share of the iteration it allows), `stages` (per stage: `stage`, `members`,
    `values` averaged, the measured `mbit_s` and `latency_ms` of its slowest replica's link),
    `adapt` (whether blocks then follow the wire), `time`"""

    kind: ClassVar[str] = "wire"
    time: float
    every: int
    precision: str
    iteration_s: float
    round_s: float
    share: float
    stages: list
    adapt: bool


class PaceLine(Record):
    """`sync=sdpipe`, where H follows the wire during the run: the period changed. `every` (the
    new H), `was` (the one before), `mbit_s` (the slowest link's rate it was decided from),
    `step_s` (the fastest pipeline's iteration it was decided from), `time`"""

    kind: ClassVar[str] = "pace"
    time: float
    every: int
    was: int
    mbit_s: float
    step_s: float


class CheckpointLine(Record):
    """one per complete checkpoint: `step`, `time`, `steps` (each pipeline's iterations), `path`"""

    kind: ClassVar[str] = "checkpoint"
    step: int
    time: float
    steps: dict
    path: str


class CheckpointDroppedLine(Record):
    """`sync=sdpipe`: a checkpoint that is not made because the global sync it follows failed on
    a replica (a member lost inside its all-reduce), so its replicas were never one model:
    `step` (its id), `time`, `reason` (the replica's pipeline and stage, and why)"""

    kind: ClassVar[str] = "checkpoint_dropped"
    step: int
    time: float
    reason: str


class ResumeLine(Record):
    """where a resumed leg begins: `checkpoint` (its folder's name), `steps` (each pipeline's
    iterations there), `at` (the checkpoint's moment on the run clock), `time`. A resume whose
    `steps` are behind the `train` lines before it (an older checkpoint, or the last one after a
    crash) starts a new timeline: `sdpipe report` draws it apart, labelled `(resumed from
    step_N)`, from its past up to `at` on"""

    kind: ClassVar[str] = "resume"
    checked: ClassVar[tuple[str, ...]] = ("time", "at")
    time: float
    checkpoint: str
    steps: dict
    at: float


class LostLine(Record):
    """`fault.on_pipeline_loss=continue`/`restart`: a pipeline the launcher stopped after one of
    its workers failed: `pipeline`, `time`, `reason` (the failure's line), `restart` (whether it
    is started again)"""

    kind: ClassVar[str] = "lost"
    pipeline: int
    time: float
    reason: str
    restart: bool


class RestartLine(Record):
    """of a pipeline (`fault.on_pipeline_loss=restart`): `pipeline`, `incarnation` (its
    restarts), `restart` (the run's restarts so far), `backoff_s`, `time`; of the whole run
    (`fault.on_failure=restart`): `restart`, `time`, `reason`, `from_checkpoint`, `redone` (per
    pipeline), `backoff_s`; `time_left` (seconds left of `run.time_limit`); `resplit` (a
    pipeline restarted on a new split, a re-split in place)"""

    kind: ClassVar[str] = "restart"
    pipeline: int
    incarnation: int
    restart: int
    backoff_s: float
    time: float
    reason: str
    from_checkpoint: int | None
    redone: dict
    time_left: float | None
    resplit: bool


class HealLine(Record):
    """a restarted replica took a live one's state: `pipeline`, `stage`, `incarnation`, `source`
    (the pipeline copied), `iteration` (where it goes on), `bytes`, `seconds` (from its request
    to having the state), `transfer_s` (of which the transfer, after the source's round closed),
    `time`; `segment` (where sync units are not stages)"""

    kind: ClassVar[str] = "heal"
    pipeline: int
    stage: int
    incarnation: int
    source: int
    iteration: int
    bytes: int
    seconds: float
    transfer_s: float
    time: float
    segment: int


class StragglerLine(Record):
    """`fault.on_slowdown=warn`: a device whose compute slowed down during the run
    ([CLUSTERS.md](CLUSTERS.md#devices-that-slow-down-during-a-run)): `device` (`node:index`),
    `node`, `pipeline`, `stage`, `rank`, `iteration` (its own, when it was named), `slower` (its
    compute time over its start's, relative to its peers'), `busy_s` (its compute per iteration
    now, the median of `fault.slowdown_window`), `baseline_s` (at its start), `time`"""

    kind: ClassVar[str] = "straggler"
    checked: ClassVar[tuple[str, ...]] = ("time", "pipeline", "stage", "device")
    time: float
    pipeline: int
    stage: int
    rank: int
    device: str
    node: str
    iteration: int
    slower: float
    busy_s: float
    baseline_s: float


class RecoveredLine(StragglerLine):
    """when a straggler computes at its usual speed again: a `straggler` line's fields,
    `device`, `node`, `pipeline`, `stage`, `rank`, `iteration`, `slower`, `busy_s`,
    `baseline_s`, `time`"""

    kind: ClassVar[str] = "recovered"


class ReplanLine(Record):
    """`fault.on_slowdown=replan`, after each `straggler` or `recovered` line
    ([FAULT_TOLERANCE.md](FAULT_TOLERANCE.md#re-planning-the-split-after-a-slowdown)): `device`,
    `pipeline`, `stage` (the line's), `partition` (the split now), `proposed` (the one the
    measured speeds call for), `go` (whether the run stops to move to it), `rate_now` and
    `rate_new` (the run's predicted samples/s), `move_s` (what moving costs), `gain_s` (what it
    saves over the rest of the budget), `reason`, `time`; `in_place` (the pipelines re-split in
    place: each restarts on its new split while the others go on)"""

    kind: ClassVar[str] = "replan"
    time: float
    device: str
    pipeline: int
    stage: int
    partition: list
    proposed: list
    go: bool
    rate_now: float
    rate_new: float
    move_s: float
    gain_s: float
    reason: str
    in_place: list


class SchedulerRestartLine(Record):
    """The scheduler was started again after it died by a signal
    ([FAULT_TOLERANCE.md](FAULT_TOLERANCE.md)): `restart` (the run's restarts so far),
    `replayed_batches` (of its journal), `silent_s` (how long no scheduler answered; `null`
    where it had not acted yet), `time`"""

    kind: ClassVar[str] = "scheduler_restart"
    time: float
    restart: int
    replayed_batches: int
    silent_s: float | None


class DoneLine(Record):
    """one per worker at the end: `rank`, `pipeline`, `stage`, `time`, `steps`, `samples` (the
    pipeline's), `param_digest` (a hash of the stage's weights: equal digests, bit-identical); a
    restarted worker's also `healed` (false: the run ended before it was healed); with
    `async_1f1b` also `stash_bound` (S - s, or 2 with 2BW), `stash_peak_versions`,
    `stash_peak_bytes` and `stash_copies` (weight copies made); every worker's `wall_s` (its
    seconds alive) and `traffic`: per link class its sync crossed (`same_node`, `cross_node`:
    the ring spans nodes; `server`: a parameter server), `sent_bytes`, `recv_bytes`, `seconds`
    in sync collectives (waiting for the other members inside them included) and `calls`;
    `device` (where it was placed), `actions` (forwards and backwards run), `straggled`,
    `slowdown_overruns` (actions whose real compute overran the modelled time), `peak_memory_mb`
    (`null` where not measured); with a loader `unreadable` and `unreadable_reads`"""

    kind: ClassVar[str] = "done"
    rank: int
    pipeline: int
    stage: int
    time: float
    steps: int
    samples: int
    param_digest: str
    device: str
    actions: int
    straggled: int
    slowdown_overruns: int
    peak_memory_mb: float | None
    healed: bool
    stash_bound: int
    stash_peak_versions: int
    stash_peak_bytes: int
    stash_copies: int
    traffic: dict
    wall_s: float
    unreadable: int
    unreadable_reads: int


RECORDS: tuple[type[Record], ...] = (
    TrainLine, DataLine, UnreadableLine, EvalLine, SyncLine, GroupLine, ConsensusLine, WireLine,
    PaceLine, CheckpointLine, CheckpointDroppedLine, ResumeLine, LostLine, RestartLine, HealLine,
    StragglerLine, RecoveredLine, ReplanLine, SchedulerRestartLine, DoneLine)
BY_KIND: dict[str, type[Record]] = {r.kind: r for r in RECORDS}
SCHEMA: dict[str, dict[str, str]] = {r.kind: r.fields() for r in RECORDS}  # kind -> field -> type
# the fields a reader checks where present (those the figures read), and those a line must have
CHECKED: dict[str, tuple[str, ...]] = {r.kind: r.checked for r in RECORDS if r.checked}
REQUIRED: dict[str, tuple[str, ...]] = {r.kind: r.required for r in RECORDS if r.required}
# kind -> field -> its words, where its type names them (checked by the suite, not the reader)
CHOICES: dict[str, dict[str, frozenset[str]]] = {r.kind: c for r in RECORDS if (c := choices_of(r))}

