"""Byte corpora: the standard library, a user's text, the synthetic chain."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdpipe_cli.config.schema import DataConfig
from sdpipe_cli.data.corpus import Corpus, DataError, check_corpus, load_corpus


def cfg(name: str, **overrides) -> DataConfig:
    return DataConfig(name=name, **{"max_bytes": 20_000, **overrides})


def test_stdlib_is_real_and_deterministic():
    a, b = load_corpus(cfg("stdlib"), seed=0), load_corpus(cfg("stdlib"), seed=1)
    assert a.train.dtype == torch.uint8 and a.train.ndim == 1
    assert len(a.train) + len(a.val) == 20_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert b"def " in bytes(a.train.tolist())


def test_split_takes_validation_from_the_tail():
    corpus = load_corpus(cfg("synthetic", max_bytes=1000, val_fraction=0.1), seed=0)
    assert (len(corpus.train), len(corpus.val)) == (900, 100)
    whole = load_corpus(cfg("synthetic", max_bytes=1000, val_fraction=0.5), seed=0)
    assert torch.equal(torch.cat([corpus.train, corpus.val]), torch.cat([whole.train, whole.val]))


def test_synthetic_is_deterministic_learnable_and_capped():
    a = load_corpus(cfg("synthetic"), seed=3)
    assert torch.equal(a.train, load_corpus(cfg("synthetic"), seed=3).train)
    assert not torch.equal(a.train, load_corpus(cfg("synthetic"), seed=4).train)
    assert len(torch.unique(a.train)) < 256
    big = load_corpus(cfg("synthetic", max_bytes=10**9, val_fraction=0.5), seed=0)
    assert len(big.train) + len(big.val) <= 1_000_000


def test_accepts_dictconfig():
    corpus = load_corpus(OmegaConf.structured(cfg("synthetic")), seed=0)
    assert len(corpus.train) > 0


def test_text_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"!" * 10)
    (tmp_path / "a.txt").write_bytes(b"hello ")
    folder = load_corpus(cfg("text", path=str(tmp_path), val_fraction=0.25), seed=0)
    assert bytes(torch.cat([folder.train, folder.val]).tolist()) == b"hello world" + b"!" * 10
    one = load_corpus(cfg("text", path=str(tmp_path / "a.txt"), max_bytes=4), seed=0)
    assert bytes(torch.cat([one.train, one.val]).tolist()) == b"hell"


def text_path(tmp_path, case: str) -> str | None:
    """The data.path of each broken text setup."""
    if case == "no-path":
        return None
    if case == "nonexistent":
        return str(tmp_path / "missing")
    if case == "empty-folder":
        return str(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    return str(tmp_path / "empty.txt")


@pytest.mark.parametrize("case", ["no-path", "nonexistent", "empty-folder", "empty-file"])
def test_text_errors_name_the_key(tmp_path, case):
    with pytest.raises(DataError) as info:
        load_corpus(cfg("text", path=text_path(tmp_path, case)), seed=0)
    assert info.value.key == "data.path"
    assert str(info.value) == f"data.path: {info.value.reason}"


def test_unreadable_file_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"fine")
    (tmp_path / "b.txt").write_bytes(b"locked")

    def deny(path, *args, **kwargs):
        if str(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied")
        return open(path, *args, **kwargs)

    monkeypatch.setattr("sdpipe_cli.data.corpus.open", deny, raising=False)
    with pytest.raises(DataError, match="Permission denied") as info:
        load_corpus(cfg("text", path=str(tmp_path)), seed=0)
    assert info.value.key == str(tmp_path / "b.txt")


def test_unknown_dataset():
    with pytest.raises(DataError) as info:
        load_corpus(cfg("imagenet"), seed=0)
    assert info.value.key == "data.name"


def test_check_corpus_rejects_tiny_splits():
    zeros = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    corpus = Corpus(train=zeros(100), val=zeros(8))
    check_corpus(corpus, seq_len=7)
    with pytest.raises(DataError, match="too small") as info:
        check_corpus(corpus, seq_len=8)
    assert info.value.key == "data"


# -- what a run records of its data: content, not only sizes ---------------------------------------


def _text_run(path):
    """A config of data=text on ``path``, resolved as the launcher records it."""
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.data import sources

    c = compose(["model=mlp", "data=text", f"data.path={path}", "data.max_bytes=20000"])
    c.data.resolved = sources.resolve(c)
    return c


def test_text_edited_in_place_to_the_same_size_is_other_data(tmp_path):
    from sdpipe_cli.data import sources

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    c = _text_run(corpus)
    assert sources.check_same(sources.open_splits(c), c.data.resolved, "sdpipe eval", "then")
    corpus.write_text(corpus.read_text().replace("e", "q"))  # same size, same sample counts
    with pytest.raises(DataError) as err:
        sources.check_same(sources.open_splits(c), c.data.resolved, "sdpipe eval", "when it trained")
    assert err.value.key == "data.path" and str(corpus) in err.value.reason
    assert "content's SHA-256" in err.value.reason and "samples" not in err.value.reason
    # a run of an older sdpipe recorded sizes only: those are compared, and the caller is told
    old = OmegaConf.to_container(c.data.resolved)
    del old["read"]["sha256"]
    assert sources.check_same(sources.open_splits(c), old, "sdpipe eval", "then") is False
    corpus.write_text("short\n" * 300)
    with pytest.raises(DataError, match="bytes: 1800 here, 13200 then"):
        sources.check_same(sources.open_splits(c), old, "sdpipe eval", "then")


def test_a_sampled_digest_sees_names_sizes_and_the_sampled_blocks(tmp_path):
    from sdpipe_cli.data.sources import SAMPLE_BLOCK, SAMPLE_BLOCKS, sampled_digest

    big = tmp_path / "big.bin"
    data = bytearray(range(256)) * (3 * SAMPLE_BLOCK * SAMPLE_BLOCKS // 256)  # read in part
    big.write_bytes(data)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    before = sampled_digest([big, small], tmp_path)
    data[-1] ^= 1  # in the last block, which is always sampled
    big.write_bytes(data)
    assert sampled_digest([big, small], tmp_path) != before
    data[-1] ^= 1
    big.write_bytes(data)
    assert sampled_digest([big, small], tmp_path) == before
    small.write_bytes(b"x" * 999 + b"y")  # a small file is read whole
    assert sampled_digest([big, small], tmp_path) != before
    small.write_bytes(b"x" * 1000)
    small.rename(tmp_path / "other.bin")
    assert sampled_digest([big, tmp_path / "other.bin"], tmp_path) != before


@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64, 65, 1000, 40_001])
@pytest.mark.parametrize("seed", [0, 7])
def test_the_synthetic_chain_walked_a_run_at_a_time_is_the_chain_walked_byte_by_byte(n, seed):
    """The table walk (several choices a step) gives the bytes of one successor per byte."""
    import torch as t

    from sdpipe_cli.data import corpus

    g = t.Generator().manual_seed(seed)
    alphabet = (32 + t.randperm(95, generator=g)[:5]).tolist()
    successors = t.randint(0, 5, (5 * 3,), generator=g).tolist()  # 3 successors each
    choices = t.randint(0, 3, (n,), generator=g)
    state, expected = 0, bytearray()
    for choice in choices.tolist():
        state = successors[state * 3 + choice]
        expected.append(alphabet[state])
    assert corpus._walk(alphabet, successors, choices) == expected
