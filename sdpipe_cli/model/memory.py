"""What a worker's memory will hold, estimated before anything starts.

A batch far too large for the machine is otherwise found out the slow way: P x S workers grow
together until the machine swaps or the kernel's OOM killer picks one, minutes into the run. The
launcher instead estimates each stage's worker from the model built on the meta device (no
memory, no compute), and refuses a run that cannot fit with the estimate in the message.

Per worker of stage ``s`` (bytes):

- weights, their gradients and the optimizer's state (AdamW: two slots per parameter; SGD with
  momentum: one), and the flat buffers a group all-reduce copies them into;
- the tensors its forward saves for the backward, measured per micro-batch by running the
  stage's blocks on meta tensors with autograd's saved-tensor hooks (parameters left out), times
  the micro-batches the schedule keeps in flight at once (1F1B: ``S - s``; GPipe: all of them);
  with activation checkpointing, each block's input instead, and one block's saved tensors;
- an asynchronous schedule's stashed weight versions besides the current one (PipeDream: one
  per other micro-batch in flight; 2BW, ``pipeline.weight_versions=2``: one);
- the interpreter and torch (:data:`PROCESS_BYTES`, CPU only: on a GPU it is host memory).

It is an estimate from above for the tensors and a typical figure for the process: allocator
fragmentation, cuDNN workspaces and data loaders are not in it. A model whose forward cannot run
on meta tensors (one that reads values) gets no estimate, and nothing is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from sdpipe_cli.core.interleaved import schedule_of, stage_blocks
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, Kind, in_flight
from sdpipe_cli.model.boundary import map_tensors
from sdpipe_cli.model.models import meta_blocks
from sdpipe_cli.model.optim import state_slots

log = logging.getLogger("sdpipe.memory")

GIB = 2**30
PROCESS_BYTES = 300 * 2**20  # a CPU worker's interpreter, torch and its libraries, resident


@dataclass(frozen=True)
class StageMemory:
    stage: int
    weights: int  # parameters and buffers
    training: int  # gradients, optimizer state, all-reduce buffers
    activations: int  # saved for the backward, one micro-batch
    in_flight: int  # micro-batches whose activations are held at once
    stashed: int  # weight versions an asynchronous schedule keeps besides the current one
    process: int  # the process itself

    @property
    def state(self) -> int:
        """What the worker holds whatever the batch: weights, gradients, optimizer state."""
        return self.weights * (1 + self.stashed) + self.training + self.process

    @property
    def total(self) -> int:
        return self.state + self.activations * self.in_flight

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, gradients and optimizer "
                f"{self.training / GIB:.2f} GiB, activations {self.activations / GIB:.2f} GiB "
                f"x {self.in_flight} micro-batch(es) in flight")


def estimate(cfg: DictConfig, example: Any, partition: Sequence[int] | None = None
             ) -> list[StageMemory] | None:
    """Each stage's worker, for a prepared config and an example micro-batch input, under
    ``partition`` (default ``pipeline.partition``: a pipeline split its own way gives its own);
    None when the model cannot run on meta tensors."""
    blocks, _ = meta_blocks(cfg.model)
    p, t = cfg.pipeline, cfg.train
    try:
        saved, inputs = _saved_per_block(blocks, example)
    except Exception as err:  # noqa: BLE001 - any model code may refuse meta tensors
        log.debug("no memory estimate: the forward does not run on meta tensors (%s)", err)
        return None
    slots = state_slots(t)
    sync_copies = mode(cfg.sync.name).sync_copies
    schedule = schedule_of(p.schedule, int(p.get("chunks", 1)))
    asynchronous = p.schedule in ASYNC_SCHEDULES
    out = []
    bounds = list(p.partition if partition is None else partition)
    for s, chunks in enumerate(stage_blocks(bounds, len(blocks), p.stages)):
        mine = [blocks[i] for a, b in chunks for i in range(a, b)]
        params = sum(_nbytes(x) for block in mine for x in block.parameters())
        buffers = sum(_nbytes(x) for block in mine for x in block.buffers())
        # what one micro-batch's forward keeps, per chunk
        if p.activation_checkpointing:
            kept = [sum(inputs[a:b]) + max(saved[a:b], default=0) for a, b in chunks]
        else:
            kept = [sum(saved[a:b]) for a, b in chunks]
        actions = schedule(p.stages, p.microbatches, s)
        flying = in_flight(actions)
        # interleaved or split: the most bytes held at once, each chunk's micro-batches at their
        # own size, those between B and W twice (written as its mean over those in flight)
        plain = len(kept) == 1 and not any(a.kind is Kind.W for a in actions)
        held = kept[0] if plain else -(-_peak_bytes(actions, kept) // max(flying, 1))
        out.append(StageMemory(
            stage=s, weights=params + buffers, training=params * (1 + slots + sync_copies),
            activations=held, in_flight=flying, stashed=_stashed(p, flying) if asynchronous else 0,
            process=PROCESS_BYTES if cfg.cluster.device == "cpu" else 0))
    return out


@dataclass(frozen=True)
class EvaluationMemory:
    """``sdpipe eval``'s one process, beyond what it holds already: every block's weights (on
    a GPU, a copy of them), a whole batch of inputs and targets as the loader hands it over
    (each sample, and their stack), and one micro-batch's forward, bounded from above by what
    a training forward saves of it and a block's input (no gradients, no optimizer state)."""

    weights: int
    batch: int
    activations: int

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, a batch {self.batch / GIB:.2f} GiB, "
                f"activations {self.activations / GIB:.2f} GiB")


