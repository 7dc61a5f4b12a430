"""``sync.replay=RUN``: take a recorded sdpipe run's group decisions instead of deciding.

sdpipe's groups follow arrival times, so two runs with the same seed part ways at the first
round that a few microseconds decide differently, and their losses with it. Everything else a
worker does is a function of the seed and its position (the initial weights, the data order, the
averaging of a given set of members, the learning rate at a given ``done``). So a run that is
given the recorded decisions, every member of every round at every stage with the round's
number, kind, stop flag, twins flag, the members' shares (``sync.stale``), the run's progress
(``done``) and, where the meetings followed the wire, each member's next block and the run's
pipeline-steps (``nexts``, ``done_steps``), repeats the recorded run
step for step, whatever its own timing: its per-step losses are bit-identical (on the same
machine type and torch build).

The decisions are read from the recorded run's ``metrics.jsonl`` (its ``group`` lines), checked
against this run's layout before anything starts. A recorded run that lost, restarted or resumed
a pipeline is refused: its decisions name incarnations this run will not have.
"""

from __future__ import annotations

import json
from operator import attrgetter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sdpipe_cli.analysis import read_metrics
from sdpipe_cli.config import yaml_bounds
from sdpipe_cli.config.schema import Config, ConfigError
from sdpipe_cli.core.meetings import average_of, meetings_of, precision_of, setting
from sdpipe_cli.core.modes import MODES, mode
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES
from sdpipe_cli.runtime import protocol

__all__ = ["Recorded", "load", "recorded_meetings"]

KEY = "sync.replay"
_DISRUPTED = ("lost", "restart", "resume", "scheduler_restart")

Recorded = dict[tuple[int, int, int], protocol.Group]  # (stage, pipeline, iteration) -> decision


def load(path: str | Path, settings: Config) -> Recorded:
    """The decisions of the recorded run at ``path``, for a run of ``settings``; a
    :class:`ConfigError` naming ``sync.replay`` if they cannot be replayed here."""
    run = Path(path).expanduser()
    config = run / "config.yaml"
    if not config.is_file():
        raise ConfigError(KEY, f"{run} is not a sdpipe run folder (no config.yaml)")
    try:
        saved = yaml_bounds.load(config, KEY)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any YAML or OmegaConf error
        raise ConfigError(KEY, f"{config} cannot be read: {str(err).splitlines()[0]}") from None
    _same(saved, settings, run)
    decisions: Recorded = {}
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.is_file() else []
    for number, text in enumerate(lines, 1):
        try:
            line = json.loads(text)
        except ValueError:
            continue  # a line cut short by a kill
        kind = line.get("kind") if isinstance(line, dict) else None
        if kind in _DISRUPTED:
            raise ConfigError(KEY, f"{metrics}:{number}: the recorded run has a {kind} line; only "
                                   "a run without losses, restarts or resumes can be replayed")
        if kind == "group":
            _add(decisions, line, f"{metrics}:{number}",
                 (settings.pipeline.stages, settings.cluster.pipelines))
    if not decisions:
        raise ConfigError(KEY, f"{metrics} holds no group decisions: not a sdpipe run that trained")
    return decisions


def _same(saved: Any, settings: Config, run: Path) -> None:
    def get(key: str) -> Any:
        return OmegaConf.select(saved, key)

    def ours(key: str) -> Any:
        return attrgetter(key)(settings)

    if not (get("sync.name") in MODES and mode(get("sync.name")).group_policy):
        raise ConfigError(KEY, f"{run} was trained with sync={get('sync.name')}, not sdpipe: it "
                               "has no group decisions")
    # train.steps: the recorded stop flags end the replay where the recording ended, whatever
    # this run's budget (another one was ignored: a run of 2 or 40 steps trained the recording's 4)
    layout = ("cluster.pipelines", "pipeline.stages", "pipeline.schedule", "pipeline.microbatches",
              "train.steps")
    for key in layout:
        if get(key) != ours(key):
            raise ConfigError(KEY, f"{run} was recorded with {key}={get(key)}, this run has "
                                   f"{ours(key)}; replay needs the same")
    shares = list(get("plan.microbatches") or [get("pipeline.microbatches")] * int(get("cluster.pipelines")))
    plan = settings.plan
    if plan and shares != list(plan["microbatches"]):  # pipeline.balance's shares
        raise ConfigError(KEY, f"{run} was recorded with micro-batches per pipeline {shares}, this "
                               f"run has {list(plan['microbatches'])}; replay needs the same")
    if settings.pipeline.schedule in ASYNC_SCHEDULES:
        raise ConfigError(KEY, "replays flushed schedules (1f1b, gpipe) only")
    # the recorded decisions count meetings of sync.every steps, and what a round sends decides
    # its arithmetic (a recording from before these keys met every step in float32)
    from sdpipe_cli.sync.wire_probe import settled, unresolved

    recorded = saved.sync
    measured = recorded_meetings(str(run)) if unresolved(recorded) else None
    if measured is not None:  # the recording settled them from its measured wire
        recorded = settled(recorded, measured)
    for key, of in (("sync.every", lambda y: meetings_of(y).every),
                    ("sync.precision", precision_of), ("sync.overlap", _overlap)):
        if of(recorded) != of(settings.sync):
            raise ConfigError(KEY, f"{run} was recorded with {key}={of(recorded)}, this run has "
                                   f"{of(settings.sync)}; replay needs the same")


def _overlap(sync: Any) -> int:
    """How many steps late a run's rounds merge: only rounds that average weights after the
    step run behind (a recording from before the key merged in step)."""
    return int(setting(sync, "overlap", 0)) if average_of(sync) == "weights" else 0


def recorded_meetings(run: str) -> dict | None:
    """The meetings a recorded run settled from its measured wire (its ``wire`` line), if it
    did; a replay must meet as it did."""
    path = Path(run).expanduser() / "metrics.jsonl"
    if not path.is_file():
        return None
    return next((dict(line) for line in read_metrics(path, check=False)
                 if line.get("kind") == "wire"), None)


def _add(decisions: Recorded, line: dict, where: str, layout: tuple[int, int]) -> None:
    """``line``'s decision, for each member's iteration; the layout (S, P) bounds its stage and
    members, which the scheduler would otherwise index with."""
    stages, pipelines = layout
    try:
        if "done" not in line:
            raise KeyError("done")
        members = [int(p) for p in line["members"]]
        if not 0 <= int(line["stage"]) < stages or not all(0 <= p < pipelines for p in members):
            raise ValueError(f"stage {line['stage']} or members {members} outside the "
                             f"{pipelines} x {stages} layout")
        if len(line["iterations"]) != len(members):
            raise ValueError("one iteration per member")
        group = protocol.Group(members=members, round=int(line["round"]), kind=line["group"],
                               stop=bool(line["stop"]), incarnations=[0] * len(members),
                               done=line["done"], twins=bool(line.get("twins", False)),
                               weight_shares=[float(x) for x in line.get("weight_shares", [])],
                               grad_shares=[float(x) for x in line.get("grad_shares", [])],
                               nexts=[int(x) for x in line.get("nexts", [])],
                               done_steps=(None if line.get("done_steps") is None
                                           else int(line["done_steps"])))
        for p, k in zip(members, line["iterations"]):
            decisions[(int(line["stage"]), p, int(k))] = group
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(KEY, f"{where}: not a group decision this sdpipe can replay "
                               f"({type(err).__name__}: {err}); record the run again") from None
