"""Resharding: where a checkpoint's run goes on under another layout (P pipelines, S stages, the
partition), decided without touching a tensor.

A heterogeneous cloud cluster rarely gives back the machines it took: a node is gone for good, a
faster GPU type arrives, a new profile gives a better split. A checkpoint holds everything another
layout needs, since every replica of a stage is identical right after a global sync (sdpipe's
checkpoints are taken there, every other mode's replicas are in lock-step). This module decides,
as plain arithmetic, what each new pipeline starts from:

* **weights**: new pipeline ``q`` takes the blocks of old pipeline ``q`` (``q mod P`` once the old
  pipelines run out: the stage's replicas are one model), each block from the old stage that held
  it (:func:`pieces`), with its optimizer state; a pipeline split its own way
  (``pipeline.partitions``) gathers its blocks by its own ranges;
* **iterations and budget**: the run's budget is in samples, ``P x train.steps x batch``. The new
  layout's ``train.steps`` keeps it (``P x steps / P'``), and the iterations done are shared out so
  that their sum is the same, hence so is the learning rate's place in its schedule (a fraction of
  the budget). sdpipe's scheduler counts the budget over all pipelines, which may stand at
  different iterations; every other mode needs them equal. Where ``P'`` does not divide the counts,
  the nearest whole iterations are taken and :attr:`Plan.changed` says by how many samples;
* **data**: pipeline ``p`` of ``P`` reads entries ``p, p + P, p + 2P, ...`` of each epoch's
  permutation (:mod:`sdpipe_cli.data.sampling`), so the samples the old pipelines consumed in their
  latest epoch lie below one index of that permutation. The new pipelines start past it, in the
  same epoch: no sample is read twice in an epoch, and where the old pipelines stood at the same
  place (every lock-step mode) none is skipped either. Old pipelines still in an earlier epoch
  leave the rest of it unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sdpipe_cli.core.interleaved import stage_blocks

__all__ = ["Layout", "Plan", "plan", "pieces", "data_position", "source_pipeline"]


@dataclass(frozen=True)
class Layout:
    """``pipelines`` pipelines of ``(len(partition) + 1) / chunks`` stages over ``blocks``
    blocks; ``own``: the pipelines split their own way (``pipeline.partitions``), as (pipeline,
    boundaries); ``chunks``: each stage's model chunks (interleaved stages: a stage holds
    ``chunks`` ranges of blocks, :func:`~sdpipe_cli.core.interleaved.stage_blocks`)."""

    pipelines: int
    partition: tuple[int, ...]
    blocks: int
    own: tuple[tuple[int, tuple[int, ...]], ...] = ()
    chunks: int = 1

    @property
    def stages(self) -> int:
        return (len(self.partition) + 1) // self.chunks

    def describe(self) -> str:
        own = "".join(f", pipeline {q}: {list(b)}" for q, b in self.own)
        chunks = f" of {self.chunks} chunks" if self.chunks > 1 else ""
        return f"P={self.pipelines} S={self.stages}{chunks} partition {list(self.partition)}{own}"

    def partition_of(self, pipeline: int) -> tuple[int, ...]:
        return dict(self.own).get(pipeline, self.partition)

    def held(self, pipeline: int = 0) -> list[list[int]]:
        """Each stage's blocks in ``pipeline``, in its module's order (chunk after chunk)."""
        return [[b for lo, hi in chunks for b in range(lo, hi)]
                for chunks in stage_blocks(self.partition_of(pipeline), self.blocks, self.stages)]

    def stage_of(self, block: int, pipeline: int = 0) -> int:
        return next(s for s, mine in enumerate(self.held(pipeline)) if block in mine)


@dataclass(frozen=True)
class Plan:
    """What the new layout starts from."""

    steps: dict[int, int]  # new pipeline -> iterations done
    train_steps: int  # the new layout's train.steps
    positions: dict[int, int] | None  # new pipeline -> samples its data stream consumed
    sources: dict[int, int]  # new pipeline -> the old pipeline whose replicas it starts from
    budget: tuple[int, int]  # the run's budget in samples: before, after
    done: tuple[int, int]  # samples trained: before, after

    @property
    def changed(self) -> int:
        """Samples the new layout trains beyond the old budget's remainder (negative: fewer)."""
        return (self.budget[1] - self.done[1]) - (self.budget[0] - self.done[0])


