"""Corpora, sharding and reproducible batches."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdpipe_cli.config.schema import DataConfig
from sdpipe_cli.model.data import (
    Corpus,
    DataError,
    check_corpus,
    load_corpus,
    shard_bounds,
    train_batch,
    val_batches,
)


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

    monkeypatch.setattr("sdpipe_cli.model.data.open", deny, raising=False)
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


def labelled_corpus(num_shards: int, shard_len: int) -> Corpus:
    """Every byte of shard k has value k, so a batch shows which shard it came from."""
    train = torch.arange(num_shards, dtype=torch.uint8).repeat_interleave(shard_len)
    return Corpus(train=train, val=torch.zeros(64, dtype=torch.uint8))


def test_shard_bounds_are_disjoint_equal_parts():
    bounds = [shard_bounds(103, k, 4) for k in range(4)]
    assert bounds == [(0, 25), (25, 50), (50, 75), (75, 100)]
    with pytest.raises(ValueError):
        shard_bounds(103, 4, 4)


def test_each_pipeline_reads_only_its_shard():
    corpus = labelled_corpus(num_shards=3, shard_len=50)
    for shard in range(3):
        for index in range(5):
            x, y = train_batch(corpus, shard, 3, batch_size=8, seq_len=10, seed=0, index=index)
            assert torch.all(x == shard) and torch.all(y == shard)


def test_batches_depend_only_on_seed_shard_index():
    train = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    corpus = Corpus(train=train, val=torch.zeros(0, dtype=torch.uint8))

    def batch(**overrides):
        args = dict(shard=1, num_shards=2, batch_size=4, seq_len=16, seed=0, index=3)
        return train_batch(corpus, **{**args, **overrides})

    x, y = batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert all(torch.equal(a, b) for a, b in zip(batch(), (x, y)))
    assert not torch.equal(batch(index=4)[0], x)
    assert not torch.equal(batch(seed=1)[0], x)
    assert not torch.equal(batch(shard=0)[0], x)


def test_short_shard_says_how_to_fix():
    corpus = labelled_corpus(num_shards=4, shard_len=10)
    with pytest.raises(DataError, match="fewer pipelines") as info:
        train_batch(corpus, 0, 4, batch_size=2, seq_len=10, seed=0, index=0)
    assert info.value.key == "cluster.pipelines"
    train_batch(corpus, 0, 4, batch_size=2, seq_len=9, seed=0, index=0)  # exactly one window fits


def test_val_batches_are_fixed():
    corpus = load_corpus(cfg("synthetic", max_bytes=4000), seed=0)
    a = val_batches(corpus, count=3, batch_size=4, seq_len=16, seed=0)
    b = val_batches(corpus, count=3, batch_size=4, seq_len=16, seed=0)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, 16) and xa.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a[0][0], a[1][0])
