"""The stage-boundary layout: what a stage sends is checked, packed into one message and unpacked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sdpipe_cli.model.boundary import Boundary

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.float64]


def roundtrip(boundary: Boundary, value):
    tensors = boundary.flatten(value)
    buffer = boundary.pack(tensors, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.shape == (boundary.nbytes,)
    return boundary.unflatten(boundary.unpack(buffer))


def test_a_tensor_a_tuple_and_a_dict_round_trip():
    hidden, mask = torch.randn(2, 3, 4), torch.tensor([[1, 0, 1]] * 2)
    for value in (hidden, (hidden, mask), {"hidden": hidden, "mask": mask}):
        b = Boundary.of(value)
        back = roundtrip(b, value)
        assert type(back) is type(value) if not isinstance(value, torch.Tensor) else True
        flat = b.flatten(back)
        for got, want in zip(flat, b.flatten(value)):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert str(Boundary.of({"h": hidden, "m": mask})) == "{h: (2, 3, 4) float32, m: (2, 3) int64}"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=1, max_size=5))
def test_any_mix_of_shapes_and_dtypes_round_trips_bit_exactly(items):
    g = torch.Generator().manual_seed(0)
    value = tuple((torch.randn(shape, generator=g) * 100).to(dtype) for dtype, shape in items)
    b = Boundary.of(value)
    back = roundtrip(b, value)
    assert len(back) == len(value)
    for got, want in zip(back, value):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                           want.reshape(-1).view(torch.uint8) if want.numel() else want)


def test_gradients_travel_for_floating_tensors_only():
    b = Boundary.of((torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(3)))
    assert b.differentiable() == [0, 2]
    assert [s.shape for s in b.grads().specs] == [(2, 4), (3,)]


def test_a_changed_output_fails_on_the_sender_naming_both_layouts():
    b = Boundary.of((torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(RuntimeError, match=r"is \(\(3, 4\) float32, \(2,\) int64\).*set up for"):
        b.flatten((torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(RuntimeError, match="set up for"):
        b.flatten((torch.zeros(2, 4), torch.zeros(2, dtype=torch.int32)))  # integer dtype matters
    with pytest.raises(RuntimeError, match="set up for"):
        b.flatten(torch.zeros(2, 4))  # a tensor where a tuple was
    with pytest.raises(TypeError, match="item 1 is not a tensor"):
        b.flatten((torch.zeros(2, 4), 3))
    with pytest.raises(TypeError, match="blocks pass a tensor"):
        Boundary.of("text")


def test_low_precision_floats_are_cast_when_packed():
    b = Boundary.of((torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))).with_floats(torch.bfloat16)
    assert [s.dtype for s in b.specs] == [torch.bfloat16, torch.int64]
    x = torch.randn(2, 4)
    back = roundtrip(b, (x, torch.arange(2)))  # an fp32 output is accepted and sent as bf16
    assert back[0].dtype == torch.bfloat16 and torch.equal(back[0], x.to(torch.bfloat16))
    assert b.nbytes < Boundary.of((x, torch.arange(2))).nbytes


def test_every_tensor_starts_aligned():
    b = Boundary.of((torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.float64)))
    buffer = b.pack(b.flatten((torch.ones(3, dtype=torch.uint8), torch.ones(5, dtype=torch.float64))),
                    torch.device("cpu"))
    assert torch.equal(b.unpack(buffer)[1], torch.ones(5, dtype=torch.float64))
    assert b.nbytes == 16 + 48
