"""Healing a restarted replica of ``sync=sdpipe`` (``fault.on_pipeline_loss=restart``): a
restarted replica asks the scheduler for a source per unit and takes its state by broadcast; a
replica the scheduler names as a source gives its state after its update.

:class:`Healing` is a part of :class:`~sdpipe_cli.sync.group_sync.GroupSync`, kept apart
because it is a protocol of its own (rejoin -> heal answer -> broadcast) that a reader of the
rounds does not need; it uses the group sync's units, communicators and store.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli.config.schema import SdpipeSyncConfig
from sdpipe_cli.model import optim
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync.groups import GroupCache, flatten, statistics, unflatten

__all__ = ["Healing"]

log = logging.getLogger("sdpipe.sync")

HEAL_POLL_S = 0.01  # how often a restarted replica looks for its units' heal answers


class Healing:
    """The healing half of :class:`~sdpipe_cli.sync.group_sync.GroupSync`."""

    # What it uses of the group sync it is a part of (GroupSync sets them). A unit is a
    # group_sync.Unit, unnamed here: group_sync imports this module.
    if TYPE_CHECKING:
        events: dist.Store
        groups: GroupCache
        units: list[Any]
        rank: int
        pipeline: int
        stage: int
        incarnation: int
        optimizer: torch.optim.Optimizer | None
        precision: str
        stop: bool
        _unsettled: SdpipeSyncConfig | None
        _done: int | None
        _decided_at: int

        def _clock(self) -> float: ...
        def _ranks(self, unit: Any, pipelines: list[int]) -> list[int]: ...
        def _follow(self, pipelines: list[int], incarnations: list[int]) -> None: ...
        def _settle(self, module: nn.Module) -> None: ...
        def _segment(self, unit: Any) -> dict[str, int]: ...
        @staticmethod
        def _replica(module: nn.Module) -> list[torch.Tensor]: ...

    def _state(self, unit, module: nn.Module) -> list[torch.Tensor]:
        """What a unit of a replica is: its weights and its optimizer's state, in a fixed order;
        with bf16 or int8 changes also the anchor they are taken from (a restarted replica's is filled
        in by the broadcast that heals it)."""
        params = list(module.parameters())
        state = params + statistics(module) + (optim.state_tensors(self.optimizer, params)
                                               if self.optimizer else [])
        if self.precision != "fp32":
            if unit.anchor is None:
                unit.anchor = torch.zeros_like(flatten(self._replica(module)))
            state.append(unit.anchor)
        return state

    def _give_heal(self, unit, module: nn.Module, target: protocol.HealTarget) -> None:
        """Send this unit's state to a restarted replica (the scheduler chose us as its source)."""
        self._follow([target.pipeline], [target.incarnation])
        ranks = [self.rank, self._ranks(unit, [target.pipeline])[0]]
        incarnations = [self.incarnation, target.incarnation]
        try:
            self.groups.broadcast(flatten(self._state(unit, module)), ranks, self.rank,
                                  incarnations, tag=f"heal{target.round}")
        except (RuntimeError, dist.DistError) as err:  # it died again; its pipeline is lost again
            self.groups.forget(ranks, incarnations)
            log.warning("healing pipeline %d failed (%s); going on", target.pipeline, err)

    def rejoin(self, module: nn.Module) -> int | None:
        """A restarted replica: for each unit, ask the scheduler for a source and take its
        state; returns the iteration to go on from. Every unit asks at once, so that all are
        healed at their next rounds (one after the other, they would take a round each). When
        the run ended first, ``stop`` is set instead and the state is not taken (the iteration
        is then where the pipeline was, if the scheduler knows)."""
        if self._unsettled is not None:  # what a healed replica's state holds depends on it
            self._settle(module)
        start = time.perf_counter()
        for unit in self.units:
            store.push(self.events, store.EVENTS, protocol.Rejoin(
                self.rank, self.pipeline, unit.index, self.incarnation))
        iteration = None
        for unit, answer in self._answers():
            iteration = self._heal(unit, unit.module(module), answer, start)
            if self.stop:
                break
        return iteration

    def _answers(self):
        """Each unit's heal answer, in the order of the run's heals (``order``), which every
        source gives in. The units' rounds may close at different iterations, and a source
        blocks in its broadcast until this replica takes it: taken in any other order, a
        source could wait on this replica while it waits on that source. The scheduler
        publishes heals in their order, so once one is there, a second look finds every
        earlier one too."""
        pending = list(self.units)
        waited, limit = 0.0, getattr(self.events, "timeout", None)
        limit = limit.total_seconds() if limit is not None else 300.0
        while pending:
            keys = [store.heal_key(u.index, self.pipeline, self.incarnation) for u in pending]
            if not any(self.events.check([key]) for key in keys) and waited < limit:
                time.sleep(HEAL_POLL_S)
                waited += HEAL_POLL_S
                continue
            there = [(store.read(self.events, key, protocol.HealAnswer), i)
                     for i, key in enumerate(keys) if self.events.check([key])]
            if not there:  # past the store's timeout: the first, and its timeout error
                yield pending.pop(0), store.take(self.events, keys[0], protocol.HealAnswer)
                continue
            answer, i = min(there, key=lambda a: (not a[0].stop, a[0].order))
            self.events.delete_key(keys[i])
            yield pending.pop(i), answer

    def _heal(self, unit, module: nn.Module, answer: protocol.HealAnswer,
              start: float) -> int | None:
        """Unit ``unit``'s state from the source the scheduler named in ``answer`` (its rejoin
        was sent at ``start``)."""
        answered = time.perf_counter()
        if answer.stop:
            self.stop = True
            return answer.iteration
        # not a stop: it names its source and iteration (HealAnswer checks that it does)
        giver, giver_incarnation = cast(int, answer.source), cast(int, answer.source_incarnation)
        self._follow([giver], [giver_incarnation])
        source = self._ranks(unit, [giver])[0]
        state = self._state(unit, module)
        flat = flatten(state)
        self.groups.broadcast(flat, [source, self.rank], source,
                              [giver_incarnation, self.incarnation],
                              tag=f"heal{answer.round}")
        unflatten(flat, state)
        # the run's progress as of now; the steps from here count on from it (position)
        self._done, self._decided_at = answer.done, cast(int, answer.iteration) - 1
        store.push(self.events, store.EVENTS, protocol.Report(
            "healed", self.rank, self.pipeline, self.stage, self._clock(), self.incarnation,
            {"source": answer.source, "iteration": answer.iteration,
             "bytes": flat.numel() * flat.element_size(),
             "seconds": round(time.perf_counter() - start, 4),
             "transfer_s": round(time.perf_counter() - answered, 4), **self._segment(unit)}))
        return answer.iteration
