"""int8 with a scale per chunk (sdpipe_cli.sync.quantized), and its error feedback through the
real mean of changes over a group of one (an in-process gloo group: no other process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.meetings import BYTES, INT8_CHUNK
from sdpipe_cli.sync import quantized
from sdpipe_cli.sync.groups import GroupCache, mean_of_changes

# float32 arithmetic in x / scale and codes * scale: a few ulps of 127 steps past half a step
SLACK = 1 + 1e-4

values = st.lists(st.floats(-1e6, 1e6, width=32, allow_nan=False), min_size=1, max_size=300)


def chunked(xs: list[float], chunk: int) -> torch.Tensor:
    x = torch.tensor(xs, dtype=torch.float32)
    return torch.cat([x, x.new_zeros(quantized.padded(x.numel(), 1, chunk) - x.numel())])


@settings(max_examples=100, deadline=None)
@given(values, st.sampled_from([4, 16, INT8_CHUNK]), st.floats(1e-30, 1e3))
def test_a_round_trip_is_off_by_at_most_half_its_chunks_step(xs, chunk, magnitude):
    x = chunked(xs, chunk) * magnitude
    codes, scales = quantized.quantize(x, chunk)
    assert codes.dtype == torch.int8 and codes.shape == (x.numel() // chunk, chunk)
    assert scales.dtype == torch.float32 and bool((scales > 0).all())
    step = (x.reshape(-1, chunk).abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    error = (quantized.dequantize(codes, scales) - x).abs().reshape(-1, chunk)
    assert bool((error <= step[:, None] / 2 * SLACK).all())


def test_each_chunk_keeps_its_own_step():
    """A chunk of small values beside one of large ones keeps its small values (one scale for
    the whole vector would round them all to 0), and zeros come back as zeros."""
    x = torch.cat([torch.full((8,), 1e3), torch.linspace(-1e-3, 1e-3, 8), torch.zeros(8)])
    back = quantized.dequantize(*quantized.quantize(x, 8))
    torch.testing.assert_close(back[8:16], x[8:16], rtol=0, atol=1e-3 / 127 / 2 * SLACK)
    assert bool((back[16:] == 0).all())


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_pack_puts_one_shard_a_row_and_unpack_undoes_it(parts, per_shard, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (parts * per_shard, 4), generator=g).to(torch.int8)
    scales = torch.rand(parts * per_shard, generator=g)
    rows = quantized.pack(codes, scales, parts)
    assert rows.dtype == torch.int8 and rows.numel() == codes.numel() + 4 * scales.numel()
    back_codes, back_scales = quantized.unpack(rows, 4)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    for i in range(parts):  # row i: the i-th shard alone
        c, s = quantized.unpack(rows[i:i + 1], 4)
        shard = slice(i * per_shard, (i + 1) * per_shard)
        assert torch.equal(c, codes[shard]) and torch.equal(s, scales[shard])


def test_padding_makes_whole_chunks_in_equal_shards():
    assert quantized.padded(1000, 3, 256) == 3 * 2 * 256
    assert quantized.padded(768, 3, 256) == 768
    assert quantized.padded(0, 2, 4) == 8  # at least a chunk a shard
    assert BYTES["int8"] == 1 + 4 / INT8_CHUNK  # a byte a value and its share of a scale


def alone() -> GroupCache:
    """A group of one in this process: the real mean of changes, with nothing to wait for."""
    return GroupCache(dist.HashStore(), 0, "gloo", 10)


def test_error_feedback_sends_what_one_round_would_round_away():
    """Values below half their chunk's step round to 0 in every single round; with their
    residual added to the next round's change, they are sent all the same, a step at a time:
    over 100 rounds what was sent is the sum of the true changes to within half a step."""
    groups, residual = alone(), torch.zeros(INT8_CHUNK)
    change = torch.full((INT8_CHUNK,), 1e-3)
    change[0] = 1.0  # the chunk's step: 1/127, so 1e-3 rounds to 0 alone
    assert quantized.dequantize(*quantized.quantize(change))[1:].abs().max() == 0
    sent = torch.zeros(INT8_CHUNK)
    for _ in range(100):
        flat = change.clone()
        mean_of_changes(flat, residual, groups, [0], "int8")
        sent += flat
    torch.testing.assert_close(sent[1:], torch.full((INT8_CHUNK - 1,), 0.1), rtol=0,
                               atol=1 / 127 / 2 * SLACK)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1e-6, 1e2), min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_what_was_sent_never_drifts_from_the_true_changes(magnitudes, seed):
    """Whatever the changes, their sum and the sum of what was sent differ by the last residual
    alone, at most half a step of the last round: the error does not grow with the rounds."""
    g = torch.Generator().manual_seed(seed)
    groups, residual = alone(), torch.zeros(300)
    true, sent = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for magnitude in magnitudes:
        change = torch.randn(300, generator=g) * magnitude
        true += change.double()
        rounded = chunked((change + residual).tolist(), INT8_CHUNK)  # what this round rounds
        flat = change.clone()
        mean_of_changes(flat, residual, groups, [0], "int8")
        sent += flat.double()
    half_step = (rounded.reshape(-1, INT8_CHUNK).abs().amax(1) / 127).max().item() / 2 * SLACK
    arithmetic = 1e-6 * sum(magnitudes)  # float32's rounding of each round's sums
    assert (true - sent).abs().max().item() <= half_step + arithmetic
    assert residual.abs().max().item() <= half_step
