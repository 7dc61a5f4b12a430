"""Byte-level language models, written as a flat list of blocks.

A pipeline stage owns a contiguous range of blocks, so the model is not one ``nn.Module`` but a
list: block 0 embeds bytes, blocks ``1..n_layers`` are identical residual layers, and the last
block turns the residual stream into logits. Between any two consecutive blocks flows one float
tensor (batch, seq_len, d_model). Input and output embeddings are not tied (GPT-2's are; its
transformers version is ``model=gpt2``).

Two architectures: ``gpt`` (pre-LN decoder-only transformer, nanoGPT style) and ``mlp`` (a
per-position residual MLP with no attention, cheap enough for tests).

The module does no I/O and knows nothing of ``torch.distributed``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHS = ("gpt", "mlp")

INIT_STD = 0.02


class Embedding(nn.Module):
    """Block 0: byte ids (B, T) -> token + learned position embeddings (B, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj.residual_proj = True
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear."""

    def __init__(self, d_model: int, d_hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden)
        self.proj = nn.Linear(d_hidden, d_model)
        self.proj.residual_proj = True
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class TransformerLayer(nn.Module):
    """gpt layer: pre-LN attention then pre-LN MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_heads: int, d_hidden: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MLPLayer(nn.Module):
    """mlp layer: pre-LN residual MLP applied to each position independently (no attention)."""

    def __init__(self, d_model: int, d_hidden: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class Head(nn.Module):
    """Last block: final LayerNorm and projection to byte logits (B, T, vocab_size)."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def _check(model_cfg: Any) -> None:
    """Reject settings that cannot build a model, naming the offending key."""
    if model_cfg.arch not in ARCHS:
        raise ValueError(
            f"model.arch: unknown architecture {model_cfg.arch!r}; choose one of {', '.join(ARCHS)}"
        )
    if model_cfg.arch == "gpt" and int(model_cfg.d_model) % int(model_cfg.n_heads) != 0:
        raise ValueError(
            f"model.d_model: {model_cfg.d_model} is not divisible by "
            f"model.n_heads={model_cfg.n_heads}"
        )


def construct(model_cfg: Any) -> list[nn.Module]:
    """The blocks with PyTorch's default initialisation (see :func:`build_blocks`)."""
    _check(model_cfg)
    d, h, p = int(model_cfg.d_model), int(model_cfg.d_hidden), float(model_cfg.dropout)
    if model_cfg.arch == "gpt":
        make_layer = lambda: TransformerLayer(d, int(model_cfg.n_heads), h, p)  # noqa: E731
    else:
        make_layer = lambda: MLPLayer(d, h, p)  # noqa: E731
    blocks: list[nn.Module] = [Embedding(int(model_cfg.vocab_size), int(model_cfg.seq_len), d, p)]
    blocks += [make_layer() for _ in range(int(model_cfg.n_layers))]
    blocks.append(Head(d, int(model_cfg.vocab_size)))
    return blocks


def _init_weights(block: nn.Module, n_layers: int) -> None:
    """GPT-2 init: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 * n_layers)."""
    residual_std = INIT_STD / math.sqrt(2 * max(n_layers, 1))
    for module in block.modules():
        if isinstance(module, nn.Linear):
            std = residual_std if getattr(module, "residual_proj", False) else INIT_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)


def build_blocks(model_cfg: Any) -> list[nn.Module]:
    """The whole model as ``n_layers + 2`` blocks, initialised from the caller's torch RNG."""
    blocks = construct(model_cfg)
    for block in blocks:
        _init_weights(block, int(model_cfg.n_layers))
    return blocks
