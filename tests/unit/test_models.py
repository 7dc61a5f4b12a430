"""Model blocks: shapes, composition, deterministic init, causality and parameter counts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from sdpipe_cli.config.schema import ModelConfig, n_blocks
from sdpipe_cli.model.bytes_lm import build_blocks
from sdpipe_cli.model.models import block_param_counts, cross_entropy as loss_fn

ARCHS = ["gpt", "mlp"]


def tiny(arch: str = "gpt", **overrides) -> ModelConfig:
    fields = dict(
        name="tiny", arch=arch, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_hidden=64
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def build(cfg, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return build_blocks(cfg)


def random_bytes(batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_block_count_and_shapes(arch):
    cfg = tiny(arch)
    blocks = build(cfg)
    assert len(blocks) == n_blocks(cfg) == cfg.n_layers + 2
    x = random_bytes(3, cfg.seq_len)
    h = blocks[0](x)
    assert h.dtype == torch.float32 and tuple(h.shape) == (3, 16, 32)
    for block in blocks[1:-1]:
        h = block(h)
        assert tuple(h.shape) == (3, 16, 32)
    logits = blocks[-1](h)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_weights_different_seed_different(arch):
    cfg = tiny(arch)

    def flat(blocks):
        return torch.cat([p.detach().flatten() for b in blocks for p in b.parameters()])

    a, b, c = flat(build(cfg, seed=7)), flat(build(cfg, seed=7)), flat(build(cfg, seed=8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("arch", ARCHS)
def test_untrained_loss_is_near_uniform(arch):
    cfg = tiny(arch)
    blocks = build(cfg)
    x, y = random_bytes(4, cfg.seq_len, seed=2), random_bytes(4, cfg.seq_len, seed=3)
    with torch.no_grad():
        loss = loss_fn(torch.nn.Sequential(*blocks)(x), y)
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(256)) < 0.3


def test_loss_fn_is_mean_cross_entropy():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    manual = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss_fn(logits, targets), manual)


@pytest.mark.parametrize("arch", ARCHS)
def test_param_counts_match_built_model(arch):
    cfg = tiny(arch)
    blocks = build(cfg)
    counts = block_param_counts(cfg)
    assert len(counts) == len(blocks)
    assert counts == [sum(p.numel() for p in b.parameters()) for b in blocks]
    assert counts[0] == (cfg.vocab_size + cfg.seq_len) * cfg.d_model


def test_param_counts_leave_rng_untouched():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    block_param_counts(tiny())
    assert torch.equal(state, torch.get_rng_state())


def test_gpt_is_causal():
    cfg = tiny("gpt")
    model = torch.nn.Sequential(*build(cfg)).eval()
    x = random_bytes(1, cfg.seq_len)
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_accepts_dictconfig():
    cfg = OmegaConf.structured(tiny("mlp"))
    assert len(build(cfg)) == 4
    assert block_param_counts(cfg)[0] == (cfg.vocab_size + cfg.seq_len) * cfg.d_model


def test_unknown_byte_arch_rejected():
    with pytest.raises(ValueError, match="model.arch"):
        build_blocks(tiny("rnn"))


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="n_heads"):
        build_blocks(tiny("gpt", d_model=30, n_heads=4))
    build_blocks(tiny("mlp", d_model=30, n_heads=4))  # mlp has no heads


def test_reading_the_shapes_skips_initialisation_and_its_imports():
    """The launcher reads every model's block shapes on the meta device; an initialiser there
    fills nothing, and ``normal_``'s meta version alone would import torch's compiler and sympy
    (a second or more of every command's start). Each builder's shapes, and no such import."""
    code = """
import sys
from omegaconf import OmegaConf
from sdpipe_cli.config.schema import ModelConfig
from sdpipe_cli.model.models import block_param_counts
for arch in ("gpt", "mlp", "resnet_cifar"):
    model = OmegaConf.structured(ModelConfig(arch=arch, vocab_size=256, seq_len=16, d_model=32,
                                             num_classes=10))
    counts = block_param_counts(model)
    assert len(counts) > 3 and all(n > 0 for n in counts[1:]), (arch, counts)
heavy = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
