"""int8 with a float32 scale per chunk of values: ``sync.precision=int8``'s payload.

A change is cut into chunks of :data:`~sdpipe_cli.core.meetings.INT8_CHUNK` values, and each
chunk is sent as int8 codes and one scale, its largest magnitude / 127: a chunk of small values
keeps its own fine step instead of sharing the step of the vector's largest value. Each value is
then off by at most half its chunk's step (:func:`quantize`, :func:`dequantize`); error feedback
(:func:`~sdpipe_cli.sync.groups.mean_of_changes`) keeps that error for the next round.

A group's mean is summed shard by shard (:func:`~sdpipe_cli.sync.groups.mean_of_changes`): the
codes and scales are cut into one shard per member (:func:`pack`), exchanged all-to-all, summed
by the shard's owner in float32, rounded again and all-gathered. So the wire carries int8 both
ways, never a float type, and every member decodes the same bytes. :func:`pack` puts a shard's
codes and its scales' bytes in one int8 row, so that each phase is one collective.

Pure torch: no communication.
"""

from __future__ import annotations

import torch

from sdpipe_cli.core.meetings import INT8_CHUNK

__all__ = ["quantize", "dequantize", "padded", "pack", "unpack"]

LEVELS = 127  # codes -127..127: symmetric, so a change and its negation round alike


def padded(n: int, parts: int, chunk: int = INT8_CHUNK) -> int:
    """The length ``n`` values take once padded with zeros to whole chunks, ``parts`` shards of
    as many chunks each (at least one chunk a shard)."""
    per = parts * chunk
    return max(1, -(-n // per)) * per


def quantize(x: torch.Tensor, chunk: int = INT8_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[m, chunk]`` and float32 scales ``[m]`` of the float32 vector ``x`` (its
    length a multiple of ``chunk``): ``x ~ codes * scale``, to within scale / 2 per value.

    A scale is at least the smallest normal float32 (a chunk of zeros, or of values so small
    that their step would underflow): no division by zero, and a step that divides exactly."""
    rows = x.detach().float().reshape(-1, chunk)
    scales = (rows.abs().amax(dim=1) / LEVELS).clamp_(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(rows / scales[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 vector that ``codes`` and ``scales`` (:func:`quantize`'s) stand for."""
    return (codes.float() * scales[:, None]).reshape(-1)


def pack(codes: torch.Tensor, scales: torch.Tensor, parts: int) -> torch.Tensor:
    """``codes`` and ``scales`` as ``parts`` int8 rows, one shard each: a shard's codes, then
    its scales' bytes (the chunks must divide into ``parts`` shards)."""
    shard_codes = codes.reshape(parts, -1)
    shard_scales = scales.float().contiguous().view(torch.int8).reshape(parts, -1)
    return torch.cat([shard_codes, shard_scales], dim=1)


def unpack(rows: torch.Tensor, chunk: int = INT8_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack`'s inverse: the codes ``[m, chunk]`` and scales ``[m]`` of every row, in
    order."""
    per_row = rows.shape[1] // (chunk + 4)  # chunks per shard: chunk codes + 4 bytes of scale
    codes = rows[:, :per_row * chunk].reshape(-1, chunk)
    scales = rows[:, per_row * chunk:].contiguous().view(torch.float32).reshape(-1)
    return codes, scales