def evaluation(cfg: DictConfig, batch: Any, micro: Any) -> EvaluationMemory | None:
    """The evaluation of the whole model (one stage) on ``batch``, an (inputs, targets) pair of
    the batch's shapes, in micro-batches of inputs ``micro`` (meta tensors will do); None when
    the model cannot run on meta tensors."""
    blocks, _ = meta_blocks(cfg.model)
    try:
        saved, inputs = _saved_per_block(blocks, micro)
    except Exception as err:  # noqa: BLE001 - any model code may refuse meta tensors
        log.debug("no memory estimate: the forward does not run on meta tensors (%s)", err)
        return None
    weights = sum(_nbytes(x) for block in blocks for x in (*block.parameters(), *block.buffers()))
    # under no_grad a block's tensors are freed once the next block has its output: the peak is
    # one block's, what training would save of it (its temporaries, from above) and its input
    return EvaluationMemory(weights=weights, batch=2 * _tree_bytes(batch),
                            activations=max((s + i for s, i in zip(saved, inputs)), default=0))


def over_device(cfg: DictConfig, example: Any, partitions: Sequence[Sequence[int]],
                device: Callable[[int, int], Any],
                estimates: dict[tuple[int, ...], list[StageMemory] | None] | None = None
                ) -> str | None:
    """The first worker that would not fit the memory its device declares (``memory`` of a
    device in ``cluster.nodes``), in words, under each pipeline's split ``partitions[p]``
    (``device(p, s)``: its device); None when each fits, no device declares any, or the model
    gives no estimate. The estimate bounds the tensors from above and counts a typical figure
    for the process, against a limit on all of it (on CPU the resident set): a worker over it
    here is not certain to exceed the limit, but would have no room left for what the estimate
    leaves out (fragmentation, workspaces).
    ``estimates``: the splits' estimates known already (filled in as they are made)."""
    estimates = {} if estimates is None else estimates
    for p, bounds in enumerate(partitions):
        bounds = tuple(int(b) for b in bounds)
        for s in range(int(cfg.pipeline.stages)):
            placed = device(p, s)
            if placed.memory_gib is None:
                continue
            if bounds not in estimates:
                estimates[bounds] = estimate(cfg, example, bounds)
            split = estimates[bounds]
            if split is None:
                return None
            need = split[s]
            if need.total > placed.memory_gib * GIB:
                return (f"stage {s} of pipeline {p} needs about {need.total / GIB:.2f} GiB "
                        f"({need.describe()}), but its device {placed.name} has "
                        f"{placed.memory_gib:g} GiB")
    return None


def _peak_bytes(actions: Sequence[Any], kept: Sequence[int]) -> int:
    """The most bytes ``actions`` hold at once when a forward on chunk ``c`` keeps ``kept[c]``
    until its backward (:func:`~sdpipe_cli.core.schedule.in_flight`, weighed). Where the
    backward is split, from its ``B`` to its ``W`` a micro-batch also holds the gradients that
    reach its weights, each the size of a tensor its forward saved: twice ``kept[c]`` at most
    (torch's split measured 1.3-1.6x on gpt_tiny, ``scripts/bench_schedule_memory.py``)."""
    split = any(action.kind is Kind.W for action in actions)
    now = most = 0
    for action in actions:
        if action.kind is Kind.F:
            now += kept[action.chunk]
        elif action.kind is Kind.B:
            now += kept[action.chunk] if split else -kept[action.chunk]
        elif action.kind is Kind.W:
            now -= 2 * kept[action.chunk]
        most = max(most, now)
    return most


def _stashed(p: DictConfig, flying: int) -> int:
    """Weight copies besides the current one: 2BW keeps two versions, PipeDream one per
    micro-batch in flight."""
    return 1 if p.get("weight_versions") == 2 else max(flying - 1, 0)


def _saved_per_block(blocks: Sequence[nn.Module], example: Any) -> tuple[list[int], list[int]]:
    """Per block: the bytes its forward saves for the backward (its parameters left out), and
    the bytes of its input; on meta tensors, with gradients on."""
    value = map_tensors(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), example)
    saved, inputs = [], []
    for block in blocks:
        params = {id(x) for x in block.parameters()}
        count = [0]

        def pack(x: torch.Tensor, params: set[int] = params, count: list[int] = count) -> torch.Tensor:
            base = x._base if x._base is not None else x
            if id(x) not in params and id(base) not in params:
                count[0] += _nbytes(x)
            return x

        inputs.append(_tree_bytes(value))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            value = block(value)
        saved.append(count[0])
    saved[-1] += 2 * _tree_bytes(value)  # the loss keeps the output and its log-softmax
    return saved, inputs


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _tree_bytes(value: Any) -> int:
    total = [0]

    def add(x: torch.Tensor) -> torch.Tensor:
        total[0] += _nbytes(x)
        return x

    map_tensors(add, value)
    return total[0]
