"""Measuring the wire at the start of a run, and settling its meetings: the transport.

The launcher leaves sdpipe's ``sync.every`` (0) or ``sync.precision`` (``auto``) unresolved
where the run's stage replicas span nodes and no link is described
(:func:`~sdpipe_cli.hetero.simulated_run.resolve_meetings`): nothing it knows says what the wire
costs. The run then settles them itself, once, before its first meeting:

1. every worker times its first iteration's compute, and, with every other replica of its
   stage, a few all-reduces over the real links (:func:`probe`);
2. it writes what it measured under ``wire/<rank>``;
3. the scheduler, before it builds its policy (which counts meetings), waits for every
   worker's report, decides (:func:`~sdpipe_cli.core.wire.decide`) and writes the choice under
   ``meetings`` (:func:`settle`);
4. every worker reads it (:func:`choice`) and meets by it from its first meeting on.

The messages are :class:`~sdpipe_cli.runtime.protocol.WireReport` and
:class:`~sdpipe_cli.runtime.protocol.MeetingChoice`, checked field by field when read.

A pipeline restarted later, and a scheduler started again, read the choice already made. The
decision is the pure :mod:`sdpipe_cli.core.wire`'s; nothing here decides.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
from omegaconf import DictConfig

from sdpipe_cli.analysis.records import WireLine
from sdpipe_cli.config import derived
from sdpipe_cli.config.schema import Config, SdpipeSyncConfig
from sdpipe_cli.core.meetings import Choice, setting
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES
from sdpipe_cli.core.wire import Measured, Probe, decide
from sdpipe_cli.runtime import protocol, store

__all__ = ["unresolved", "probe", "report", "choice", "settle", "settled", "record", "line",
           "follows", "blocks_allowed"]

log = logging.getLogger("sdpipe.scheduler")

SMALL_VALUES = 256  # the latency probe: a kilobyte
SMALL_REPEATS = 3  # the first small all-reduce also waits for the slowest member: not timed
WAIT_POLL_S = 0.01


def unresolved(sync: Any) -> bool:
    """Whether the launcher left this run's meetings to be measured (sdpipe only)."""
    return mode(sync.name).meets and (int(setting(sync, "every", 1) or 0) == 0
                                      or setting(sync, "precision", "fp32") == "auto")


def probe(groups, ranks: Sequence[int], values: int) -> Probe:
    """Time all-reduces over ``ranks`` (every replica of this worker's stage, all calling this
    at once): small ones for the latency (the fastest of them: the first also waits for the
    slowest member to arrive, and is not counted), then one of the stage's own ``values`` in
    float32 for the bandwidth."""
    small = torch.zeros(SMALL_VALUES)
    times = []
    for _ in range(SMALL_REPEATS):
        start = time.perf_counter()
        groups.all_reduce(small, list(ranks), tag="wire")
        times.append(time.perf_counter() - start)
    large = torch.zeros(max(values, SMALL_VALUES + 1))
    start = time.perf_counter()
    groups.all_reduce(large, list(ranks), tag="wire")
    large_s = time.perf_counter() - start
    return Probe(len(ranks), small.numel() * 4, min(times[1:]), large.numel() * 4, large_s)


def report(events, rank: int, measured: Measured) -> None:
    """Worker ``rank``'s measurements, for the scheduler."""
    p = measured.probe
    store.put(events, store.wire_key(rank), protocol.WireReport(
        measured.pipeline, measured.stage, measured.step_s, measured.values, p.members,
        p.small_bytes, p.small_s, p.large_bytes, p.large_s))


def _measured(r: protocol.WireReport) -> Measured:
    return Measured(r.pipeline, r.stage, r.step_s, r.values,
                    Probe(r.members, r.small_bytes, r.small_s, r.large_bytes, r.large_s))


def _wait(events, keys: list[str], timeout: float) -> None:
    """Until every key is there; a run that failed meanwhile (a worker died before it
    measured) ends the wait, as does ``timeout`` (``run.timeout``)."""
    deadline = time.monotonic() + timeout
    while not events.check(keys):
        if events.check([store.FAILED]):
            raise RuntimeError("the run failed before its wire was measured")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no wire measurement within {timeout:.0f} s (run.timeout)")
        time.sleep(WAIT_POLL_S)


def choice(events, timeout: float) -> protocol.MeetingChoice:
    """The settled meetings (waiting for the scheduler to decide)."""
    _wait(events, [store.MEETINGS], timeout)
    return store.read(events, store.MEETINGS, protocol.MeetingChoice)


