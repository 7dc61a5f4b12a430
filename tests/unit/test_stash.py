"""WeightStash: versions shared between forwards, copied only after a change, freed by the last
backward, bounded, and the gradient through a stashed version is the one of the forward's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from sdpipe_cli.pipeline.stash import WeightStash


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_forwards_between_updates_share_one_copy():
    m = model()
    stash = WeightStash(m, bound=3)
    v0, w0 = stash.acquire(0)
    v1, w1 = stash.acquire(1)
    assert v0 == v1 == 0 and w0 is w1 and stash.copies == 1 and stash.versions == 1
    stash.changed()
    v2, w2 = stash.acquire(2)
    assert v2 == 1 and w2 is not w0 and stash.copies == 2 and stash.versions == 2
    assert stash.bytes == 2 * nbytes(m) and stash.peak_bytes == 2 * nbytes(m)
    assert stash.release(0) == 0 and stash.versions == 2  # micro-batch 1 still uses version 0
    assert stash.release(1) == 0 and stash.versions == 1
    assert stash.get(2) == (1, w2)
    stash.release(2)
    assert stash.versions == 0 and stash.bytes == 0 and stash.in_flight == 0
    assert stash.stats() == {"stash_bound": 3, "stash_peak_versions": 2,
                             "stash_peak_bytes": 2 * nbytes(m), "stash_copies": 2}


def test_a_version_is_a_copy_that_later_updates_do_not_touch():
    m = model()
    stash = WeightStash(m, bound=2)
    _, weights = stash.acquire(0)
    before = {k: v.detach().clone() for k, v in weights.items()}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    stash.changed()
    for name, p in m.named_parameters():
        assert weights[name] is not p and torch.equal(weights[name], before[name])
        assert weights[name].requires_grad


def test_gradient_through_a_stashed_version_is_the_forward_weights_gradient():
    """Backward after an update, with autograd.grad w.r.t. the stashed tensors, equals the gradient
    of a plain model holding the old weights; two micro-batches of one version do not mix."""
    m = model()
    reference = model()  # the same initial weights
    stash = WeightStash(m, bound=2)
    xa, xb = torch.randn(5, 3), torch.randn(5, 3)
    _, w = stash.acquire(0)
    ya = functional_call(m, w, (xa,)).square().mean()
    _, w_again = stash.acquire(1)
    yb = functional_call(m, w_again, (xb,)).sin().mean()
    with torch.no_grad():  # an update lands between the forwards and the backwards
        for p in m.parameters():
            p.mul_(-3.0)
    stash.changed()
    names = list(w)
    grads_a = torch.autograd.grad(ya, [w[n] for n in names])
    grads_b = torch.autograd.grad(yb, [w[n] for n in names])
    reference.zero_grad()
    reference(xa).square().mean().backward()
    for name, g in zip(names, grads_a):
        torch.testing.assert_close(g, dict(reference.named_parameters())[name].grad)
    reference.zero_grad()
    reference(xb).sin().mean().backward()
    for name, g in zip(names, grads_b):
        torch.testing.assert_close(g, dict(reference.named_parameters())[name].grad)


def test_bound_is_enforced():
    stash = WeightStash(model(), bound=2)
    stash.acquire(0)
    stash.changed()
    stash.acquire(1)
    stash.changed()
    with pytest.raises(RuntimeError, match="over its bound"):
        stash.acquire(2)
    with pytest.raises(RuntimeError, match="already in flight"):
        stash.acquire(1)
    with pytest.raises(ValueError):
        WeightStash(model(), bound=0)


def test_bound_one_uses_the_live_weights_and_forbids_updates_in_flight():
    """The last stage's backward directly follows its forward: nothing to copy, as in PipeDream."""
    m = model()
    stash = WeightStash(m, bound=1)
    version, weights = stash.acquire(0)
    assert all(weights[n] is p for n, p in m.named_parameters())
    assert stash.bytes == 0 and stash.copies == 0 and not stash.copying
    with pytest.raises(RuntimeError, match="uncopied"):
        stash.changed()
    stash.release(0)
    stash.changed()
    assert stash.acquire(1)[0] == version + 1
    assert stash.stats()["stash_peak_bytes"] == 0 and stash.peak_versions == 1
