"""What a run knows of its model's shape without building it: what crosses each cut, and which
weights are tied.

Every worker needs the layout of what its stage receives and sends (a :class:`Boundary` at each
of its edges) and the tied weights it shares with other stages. Both follow from the model and
the micro-batch size alone, whatever the split: the layout after every block, found by one
forward on the meta device, and the blocks that hold one parameter between them. The launcher
finds them once, while it checks the model (:func:`sdpipe_cli.model.models.check`), and the
run plan carries them to every process (``plan.layout``, :meth:`ModelLayout.plain`). Each
worker used to trace the whole model again: a sixth of a small worker's start, and seconds of
Python for a large model, in every worker. A plan without one (a run prepared before it was
carried) or one that does not fit the plan beside it (another micro-batch size or block count:
a file edited by hand) is traced again (:func:`from_plan` returns None).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdpipe_cli.config.yaml_bounds import MAX_BYTES, MAX_ENTRIES
from sdpipe_cli.core.partition import stage_ranges
from sdpipe_cli.model.boundary import Boundary, TensorSpec

__all__ = ["ModelLayout", "carried_or_traced", "from_plan", "stage_ties"]

log = logging.getLogger("sdpipe.layout")

Ties = tuple[tuple[tuple[int, str], ...], ...]  # per shared parameter: (block, name) of each holder


@dataclass(frozen=True)
class ModelLayout:
    """``outputs[i]``: the layout after block ``i`` (all but the last block), for micro-batches
    of ``microbatch_size`` samples; ``ties``: each parameter held by more than one block, as
    ``((block, name), ...)`` (:func:`~sdpipe_cli.model.models.tied_parameters`)."""

    microbatch_size: int
    outputs: tuple[Boundary, ...]
    ties: Ties = ()

    @property
    def blocks(self) -> int:
        return len(self.outputs) + 1

    def stage_boundaries(self, stage: int, bounds: Sequence[int]) -> tuple[Boundary | None, Boundary | None]:
        """What piece ``stage`` of a model cut at ``bounds`` receives and sends (None at the
        pipeline's ends)."""
        start, stop = stage_ranges([int(b) for b in bounds], self.blocks)[stage]
        return (self.outputs[start - 1] if start > 0 else None,
                self.outputs[stop - 1] if stop < self.blocks else None)

    # -- carried in the plan ----------------------------------------------------------------------
    def plain(self) -> dict[str, Any]:
        """Plain values for the plan section: each boundary and the ties as one line of JSON
        (a run's ``config.yaml`` stays readable however deep the model)."""
        return {"microbatch_size": self.microbatch_size,
                "outputs": [_encode(b) for b in self.outputs],
                "ties": _json([[list(place) for place in places] for places in self.ties])}

    def carried(self) -> dict[str, Any] | None:
        """:meth:`plain`, unless it would make the run's file one that sdpipe does not read back
        (:mod:`~sdpipe_cli.config.yaml_bounds`: a list of more than ``MAX_ENTRIES``, a quarter
        of a file's ``MAX_BYTES``): a model of over 10,000 blocks is traced by each worker."""
        plain = self.plain()
        chars = sum(len(o) for o in plain["outputs"]) + len(plain["ties"])
        return plain if len(self.outputs) <= MAX_ENTRIES and chars <= MAX_BYTES // 4 else None

    @classmethod
    def of_plain(cls, values: Mapping[str, Any]) -> ModelLayout:
        """The inverse of :meth:`plain`; KeyError, TypeError or ValueError when malformed."""
        ties = tuple(tuple((int(b), str(name)) for b, name in places)
                     for places in json.loads(values["ties"]))
        return cls(int(values["microbatch_size"]), tuple(_decode(o) for o in values["outputs"]), ties)


def stage_ties(ties: Ties, held: Sequence[Sequence[tuple[int, int]]], stage: int
               ) -> list[tuple[tuple[int, ...], str]]:
    """Of the parameters ``ties``, those that stage ``stage`` holds a copy of while other stages
    hold theirs, each stage holding the block ranges ``held[stage]``: for each, the stages that
    hold one, and its name in this stage's module (its blocks in order, numbered from 0)."""
    blocks_of = [[b for lo, hi in ranges for b in range(lo, hi)] for ranges in held]
    stage_of = {b: s for s, mine in enumerate(blocks_of) for b in mine}
    out = []
    for places in ties:
        stages = tuple(sorted({stage_of[b] for b, _ in places}))
        mine = [(b, name) for b, name in places if stage_of[b] == stage]
        if len(stages) > 1 and mine:
            out.append((stages, f"{blocks_of[stage].index(mine[0][0])}.{mine[0][1]}"))
    return out


def from_plan(carried: Mapping[str, Any] | None, microbatch_size: int, blocks: int) -> ModelLayout | None:
    """The layout a run's plan carries, if it is one for this micro-batch size and this many
    blocks; None otherwise (not carried, malformed, or not this plan's): trace it."""
    if not carried:
        return None
    try:
        layout = ModelLayout.of_plain(carried)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return layout if layout.microbatch_size == microbatch_size and layout.blocks == blocks else None


def carried_or_traced(carried: Mapping[str, Any] | None, microbatch_size: int, blocks: int,
                      trace: Callable[[], ModelLayout]) -> ModelLayout:
    """The layout the plan carries (:func:`from_plan`), else ``trace()``'s, said in the log: a
    worker of a run prepared before plans carried one traces the whole model, as it did then."""
    known = from_plan(carried, microbatch_size, blocks)
    if known is None:
        log.info("the run's plan carries no layout of the model: traced it here")
        known = trace()
    return known


def _json(value: Any) -> str:
    """One line of JSON, ``$`` escaped (``\\u0024``, which JSON reads back as ``$``): a config's
    string holding ``${`` is an interpolation to OmegaConf, and a dict key of a model's own may
    hold one."""
    return json.dumps(value, separators=(",", ":")).replace("$", "\\u0024")


def _encode(b: Boundary) -> str:
    specs = [[str(s.dtype).removeprefix("torch."), list(s.shape)] for s in b.specs]
    return _json({"specs": specs, "keys": None if b.keys is None else list(b.keys), "single": b.single})


def _decode(text: str) -> Boundary:
    value = json.loads(text)
    specs = []
    for dtype, shape in value["specs"]:
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"not a dtype: {dtype!r}")
        specs.append(TensorSpec(tuple(int(d) for d in shape), kind))
    keys = value["keys"]
    return Boundary(tuple(specs), None if keys is None else tuple(str(k) for k in keys),
                    bool(value["single"]))