def source_pipeline(new: int, old_pipelines: int) -> int:
    return new % old_pipelines


def pieces(old: Layout, new: Layout, source: int = 0, target: int = 0
           ) -> list[list[tuple[int, int, int]]]:
    """For each stage of new pipeline ``target``, where its blocks come from in old pipeline
    ``source``: ``(old stage, first block, stop)`` runs, in the new stage's module order (of
    consecutive blocks on one old stage)."""
    if old.blocks != new.blocks:
        raise ValueError(f"the layouts split {old.blocks} and {new.blocks} blocks")
    out = []
    for mine in new.held(target):
        runs: list[tuple[int, int, int]] = []
        for b in mine:
            s = old.stage_of(b, source)
            if runs and runs[-1][0] == s and runs[-1][2] == b:
                runs[-1] = (s, runs[-1][1], b + 1)
            else:
                runs.append((s, b, b + 1))
        out.append(runs)
    return out


def data_position(positions: Mapping[int, int], old_pipelines: int, new_pipelines: int,
                  samples: int) -> int:
    """The position every new pipeline starts its stream at, from the old pipelines' positions
    (samples consumed) over a training set of ``samples``; see the module's note."""
    old_shard, new_shard = samples // old_pipelines, samples // new_pipelines
    at = {p: divmod(k, old_shard) for p, k in positions.items()}
    epoch = max(e for e, _ in at.values())
    # one past the highest entry of the epoch's permutation that an old pipeline read
    frontier = max((p + old_pipelines * (w - 1) + 1 for p, (e, w) in at.items()
                    if e == epoch and w > 0), default=0)
    within = -(-frontier // new_pipelines)
    if within >= new_shard:  # the epoch is used up under the new shards: the next one
        return (epoch + 1) * new_shard
    return epoch * new_shard + within


def plan(old_steps: Mapping[int, int], train_steps: int, batch_size: int, new_pipelines: int, *,
         even: bool, positions: Mapping[int, int] | None = None, samples: int | None = None,
         new_train_steps: int | None = None) -> Plan:
    """The new layout's start from a checkpoint where old pipeline ``p`` had done
    ``old_steps[p]`` iterations of ``train_steps`` (its data stream at ``positions[p]``, over
    ``samples`` training samples; None: no stream saved). ``even``: every pipeline must stand at
    the same iteration (all modes but sdpipe). ``new_train_steps``: the user's own budget for the
    new layout, in iterations per pipeline; default: the old budget in samples."""
    old_p = len(old_steps)
    if old_p < 1 or new_pipelines < 1:
        raise ValueError("a layout has at least one pipeline")
    done = sum(old_steps.values())
    budget = old_p * train_steps
    new_steps = (new_train_steps if new_train_steps is not None
                 else max(1, round(budget / new_pipelines)))
    if even:
        each = round(done / new_pipelines)
        steps = {q: each for q in range(new_pipelines)}
    else:
        share, extra = divmod(done, new_pipelines)
        steps = {q: share + (q < extra) for q in range(new_pipelines)}
    if positions is None:
        starts = None
    elif new_pipelines == old_p:  # the same streams: each goes on where it was
        starts = {q: positions[q] for q in range(new_pipelines)}
    else:
        if samples is None:
            raise ValueError("data positions need the training set's size")
        start = data_position(positions, old_p, new_pipelines, samples)
        starts = {q: start for q in range(new_pipelines)}
    return Plan(steps=steps, train_steps=new_steps, positions=starts,
                sources={q: source_pipeline(q, old_p) for q in range(new_pipelines)},
                budget=(budget * batch_size, new_pipelines * new_steps * batch_size),
                done=(done * batch_size, sum(steps.values()) * batch_size))

