"""The interface every sync strategy implements, and the do-nothing strategy (``sync=none``).

The worker's loops call these hooks at fixed points of every update and read the properties
instead of comparing sync mode names; each mode is a subclass (:mod:`~sdpipe_cli.sync.strategies`,
:mod:`~sdpipe_cli.sync.diloco`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from sdpipe_cli.config.schema import SyncConfig


@dataclass(frozen=True)
class Wiring:
    """What a worker's strategy is built from besides its settings: the scheduler's store
    (``events``), the replica groups, the worker's place, its device, the run's seed, the
    optimizer whose state sdpipe's global syncs average, the pipeline's incarnation, the
    run's ``train.steps`` (which a strategy that meets only now and then needs to end together),
    its segments (:mod:`~sdpipe_cli.core.segments`: what replicas average when pipelines
    are split differently) and each pipeline's micro-batches per iteration (``samples``: what
    its gradient counts by in a mean where ``pipeline.balance`` made them unequal)."""

    events: Any
    groups: Any  # sync.groups.GroupCache (None in tests of a single replica)
    where: Any  # core.placement.Placement
    device: Any
    seed: int = 0
    optimizer: Any | None = None
    incarnation: int = 0
    steps: int = 0
    segments: Any | None = None  # core.segments.Segments
    samples: tuple[int, ...] = ()  # each pipeline's micro-batches (core.plan.RunPlan.microbatches)


class Sync:
    """No synchronization: every hook is a no-op; each pipeline stops after ``train.steps``."""

    name = "none"
    local_step = True  # whether the worker applies its own optimizer step (not with a PS)
    # whether replicas' weights are averaged in groups of one stage (a tied weight's copies on
    # different stages then drift apart and are averaged again: training/tied.py)
    mixes_weights = False
    # Whether the scheduler picks the checkpoints (replicas are consistent only at its global
    # syncs): if not, every replica stops at the same iterations, and a checkpoint may fall on any
    # multiple of ``checkpoint.every`` and at the end of the run.
    scheduled_checkpoints = False
    # Keys of :meth:`state_dict` that hold one flat vector over the stage's parameters (in their
    # order): a resharded checkpoint cuts them into parameters and joins them again
    flat_state: tuple[str, ...] = ()
    stop = False  # the run ended: a mode whose scheduler decides that sets it

    def rejoin(self, module: nn.Module) -> int | None:
        """A restarted replica takes its state from a live one (the iteration to go on from, or
        None if the run ended first): only a mode that heals lost pipelines can."""
        raise NotImplementedError(f"sync={self.name} does not restart a lost pipeline")

    @classmethod
    def build(cls, settings: SyncConfig, wiring: Wiring) -> Sync:
        """The strategy of the worker that ``wiring`` describes, for the run's ``sync`` settings
        (the dataclass of its mode)."""
        return cls()

    def started(self) -> None:
        """The worker's first iteration begins now (after every worker is built)."""

    def should_continue(self, step: int, local_go: bool, timed_out: bool) -> bool:
        return local_go

    def after_backward(self, module: nn.Module, step: int) -> None:
        pass

    def after_step(self, module: nn.Module, step: int) -> None:
        pass

    def meet_now(self) -> None:
        """The run is to end (a stop was asked for, or the time is up) but this strategy ends it
        itself: a strategy that meets its replicas only every few steps meets after the coming
        update, so that the end comes at this step boundary and not at the end of its block.
        Every stage of the pipeline is told at the same iteration."""

    def position(self, step: int) -> float:
        """Where the run is, in iterations of an average pipeline, for the learning rate of
        update ``step``: every replica of a lock-step or independent mode is at its own step."""
        return float(step)

    def stats(self) -> dict[str, Any]:
        """What the last sync did, for the step event (group size, waiting, communication)."""
        return {}

    def finish(self) -> None:
        """The worker is done training (a parameter server must stop waiting for it)."""

    def agree_on_checkpoint(self, wanted: bool) -> bool:
        """Whether to checkpoint after this iteration because time has come (first stage only);
        lock-step replicas must all agree, so that every shard is of the same step."""
        return wanted

    def checkpoint_due(self) -> int | None:
        """With :attr:`scheduled_checkpoints`: the id of the checkpoint the scheduler asked for
        after the last round, if any."""
        return None

    def drain_after(self, iteration: int) -> bool:
        """Asynchronous schedules, first stage, at the start of ``iteration``: whether the
        strategy needs the pipeline drained after it (a global sync there). Lock-step strategies
        end the run through :meth:`should_continue` and need no other drains."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What the strategy itself holds that a resume needs (in the worker's checkpoint
        shard); most hold nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
