"""``sdpipe sample``: text from an exported language model, to see what it learnt.

A transformers model generates through its own ``generate`` (greedy, or top-k sampling with a
temperature), with the exported tokenizer when the run had one. Any other causal language model
(the byte-level ``gpt``, a user's model over token ids) runs the same loop here: the last
``model.seq_len`` tokens in, the next token out. Models of UTF-8 bytes take the prompt as its
bytes and show what they produce as text (bytes that do not decode are replaced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sdpipe_cli.config.schema import ConfigError, objective
from sdpipe_cli.export.formats import Export

__all__ = ["Settings", "check", "sample"]

# what torch.manual_seed takes: a 64-bit seed, signed or not
_SEEDS = range(-2**63, 2**64)


TEMPERATURES = (1e-4, 1e4)  # --temperature: what the logits are divided by, kept finite
MAX_NEW_TOKENS = 1_000_000


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 64
    top_k: int = 0  # 0: greedy
    temperature: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError("--max-new-tokens", f"is {self.max_new_tokens}; must be in "
                              f"1..{MAX_NEW_TOKENS:,} (one forward a token: 10**9 would run for days)")
        if self.top_k < 0:
            raise ConfigError("--top-k", f"must be 0 (greedy) or more, got {self.top_k}")
        low, high = TEMPERATURES
        if not low <= self.temperature <= high:
            raise ConfigError("--temperature", f"is {self.temperature:g}; must be in [{low:g}, {high:g}]: "
                              "the logits are divided by it (1e-300 overflowed them; below the range "
                              "is --top-k 0's greedy pick, above it a uniform pick among the top k)")
        if self.seed not in _SEEDS:
            raise ConfigError("--seed", f"must fit in 64 bits ({_SEEDS.start} to "
                              f"{_SEEDS.stop - 1}), got {self.seed}")


def check(prompt: str, settings: Settings) -> None:
    """Refuse bad arguments (one line naming the option) before an export is read. A prompt that
    is not UTF-8 reaches Python from the shell with its stray bytes as lone surrogates: no
    tokenizer can take it, and what it meant cannot be known."""
    settings.check()
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(prompt[err.start])
        shown = f"byte 0x{char - 0xdc00:02x}" if 0xdc80 <= char <= 0xdcff else f"U+{char:04X}"
        raise ConfigError("--prompt", f"is not UTF-8 text: {shown} at character {err.start}") from None


def sample(export: Export, prompt: str, settings: Settings) -> str:
    """The prompt followed by what the model writes after it."""
    check(prompt, settings)
    if objective(export.config) != "clm":
        raise ConfigError(str(export.folder), f"holds a {export.config.model.arch} model trained "
                          f"for {objective(export.config)}, not a causal language model: "
                          "sdpipe sample cannot write with it (sdpipe eval measures it)")
    tokenizer = _tokenizer(export)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("--prompt", "is empty once tokenized")
    vocab = int(export.config.model.vocab_size)
    if max(ids) >= vocab:
        raise ConfigError("--prompt", f"has token id {max(ids)}, beyond the model's vocabulary "
                          f"of {vocab}")
    torch.manual_seed(settings.seed)
    prompt_ids = torch.tensor([ids])
    if export.manifest["format"] == "transformers":
        out = _generate_hf(export.whole, prompt_ids, settings)
    else:
        out = _generate(nn.Sequential(*export.blocks), prompt_ids, settings,
                        int(export.config.model.seq_len))
    return tokenizer.decode(out[0].tolist())


@torch.no_grad()
def _generate(model: nn.Module, ids: torch.Tensor, s: Settings, context: int) -> torch.Tensor:
    model.eval()
    for _ in range(s.max_new_tokens):
        logits = model(ids[:, -context:])[:, -1, :].float()
        ids = torch.cat([ids, _pick(logits, s)], dim=1)
    return ids


def _pick(logits: torch.Tensor, s: Settings) -> torch.Tensor:
    if s.top_k == 0:
        return logits.argmax(-1, keepdim=True)
    top, index = torch.topk(logits, min(s.top_k, logits.shape[-1]))  # the k likeliest, unscaled
    top = (top - top[..., :1]) / s.temperature
    choice = torch.multinomial(torch.softmax(top, -1), 1)
    return index.gather(-1, choice)


@torch.no_grad()
def _generate_hf(model: nn.Module, ids: torch.Tensor, s: Settings) -> torch.Tensor:
    positions = getattr(model.config, "n_positions", None)
    if positions is not None and ids.shape[1] + s.max_new_tokens > positions:
        raise ConfigError("--max-new-tokens", f"the prompt ({ids.shape[1]} tokens) and "
                          f"{s.max_new_tokens} new ones exceed the model's {positions} positions")
    kwargs = {"do_sample": True, "top_k": s.top_k, "temperature": s.temperature} if s.top_k else \
        {"do_sample": False}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                          pad_token_id=model.config.eos_token_id or 0, **kwargs)


class _Bytes:
    """UTF-8 bytes as token ids 0..255."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class _Saved:
    """The tokenizer exported with the model (transformers' AutoTokenizer)."""

    def __init__(self, folder):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _tokenizer(export: Export) -> _Saved | _Bytes:
    if export.tokenizer == "tokenizer.json":
        return _Saved(export.folder)
    if export.tokenizer == "bytes":
        return _Bytes()
    raise ConfigError(str(export.folder), "has no tokenizer (the run's data was not text sdpipe "
                      "tokenized), so a prompt cannot be turned into tokens")
