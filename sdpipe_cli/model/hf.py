"""Hugging Face transformers models (GPT-2 causal LM, BERT masked LM) as a flat list of pipeline blocks.

The model is built from its config (or loaded from a local ``save_pretrained`` folder; nothing is ever
downloaded), then split into the same shape of list as :mod:`sdpipe_cli.model.models`: block 0 embeds token
ids (B, T) into hidden states (B, T, H), one block per transformer layer maps hidden -> hidden, and the last
block maps hidden -> logits (B, T, V). Each block takes one tensor and returns one tensor.

The blocks wrap the HF model's own submodules (nothing is copied), so a block's parameter names are HF's
(``wte.weight``, ``layer.attn.c_attn.weight``, ``predictions.decoder.weight``...) and, when the word
embeddings are tied, block 0 and the head hold the very same ``Parameter`` object: the caller finds tied
weights by identity.

In transformers 5 a layer does not build its own attention mask: the parent model's ``forward`` builds it
once (``create_causal_mask`` / ``create_bidirectional_mask``) and hands it, with a few other arguments, to
every layer. Each layer block here rebuilds that mask from its input with the same call and the same
config, and passes the layer exactly what the parent passes it when there is no padding and no cache, so
composing the blocks computes, op for op, what the HF model computes. Attention is ``sdpa`` (HF's default):
with the mask rebuilt by HF's own function, ``sdpa`` and ``eager`` both compose exactly (the tests check
both); ``sdpa`` is faster and does not materialize the (T, T) weights. ``attn_implementation`` in the
overrides picks another one.

transformers is imported lazily, inside functions: importing it takes seconds, and the rest of the tool
(and this module's import) must not pay for it.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

KINDS = ("gpt2", "bert")
ATTN_IMPLEMENTATION = "sdpa"
# The dropout probabilities of each config: overrides may set them even for a pretrained model.
DROPOUT_KEYS = {
    "gpt2": ("embd_pdrop", "resid_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
}
# The length of the position table, under each config's own name.
POSITIONS_KEY = {"gpt2": "n_positions", "bert": "max_position_embeddings"}


# --- blocks -------------------------------------------------------------------------------------


class GPT2Embeddings(nn.Module):
    """Block 0 of GPT-2: ids (B, T) -> wte(ids) + wpe(0..T-1), then embedding dropout, as GPT2Model does."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))


class GPT2Layer(nn.Module):
    """One ``GPT2Block``, called as ``GPT2Model.forward`` calls it for an unpadded batch without a cache.

    The config is kept (it is the one the layer's attention already holds) because the causal mask is
    built from it: its attention implementation decides between a float mask (eager) and ``None`` with
    sdpa's ``is_causal``.
    """

    def __init__(self, layer: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = None  # what create_causal_mask returns for sdpa without padding (is_causal instead)
        if self.config._attn_implementation != "sdpa":  # its checks read values: not on meta
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                      cache=None, position_ids=position_ids)
        # GPT2Model: block(hidden, cache, causal_mask, encoder_hidden_states, encoder_attention_mask=...,
        # use_cache=..., position_ids=...).
        return self.layer(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                          position_ids=position_ids)


class GPT2Head(nn.Module):
    """Last block of GPT-2: final LayerNorm ``ln_f`` then ``lm_head`` (its weight is ``wte``'s when tied)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_f = ln_f
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class BertEmbeddingsBlock(nn.Module):
    """Block 0 of BERT: ``BertEmbeddings`` with its default positions 0..T-1 and token type 0 everywhere."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids)


class BertLayerBlock(nn.Module):
    """One ``BertLayer``, called as ``BertEncoder`` calls it for an unpadded batch: full (bidirectional)
    attention, no cache. The config is kept to build the mask as ``BertModel`` does (``None`` when there
    is no padding, with eager and sdpa alike)."""

    def __init__(self, layer: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=None)
        # BertEncoder: layer(hidden, attention_mask, encoder_hidden_states, encoder_attention_mask=...,
        # cache=..., **kwargs), where BertModel's kwargs carry position_ids (None unless given).
        return self.layer(hidden, mask, None, encoder_attention_mask=None, cache=None, position_ids=None)


class BertHead(nn.Module):
    """Last block of BERT: the MLM head ``cls.predictions``: transform, then decoder to vocabulary."""

    def __init__(self, predictions: nn.Module):
        super().__init__()
        self.predictions = predictions

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.predictions(hidden)


# --- building -----------------------------------------------------------------------------------


def build_blocks(kind: str, overrides: dict, pretrained: str | None = None,
                 tie_embeddings: bool = True) -> tuple[list[nn.Module], list[str]]:
    """The model ``kind`` ("gpt2" or "bert") as blocks and their names: "embeddings", "layer0".., "head"."""
    return split_blocks(build_model(kind, overrides, pretrained, tie_embeddings))


