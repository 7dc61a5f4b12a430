"""What crosses a stage boundary: a tensor, a tuple of tensors or a dict of tensors, as one message.

A user's model does not pass one float tensor from block to block: BERT's layers may carry an
attention mask beside the hidden states, a ResNet's feature maps change shape at every stage, a
custom model returns a tuple. A :class:`Boundary` describes one such value (the tensors' shapes
and dtypes, in a fixed order, and how they nest), is inferred once from a sample forward, and
then both neighbours use it: the sender checks every output against it (a block whose output
changed shape fails on the sending stage, naming the boundary, instead of hanging or misaligning
its receiver), and packs the tensors into one flat byte buffer; the receiver allocates that
buffer and unpacks views of it.

One message per activation and one per gradient keeps the link's ordering argument (see
:mod:`sdpipe_cli.pipeline.p2p`) exactly as it is for a single tensor, whatever the model sends.
The price is one copy of the activation into the buffer, small beside the compute that made it.

Gradients flow back only for the floating-point tensors (:meth:`Boundary.grads`): integer tensors
(token ids, masks as ints) carry none. A floating tensor that does not influence the loss gets a
zero gradient, so both sides always exchange the same layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Boundary", "TensorSpec", "map_tensors", "tensors_of"]

ALIGN = 16  # bytes: every tensor starts aligned in the buffer, so a view as its dtype is legal


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize  # no tensor made to ask: nbytes is read for every message

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class Boundary:
    """The layout of a value between two stages: ``specs`` in order; ``keys`` for a dict,
    ``None`` with ``single`` for a bare tensor, ``None`` otherwise for a tuple."""

    specs: tuple[TensorSpec, ...]
    keys: tuple[str, ...] | None = None
    single: bool = False

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def of(cls, value: Any, where: str = "a block's output") -> Boundary:
        """The boundary of ``value``: a tensor, a tuple or list of tensors, or a dict of them."""
        tensors, keys, single = _flatten(value, where)
        return cls(tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors), keys, single)

    @classmethod
    def tensor(cls, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Boundary:
        return cls((TensorSpec(tuple(int(d) for d in shape), dtype),), None, True)

    # -- structure --------------------------------------------------------------------------------
    def flatten(self, value: Any, where: str = "output") -> list[torch.Tensor]:
        """The tensors of ``value`` in order; RuntimeError unless it has this layout (a floating
        tensor may differ in precision: packing casts it)."""
        tensors, keys, single = _flatten(value, where)
        got = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        if len(got) != len(self.specs) or keys != self.keys or single != self.single or any(
                g.shape != s.shape or (g.dtype != s.dtype and not (
                    g.dtype.is_floating_point and s.dtype.is_floating_point))
                for g, s in zip(got, self.specs)):
            raise RuntimeError(f"{where} is {_describe(got, keys, single)}, but the pipeline was set "
                               f"up for {self}; a block's output must keep its shape and dtype "
                               "from one micro-batch to the next")
        return tensors

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self.single:
            return tensors[0]
        if self.keys is not None:
            return dict(zip(self.keys, tensors))
        return tuple(tensors)

    def with_floats(self, dtype: torch.dtype) -> Boundary:
        """The same layout with its floating-point tensors sent as ``dtype`` (mixed precision:
        half the bytes; a floating output of any precision is cast to it when packed)."""
        return Boundary(tuple(TensorSpec(s.shape, dtype if s.dtype.is_floating_point else s.dtype)
                              for s in self.specs), self.keys, self.single)

    def grads(self) -> Boundary:
        """The layout of the gradient message: the floating-point tensors, in order, as a tuple."""
        return Boundary(tuple(s for s in self.specs if s.dtype.is_floating_point))

    def differentiable(self) -> list[int]:
        """Indices of the tensors that carry a gradient back."""
        return [i for i, s in enumerate(self.specs) if s.dtype.is_floating_point]

    # -- the wire ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(_padded(s.nbytes) for s in self.specs)

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """One contiguous ``uint8`` buffer holding ``tensors`` (already checked) in order."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        offset = 0
        for spec, t in zip(self.specs, tensors):
            n = spec.nbytes
            if n:
                buffer[offset:offset + n].view(spec.dtype).copy_(t.detach().reshape(-1))
            offset += _padded(n)
        return buffer

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` (of :meth:`pack`'s layout) as this boundary's tensors."""
        out, offset = [], 0
        for spec in self.specs:
            n = spec.nbytes
            out.append(buffer[offset:offset + n].view(spec.dtype).view(spec.shape))
            offset += _padded(n)
        return out

    def __str__(self) -> str:
        return _describe(self.specs, self.keys, self.single)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` (a tensor, or a tuple, list or dict of tensors) with ``fn`` applied to each
    tensor, in the same structure; anything else is kept as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a value between blocks, in :meth:`Boundary.flatten`'s order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, value)
    return found


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _flatten(value: Any, where: str) -> tuple[list[torch.Tensor], tuple[str, ...] | None, bool]:
    if isinstance(value, torch.Tensor):
        return [value], None, True
    if isinstance(value, dict):
        keys = tuple(str(k) for k in value)
        tensors = list(value.values())
    elif isinstance(value, (tuple, list)):
        keys, tensors = None, list(value)
    else:
        raise TypeError(f"{where} is a {type(value).__name__}; blocks pass a tensor, or a tuple or "
                        "dict of tensors, to the next block")
    bad = [k for k, t in zip(keys or range(len(tensors)), tensors) if not isinstance(t, torch.Tensor)]
    if bad or not tensors:
        raise TypeError(f"{where} holds no tensor" if not tensors else
                        f"{where}: item {bad[0]!r} is not a tensor; blocks pass a tensor, or a tuple "
                        "or dict of tensors, to the next block")
    return tensors, keys, False


def _describe(specs: Sequence[TensorSpec], keys: Sequence[str] | None, single: bool) -> str:
    if single:
        return str(specs[0])
    if keys is not None:
        return "{" + ", ".join(f"{k}: {s}" for k, s in zip(keys, specs)) + "}"
    return "(" + ", ".join(str(s) for s in specs) + ")"
