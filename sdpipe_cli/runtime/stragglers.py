"""The scheduler's side of slowdown detection: workers' step reports in, straggler lines out.

The decision is :class:`~sdpipe_cli.core.slowdowns.SlowdownDetector`'s; this feeds it the
``busy_s`` of every worker's step report and turns what it says into ``metrics.jsonl`` lines that
name the device (``node:index``), its node, pipeline, stage and rank, and into the progress
snapshot's ``stragglers`` (the launcher prints a line for each new one and each recovery).
"""

from __future__ import annotations

from typing import Any, Optional

from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.slowdowns import Change, SlowdownDetector, carried_of

__all__ = ["StragglerWatch"]


class StragglerWatch:
    """Stragglers among a run's workers (``fault.on_slowdown=warn``)."""

    def __init__(self, cfg: Any, plan: RunPlan):
        self.plan = plan
        self.detector = SlowdownDetector(plan.pipelines, plan.stages,
                                         float(cfg.fault.slowdown_threshold),
                                         int(cfg.fault.slowdown_window),
                                         carried=carried_of(cfg.fault.slowed, plan.pipelines,
                                                            plan.stages))

    def lines(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The lines a worker's report calls for (none but for a step report with ``busy_s``
        that changes a device's state)."""
        if record.get("type") != "step" or not isinstance(record.get("busy_s"), (int, float)):
            return []
        step_s = record.get("step_s")
        changes = self.detector.observe(int(record["pipeline"]), int(record["stage"]),
                                        int(record["step"]), float(record["busy_s"]),
                                        float(step_s) if isinstance(step_s, (int, float)) else None)
        return [self._line(c, record.get("time")) for c in changes]

    def reset(self, pipeline: int) -> None:
        """A restarted pipeline's devices start again from their own baselines."""
        self.detector.reset(pipeline)

    def carry(self, pipeline: int, slowed: dict[tuple[int, int], float]) -> None:
        """``pipeline`` restarts on a new split with its devices as slow as ``slowed`` says:
        their next baselines start from those slowdowns (as ``fault.slowed`` does for a leg)."""
        for s in range(self.plan.stages):
            self.detector.carried[(pipeline, s)] = slowed.get((pipeline, s), 1.0)

    def own_slowdowns(self) -> dict[tuple[int, int], Optional[float]]:
        """Every device's compute now over its own start (before the slowdowns earlier legs
        found, ``fault.slowed``), by (pipeline, stage)."""
        return {(p, s): self.detector.own_slowdown(p, s) for p in range(self.plan.pipelines)
                for s in range(self.plan.stages)}

    def current(self) -> list[dict[str, Any]]:
        """The devices that are stragglers now, for the progress snapshot."""
        out = []
        for p, s in self.detector.stragglers():
            score: Optional[float] = self.detector.score(p, s)
            carried = self.detector.devices[(p, s)].carried
            out.append({**self._where(p, s), "slower": None if score is None else round(score, 3),
                        **({"carried": carried} if carried > 1.0 else {})})
        return out

    def _where(self, pipeline: int, stage: int) -> dict[str, Any]:
        device = self.plan.cluster.device(pipeline, stage)
        return {"pipeline": pipeline, "stage": stage, "rank": self.plan.grid.rank(pipeline, stage),
                "device": device.name, "node": device.node}

    def _line(self, change: Change, time: Any) -> dict[str, Any]:
        return {"kind": change.kind, "time": time, **self._where(change.pipeline, change.stage),
                "iteration": change.iteration, "slower": change.slower, "busy_s": change.busy_s,
                "baseline_s": change.baseline_s}
