"""The sync modes and what each needs and supports: the one place that tells them apart.

Validation, the launcher, the scheduler, the worker's process group, the memory estimate, the
simulator and the report ask a mode's properties here instead of comparing its name (a test
reads the package for such comparisons); its settings are its config class
(``config.schema.SYNC_CONFIGS``), its worker side its strategy class
(``sync.strategies.strategy_class``), its simulated transport the branch of ``core.simulation``
for its :attr:`Mode.exchange`. A test keeps them in step, so a new mode is one entry in each.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mode", "MODES", "EXCHANGES", "mode", "names_with"]

#: How a mode's replicas exchange, as the simulator models it and the report reads it:
#: ``local`` nothing; ``groups`` rounds of the groups the scheduler forms; ``everyone`` a
#: collective of all P replicas every iteration; ``pairs`` a collective of two (gossip);
#: ``outer`` a collective of all P every ``sync.local_steps`` iterations; ``server`` a push to
#: the stage's parameter server and its reply.
EXCHANGES = ("local", "groups", "everyone", "pairs", "outer", "server")


@dataclass(frozen=True)
class Mode:
    """What a sync mode needs and supports."""

    name: str
    summary: str
    group_policy: bool = False  # the scheduler decides who syncs with whom (core.grouping)
    servers: bool = False  # one parameter server per stage, in a process group of the whole run
    checkpoints: bool = True  # its state can be saved (not a parameter server's)
    stop_together: bool = True  # replicas stop at the same iteration (on-exit and timed checkpoints)
    restart_run: bool = False  # fault.on_failure=restart: lock-step, consistent checkpoints
    survives_loss: bool = False  # fault.on_pipeline_loss=continue|restart: heals from a live replica
    flushed_only: bool = False  # counts an iteration's updates: no asynchronous schedule
    cuda: bool = True  # runs on GPUs (NCCL cannot receive from any source)
    exchange: str = "everyone"  # one of EXCHANGES
    shares_budget: bool = False  # pipelines share the run's budget and stop when told (a fast
    #                              one takes more iterations): the scheduler's or the server's
    meets: bool = False  # sync.every: replicas meet every H-th local step (slow links)
    low_precision: bool = False  # sync.precision: what is sent may be rounded to bfloat16
    sync_copies: int = 2  # flat copies of a stage's weights its sync keeps (the memory estimate)
    paced_by_slowest: bool = False  # every round waits for the slowest pipeline (core.replan)
    segments: bool = False  # pipelines may be split their own way (core.segments)
    balances: bool = False  # pipeline.balance: pipelines may take unequal shares of the batch,
    #                         each counted by its samples (core.balance)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("sdpipe", "groups of ready replicas chosen by the scheduler, global syncs now and then",
         group_policy=True, survives_loss=True, exchange="groups", shares_budget=True,
         meets=True, low_precision=True, segments=True, balances=True),
    Mode("allreduce", "every replica of a stage averages gradients every iteration",
         restart_run=True, paced_by_slowest=True, balances=True),
    Mode("ps", "a parameter server per stage, stale-synchronous", servers=True, checkpoints=False,
         stop_together=False, cuda=False, exchange="server", shares_budget=True),
    Mode("adpsgd", "pairwise gossip of weights (AD-PSGD)", restart_run=True, exchange="pairs",
         paced_by_slowest=True),  # through changing partners, everyone waits for the slowest
    Mode("diloco", "local steps, then an outer Nesterov step on the averaged change",
         restart_run=True, flushed_only=True, exchange="outer", low_precision=True,
         sync_copies=3, paced_by_slowest=True),  # its anchor and its outer momentum beside the all-reduce buffer
    Mode("none", "no sync: every pipeline trains its own replica", stop_together=False,
         exchange="local", sync_copies=0, segments=True),
)}


def mode(name: str) -> Mode:
    """The mode called ``name``; :class:`ValueError` for an unknown one."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"sync.name: unknown mode '{name}'; choose one of "
                         f"{', '.join(MODES)}") from None


def names_with(prop: str) -> list[str]:
    """The modes that have property ``prop`` (for messages that list the alternatives)."""
    return [m.name for m in MODES.values() if getattr(m, prop)]
