"""Hugging Face models as pipeline blocks: exact composition, causality, tying, local loading, backward."""

from __future__ import annotations

import pickle
import subprocess
import sys
import types

import pytest
import torch

from sdpipe_cli.model import hf

pytest.importorskip("transformers")

KINDS = ["gpt2", "bert"]
NO_DROPOUT = {
    "gpt2": {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
}
TINY = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 260, "n_positions": 64},
    "bert": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256,
             "vocab_size": 260, "max_position_embeddings": 64},
}


def tiny(kind: str, dropout: bool = False, **extra) -> dict:
    return {**TINY[kind], **({} if dropout else NO_DROPOUT[kind]), **extra}


def model(kind: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return hf.build_model(kind, tiny(kind, **kwargs.pop("overrides", {})), **kwargs).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(seed))


def compose(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def test_module_imports_without_transformers():
    code = "import sys, sdpipe_cli.model.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_compose_to_the_hf_model_exactly(kind, attn):
    m = model(kind, overrides={"attn_implementation": attn})
    assert m.config._attn_implementation == attn
    blocks, names = hf.split_blocks(m)
    assert names == ["embeddings", "layer0", "layer1", "head"]
    x = tokens()
    with torch.no_grad():
        hidden = blocks[0](x)
        assert hidden.shape == (2, 16, 64)
        for block in blocks[1:-1]:
            hidden = block(hidden)
            assert hidden.shape == (2, 16, 64)
        logits = blocks[-1](hidden)
        expected = m(x).logits
    assert logits.shape == (2, 16, 260)
    assert torch.equal(logits, expected)


def test_build_blocks_default_attention_is_sdpa():
    blocks, names = hf.build_blocks("gpt2", tiny("gpt2"))
    assert blocks[1].config._attn_implementation == hf.ATTN_IMPLEMENTATION == "sdpa"
    assert names[0] == "embeddings" and names[-1] == "head"


@pytest.mark.parametrize("kind", KINDS)
def test_gpt2_is_causal_and_bert_is_not(kind):
    blocks, _ = hf.split_blocks(model(kind))
    x = tokens()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 260
    with torch.no_grad():
        before, after = compose(blocks, x), compose(blocks, y)
    same_prefix = torch.equal(before[:, :-1], after[:, :-1])
    assert same_prefix == (kind == "gpt2")
    assert not torch.equal(before[:, -1], after[:, -1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [True, False])
def test_tied_embeddings_are_one_parameter_object(kind, tie):
    blocks, _ = hf.split_blocks(model(kind, tie_embeddings=tie))
    first = dict(blocks[0].named_parameters())
    last = dict(blocks[-1].named_parameters())
    if kind == "gpt2":
        embedding, output = first["wte.weight"], last["lm_head.weight"]
    else:
        embedding, output = first["embeddings.word_embeddings.weight"], last["predictions.decoder.weight"]
    assert (embedding is output) == tie
    shared = {id(p) for p in first.values()} & {id(p) for p in last.values()}
    assert shared == ({id(embedding)} if tie else set())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [True, False])
def test_backward_reaches_every_block(kind, tie):
    torch.manual_seed(0)
    blocks, _ = hf.build_blocks(kind, tiny(kind, dropout=True), tie_embeddings=tie)
    for block in blocks:
        block.train()
    x = tokens()
    logits = compose(blocks, x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    for block in blocks:
        for name, p in block.named_parameters():
            # Untied, HF's BertLMPredictionHead keeps a `bias` its decoder (with its own bias) never uses.
            if kind == "bert" and not tie and name == "predictions.bias":
                assert p.grad is None
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_survive_pickling(kind):
    """A stage may live in another process: each block is self-contained."""
    blocks, _ = hf.split_blocks(model(kind))
    x = tokens()
    with torch.no_grad():
        hidden = blocks[0](x)
        for block in blocks[1:]:
            assert torch.equal(pickle.loads(pickle.dumps(block))(hidden), block(hidden))
            hidden = block(hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_pretrained_folder_round_trip(kind, tmp_path):
    saved = model(kind, seed=3)
    saved.save_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        expected = saved(x).logits
        # The saved config decides the architecture: other overrides than vocab_size are ignored.
        blocks, _ = hf.build_blocks(kind, {**NO_DROPOUT[kind], "vocab_size": 260}, pretrained=str(tmp_path))
        assert torch.equal(compose([b.eval() for b in blocks], x), expected)
        untied, _ = hf.build_blocks(kind, NO_DROPOUT[kind], pretrained=tmp_path, tie_embeddings=False)
        assert torch.equal(compose([b.eval() for b in untied], x), expected)
    head = dict(untied[-1].named_parameters())
    out = head["lm_head.weight" if kind == "gpt2" else "predictions.decoder.weight"]
    assert all(out is not p for p in untied[0].parameters())
    with pytest.raises(ValueError, match="^model.pretrained: .*vocab_size 260"):
        hf.build_blocks(kind, {"vocab_size": 300}, pretrained=tmp_path)


def test_pretrained_errors(tmp_path):
    with pytest.raises(ValueError, match="^model.pretrained: .* is not a folder"):
        hf.build_blocks("gpt2", {}, pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^model.pretrained: .* has no config.json"):
        hf.build_blocks("gpt2", {}, pretrained=str(tmp_path))
    model("bert").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^model.pretrained: .* holds a 'bert' model, not 'gpt2'"):
        hf.build_blocks("gpt2", {}, pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="^model.arch: unknown"):
        hf.build_blocks("llama", {})


def test_unknown_config_key_is_refused():
    """HF would keep a misspelt key as an inert attribute and build its default 12 layers."""
    with pytest.raises(ValueError, match="^model.hf: GPT2Config has no key 'n_layers'"):
        hf.build_blocks("gpt2", {**TINY["gpt2"], "n_layers": 3})


@pytest.mark.parametrize("bad", [{"n_layer": "two"}, {"n_embd": 65}])
def test_invalid_config_is_a_one_line_value_error(bad):
    with pytest.raises(ValueError, match="^model.hf: invalid gpt2 config: ") as err:
        hf.build_blocks("gpt2", {**TINY["gpt2"], **bad})
    assert "\n" not in str(err.value)


def test_missing_transformers_names_the_config_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"^model.arch: gpt2 needs Hugging Face transformers: pip install"):
        hf.build_blocks("gpt2", {})


def test_broken_torchvision_says_to_uninstall_it(monkeypatch):
    def fail(name):
        raise RuntimeError("Failed to import transformers.models.gpt2.modeling_gpt2 because of the following "
                           "error (look up to see its traceback):\noperator torchvision::nms does not exist")

    broken = types.ModuleType("transformers")
    broken.__getattr__ = fail
    monkeypatch.setitem(sys.modules, "transformers", broken)
    with pytest.raises(ImportError, match="^model.arch: bert: .*pip uninstall torchvision"):
        hf.build_blocks("bert", {})