def build_model(kind: str, overrides: dict, pretrained: str | None = None,
                tie_embeddings: bool = True) -> nn.Module:
    """The whole HF model (``GPT2LMHeadModel`` or ``BertForMaskedLM``) that :func:`split_blocks` cuts up.

    Fresh: built from ``GPT2Config(**overrides)`` / ``BertConfig(**overrides)``, weights initialized by HF
    from torch's global generator (seed it first). Pretrained: loaded from the local folder; the saved
    config decides the architecture, the overrides' dropout probabilities are applied, ``vocab_size``
    must equal the saved one and the saved position table must be at least as long as the overrides ask.
    In both cases ``use_cache`` is off (training, never generation).
    """
    if kind not in KINDS:
        raise ValueError(f"model.arch: unknown Hugging Face model {kind!r}, expected one of "
                         f"{', '.join(KINDS)}")
    overrides = dict(overrides or {})
    folder = _check_pretrained(kind, pretrained) if pretrained is not None else None
    config_cls, model_cls = _import_hf(kind)
    attn = overrides.pop("attn_implementation", ATTN_IMPLEMENTATION)
    _check_keys(kind, config_cls, overrides)
    if folder is None:
        try:
            # HF validates the config (its strict-dataclass errors are no ValueError) and the model's
            # shapes (n_embd divisible by n_head...): both are errors in the model's settings.
            config = config_cls(**_fresh_config(kind, overrides, tie_embeddings), attn_implementation=attn)
            model = model_cls(config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model.hf: invalid {kind} config: {_one_line(e)}") from e
        except Exception as e:
            if type(e).__module__.split(".")[0] != "huggingface_hub":
                raise
            raise ValueError(f"model.hf: invalid {kind} config: {_one_line(e)}") from e
    else:
        model = _load(kind, model_cls, folder, overrides, tie_embeddings, attn)
    _check_supported(kind, model.config)
    return model


def split_blocks(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """Blocks wrapping (not copying) ``model``'s submodules, in order, with their names."""
    config = model.config
    if config.model_type == "gpt2":
        body = model.transformer
        blocks = [GPT2Embeddings(body.wte, body.wpe, body.drop)]
        blocks += [GPT2Layer(layer, config) for layer in body.h]
        blocks.append(GPT2Head(body.ln_f, model.lm_head))
    elif config.model_type == "bert":
        blocks = [BertEmbeddingsBlock(model.bert.embeddings)]
        blocks += [BertLayerBlock(layer, config) for layer in model.bert.encoder.layer]
        blocks.append(BertHead(model.cls.predictions))
    else:
        raise ValueError(f"model.arch: cannot split a {config.model_type!r} model into blocks")
    names = ["embeddings"] + [f"layer{i}" for i in range(len(blocks) - 2)] + ["head"]
    return blocks, names


def _fresh_config(kind: str, overrides: dict, tie_embeddings: bool) -> dict:
    """Config keyword arguments: the overrides, the tying asked for, no KV cache.

    GPT-2's default bos/eos id (50256) lies outside a smaller vocabulary, which HF warns about on every
    build; unless the overrides set them, they are dropped then (training never uses them).
    """
    kwargs = {**overrides, "tie_word_embeddings": tie_embeddings, "use_cache": False}
    if kind == "gpt2" and kwargs.get("vocab_size", 50257) <= 50256:
        kwargs.setdefault("bos_token_id", None)
        kwargs.setdefault("eos_token_id", None)
    return kwargs


def _check_keys(kind: str, config_cls: type, overrides: dict) -> None:
    """Refuse override keys the config does not know: HF would keep them as inert extra attributes, so a
    typo (``n_layers`` for ``n_layer``) would silently build the default 12-layer model."""
    default = config_cls()
    unknown = sorted(key for key in overrides if not hasattr(default, key))
    if unknown:
        raise ValueError(f"model.hf: {config_cls.__name__} has no key {', '.join(map(repr, unknown))}")


def _check_pretrained(kind: str, pretrained: str) -> Path:
    """The folder, once it is known to hold a saved config of model ``kind`` (read without transformers)."""
    folder = Path(pretrained).expanduser()
    if not folder.is_dir():
        raise ValueError(f"model.pretrained: {pretrained} is not a folder (expected one written by "
                         f"save_pretrained; models are never downloaded)")
    model_type = saved_type(folder, "model.pretrained")
    if model_type != kind:
        raise ValueError(f"model.pretrained: {pretrained} holds a {model_type!r} model, not {kind!r}")
    return folder


def saved_type(folder: Path, key: str = "model") -> Any:
    """The ``model_type`` of the config that ``save_pretrained`` wrote in ``folder``."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{key}: {folder} has no config.json (expected a folder written by "
                         f"save_pretrained)")
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{key}: cannot read {config_file}: {e}") from None


def _load(kind: str, model_cls: type, folder: Path, overrides: dict, tie_embeddings: bool,
          attn: str) -> nn.Module:
    """``model_cls`` loaded from ``folder`` with its saved tying, then untied if asked (see build_model)."""
    dropout = {key: overrides[key] for key in DROPOUT_KEYS[kind] if key in overrides}
    if torch.empty(0).is_meta:  # shapes only (the launcher's checks): the saved config, no weights
        # model_cls: a transformers model class, typed ``type`` (transformers is imported lazily)
        config = model_cls.config_class.from_pretrained(  # type: ignore[attr-defined]
            str(folder), local_files_only=True, use_cache=False, **dropout)
        config._attn_implementation = attn
        model, info = model_cls(config), {"missing_keys": ()}
    else:
        model, info = model_cls.from_pretrained(  # type: ignore[attr-defined]  # as above
            str(folder), local_files_only=True, output_loading_info=True,
            attn_implementation=attn, use_cache=False, **dropout)
    config = model.config
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"]))
        raise ValueError(f"model.pretrained: {folder} lacks weights of {model_cls.__name__} ({missing}): "
                         f"was it saved from another model class?")
    if "vocab_size" in overrides and overrides["vocab_size"] != config.vocab_size:
        raise ValueError(f"model.pretrained: {folder} has vocab_size {config.vocab_size}, not the "
                         f"{overrides['vocab_size']} asked for")
    positions = POSITIONS_KEY[kind]
    if positions in overrides and overrides[positions] > getattr(config, positions):
        raise ValueError(f"model.pretrained: {folder} has {positions} {getattr(config, positions)}, "
                         f"fewer than the {overrides[positions]} asked for")
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output.weight is embedding.weight
    if tie_embeddings and not tied:
        raise ValueError(f"model.pretrained: {folder} was saved with untied word embeddings; load it with "
                         f"tie_embeddings off, or its trained output weights would be dropped")
    if not tie_embeddings and tied:
        # Loading with tie_word_embeddings=False would leave the output weight, which a tied checkpoint
        # does not store, randomly initialized: untie by copying the trained embedding instead. BERT's
        # decoder bias is tied (to ``predictions.bias``) only along with the weight: untie it too, as in a
        # fresh untied model, or save_pretrained would drop it.
        output.weight = nn.Parameter(embedding.weight.detach().clone())
        if output.bias is not None:
            output.bias = nn.Parameter(output.bias.detach().clone())
        config.tie_word_embeddings = False
    return model


def _check_supported(kind: str, config: Any) -> None:
    """The blocks pass no encoder states and build BERT's mask bidirectionally: refuse what that breaks."""
    if getattr(config, "add_cross_attention", False) or (kind == "bert" and config.is_decoder):
        raise ValueError(f"model.arch: {kind} blocks support only the plain model (no is_decoder, "
                         f"no add_cross_attention)")


def _import_hf(kind: str) -> tuple[type, type]:
    """(config class, model class) of ``kind``, or an ImportError whose message starts with the config key."""
    names = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "bert": ("BertConfig", "BertForMaskedLM")}[kind]
    try:
        import transformers
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise ImportError(f"model.arch: {kind} needs Hugging Face transformers, whose import failed: "
                              f"{e}") from e
        raise ImportError(f"model.arch: {kind} needs Hugging Face transformers: "
                          f"pip install -e '.[hf]'") from e
    try:
        # transformers imports its model code lazily, on first attribute access: this is where a
        # torchvision built for another torch breaks it.
        return tuple(getattr(transformers, name) for name in names)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]  # the rest is a traceback
        if _involves_torchvision(e):
            raise ImportError(f"model.arch: {kind}: importing Hugging Face transformers' models failed in "
                              f"torchvision, which does not match the installed torch ({first_line}); "
                              f"pip uninstall torchvision") from e
        raise ImportError(f"model.arch: {kind}: importing Hugging Face transformers' models failed: "
                          f"{first_line}") from e


