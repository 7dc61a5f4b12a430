"""The scheduler's side of slowdown detection: workers' step reports in, straggler lines out.

The decision is :class:`~sdpipe_cli.core.slowdowns.SlowdownDetector`'s; this feeds it the
``busy_s`` of every worker's step report and turns what it says into ``metrics.jsonl`` lines that
name the device (``node:index``), its node, pipeline, stage and rank, and into the progress
snapshot's ``stragglers`` (who is one now, for the summary).

It is also the one owner of what the console says about slow devices: a line for each change of
a device's state that it decided (named, recovered, or slow as an earlier leg or re-split found
it), kept in order in the snapshot's ``straggler_news``, which the launcher prints from. The
launcher never works out changes from two snapshots itself: those miss a change undone between
them and take a restart's fresh start for a recovery.
"""

from __future__ import annotations

from typing import Any

from sdpipe_cli.analysis.records import BY_KIND
from sdpipe_cli.config.schema import FaultConfig
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.slowdowns import Change, SlowdownDetector, carried_of

__all__ = ["StragglerWatch", "NEWS_KEPT"]

NEWS_KEPT = 32  # the latest console lines a snapshot carries (the launcher reads every 0.1 s)


class StragglerWatch:
    """Stragglers among a run's workers (``fault.on_slowdown=warn``), judged by the run's
    ``fault`` section."""

    def __init__(self, fault: FaultConfig, plan: RunPlan):
        self.plan = plan
        self.detector = SlowdownDetector(plan.pipelines, plan.stages, fault.slowdown_threshold,
                                         fault.slowdown_window,
                                         carried=carried_of(fault.slowed, plan.pipelines,
                                                            plan.stages))
        self.news: list[dict[str, Any]] = []  # the console's lines, the latest NEWS_KEPT
        self.told = 0  # lines in all
        for p, s in self.detector.stragglers():  # slow as an earlier leg found them
            self._tell(self._still_slow(p, s))

    def lines(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The lines a worker's report calls for (none but for a step report with ``busy_s``
        that changes a device's state)."""
        if record.get("type") != "step" or not isinstance(record.get("busy_s"), (int, float)):
            return []
        step_s = record.get("step_s")
        changes = self.detector.observe(int(record["pipeline"]), int(record["stage"]),
                                        int(record["step"]), float(record["busy_s"]),
                                        float(step_s) if isinstance(step_s, (int, float)) else None)
        lines = [self._line(c, record.get("time")) for c in changes]
        for line in lines:
            self._tell(line)
        return lines

    def reset(self, pipeline: int) -> None:
        """A restarted pipeline's devices start again from their own baselines; one that an
        earlier measurement carried into its baseline is slow from the start, and said to be
        if it was not named already (a device named slow stays so)."""
        before = set(self.detector.stragglers())
        self.detector.reset(pipeline)
        for p, s in self.detector.stragglers():
            if p == pipeline and (p, s) not in before:
                self._tell(self._still_slow(p, s))

    def news_snapshot(self) -> dict[str, Any]:
        """``straggler_news``: how many lines were decided in all, and the latest of them."""
        return {"count": self.told, "recent": list(self.news)}

    def _tell(self, line: dict[str, Any]) -> None:
        self.news = (self.news + [line])[-NEWS_KEPT:]
        self.told += 1

    def _still_slow(self, pipeline: int, stage: int) -> dict[str, Any]:
        return {"kind": "still_slow", **self._where(pipeline, stage),
                "carried": self.detector.devices[(pipeline, stage)].carried}

    def carry(self, pipeline: int, slowed: dict[tuple[int, int], float]) -> None:
        """``pipeline`` restarts on a new split with its devices as slow as ``slowed`` says:
        their next baselines start from those slowdowns (as ``fault.slowed`` does for a leg)."""
        for s in range(self.plan.stages):
            self.detector.carried[(pipeline, s)] = slowed.get((pipeline, s), 1.0)

    def own_slowdowns(self) -> dict[tuple[int, int], float | None]:
        """Every device's compute now over its own start (before the slowdowns earlier legs
        found, ``fault.slowed``), by (pipeline, stage)."""
        return {(p, s): self.detector.own_slowdown(p, s) for p in range(self.plan.pipelines)
                for s in range(self.plan.stages)}

    def current(self) -> list[dict[str, Any]]:
        """The devices that are stragglers now, for the progress snapshot."""
        out = []
        for p, s in self.detector.stragglers():
            score: float | None = self.detector.score(p, s)
            carried = self.detector.devices[(p, s)].carried
            out.append({**self._where(p, s), "slower": None if score is None else round(score, 3),
                        **({"carried": carried} if carried > 1.0 else {})})
        return out

    def _where(self, pipeline: int, stage: int) -> dict[str, Any]:
        device = self.plan.cluster.device(pipeline, stage)
        return {"pipeline": pipeline, "stage": stage, "rank": self.plan.grid.rank(pipeline, stage),
                "device": device.name, "node": device.node}

    def _line(self, change: Change, time: Any) -> dict[str, Any]:
        return BY_KIND[change.kind].line(time=time, **self._where(change.pipeline, change.stage),
                                         iteration=change.iteration, slower=change.slower,
                                         busy_s=change.busy_s, baseline_s=change.baseline_s)