def settle(settings: Config, events, workers: int, timeout: float
           ) -> protocol.MeetingChoice | None:
    """The scheduler's side: the meetings settled from every worker's report (or, started
    again, the choice already made); None where the launcher resolved them."""
    sync = settings.sync
    if not unresolved(sync):
        return None
    assert isinstance(sync, SdpipeSyncConfig)  # the one mode that leaves its meetings open
    if not events.check([store.MEETINGS]):
        _wait(events, [store.wire_key(r) for r in range(workers)], timeout)
        reports = [_measured(store.read(events, store.wire_key(r), protocol.WireReport))
                   for r in range(workers)]
        made = decide(reports, sync.wire_share, sync.every, sync.precision,
                      most=settings.train.steps)
        store.put(events, store.MEETINGS, _record(made, reports, follows(settings, made)))
        log.info("measured links: %s", made.describe())
    return store.read(events, store.MEETINGS, protocol.MeetingChoice)


@overload
def settled(cfg: SdpipeSyncConfig, chosen: Any) -> SdpipeSyncConfig: ...
@overload
def settled(cfg: Config, chosen: Any) -> Config: ...
@overload
def settled(cfg: DictConfig, chosen: Any) -> DictConfig: ...
def settled(cfg: Any, chosen: Any) -> Any:
    """A copy of a config, or of its ``sync`` section, meeting as ``chosen`` says (a
    :class:`~sdpipe_cli.runtime.protocol.MeetingChoice`, or a recorded ``wire`` line); of a
    run's settings (:mod:`sdpipe_cli.config.settings`, sdpipe's), or of their ``sync``, settings.
    The run's own config keeps them unresolved (its checkpoints too: a resumed run measures again, its links
    may have changed)."""
    get: Callable[[str], Any] = (chosen.get if isinstance(chosen, dict)
                                 else lambda k: getattr(chosen, k))
    if isinstance(cfg, SdpipeSyncConfig):
        return dataclasses.replace(cfg, every=int(get("every")), precision=str(get("precision")))
    if isinstance(cfg, Config):  # only sdpipe leaves its meetings to the wire (unresolved)
        assert isinstance(cfg.sync, SdpipeSyncConfig)
        return dataclasses.replace(cfg, sync=settled(cfg.sync, chosen))
    # a config, or its sync section, is a mapping: so is the copy
    prefix = "sync." if "sync" in cfg else ""
    return derived.variant(cfg, {f"{prefix}every": int(get("every")),
                                 f"{prefix}precision": str(get("precision"))})


def follows(settings: Config, made: Choice) -> bool:
    """Whether the meetings follow the wire during the run: where they are apart at the start
    (on a wire that already fits every iteration in float32, nothing changes), H was left to
    choose, and no replica is ever healed (a healed replica would need its block's length;
    ``fault.on_pipeline_loss=stop``, no re-split in place)."""
    apart = made.every > 1 or made.precision != "fp32"
    return apart and int(setting(settings.sync, "every", 1)) == 0 and blocks_allowed(settings)


def blocks_allowed(settings: Config) -> bool:
    """Whether a run's blocks of local steps may differ in length (decided by the scheduler,
    ``Group.nexts``): not where a replica may be healed, which would need its block's length
    (``fault.on_pipeline_loss`` other than ``stop``, a re-split in place), nor under an
    asynchronous schedule (a round per update)."""
    fault = settings.fault
    return (fault.on_pipeline_loss == "stop" and fault.on_slowdown != "replan"
            and settings.pipeline.schedule not in ASYNC_SCHEDULES)


def _record(made: Choice, reports: Sequence[Measured], adapt: bool) -> protocol.MeetingChoice:
    """The choice and what it was made from, per stage: the slowest replica's fitted link."""
    stages: dict[int, tuple[float, protocol.StageLink]] = {}
    for r in reports:
        fit = r.probe.fit()
        if r.stage not in stages or fit.bytes_per_s < stages[r.stage][0]:
            stages[r.stage] = (fit.bytes_per_s, protocol.StageLink(
                r.stage, r.probe.members, r.values, round(fit.mbit_s, 3),
                round(fit.latency_s * 1e3, 3)))
    return protocol.MeetingChoice(made.every, made.precision, made.iteration_s, made.round_s,
                                  made.share, [stages[s][1] for s in sorted(stages)],
                                  made.describe(), adapt)


def record(chosen: protocol.MeetingChoice) -> dict:
    """The choice as plain data (``summary.json``, the progress snapshot)."""
    return dataclasses.asdict(chosen)


def line(chosen: protocol.MeetingChoice, time_s: float) -> dict:
    """The metrics line of the choice."""
    return WireLine.line(time=time_s, **{k: v for k, v in record(chosen).items()
                                         if k != "describe"})