def _one_line(error: BaseException) -> str:
    """The error's message on one line, for a one-line CLI error."""
    return " ".join(str(error).split()) or type(error).__name__


def _involves_torchvision(error: BaseException) -> bool:
    """Whether torchvision appears in the message or traceback of ``error`` or of any error behind it."""
    seen = set()
    link: BaseException | None = error  # the error, then each one behind it
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if "torchvision" in str(link) or any("torchvision" in frame.filename for frame
                                              in traceback.extract_tb(link.__traceback__)):
            return True
        link = link.__cause__ or link.__context__
    return False


def load_pretrained(folder: Path) -> nn.Module:
    """A model written by ``save_pretrained`` (an export), loaded as transformers' users load it
    (the class its config names, nothing downloaded); every weight must be there and nothing else."""
    folder = Path(folder)
    kind = saved_type(folder)
    if kind not in KINDS:
        raise ValueError(f"model: {folder} holds a {kind!r} model, not one of {', '.join(KINDS)}")
    _, model_cls = _import_hf(kind)
    # model_cls: a transformers model class, typed ``type`` (transformers is imported lazily)
    model, info = model_cls.from_pretrained(  # type: ignore[attr-defined]
        str(folder), local_files_only=True, output_loading_info=True,
        attn_implementation=ATTN_IMPLEMENTATION)
    wrong = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    if wrong:
        raise ValueError(f"{folder}: transformers loads it with missing or unexpected weights "
                         f"({', '.join(wrong[:4])})")
    return model
