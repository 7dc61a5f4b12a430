"""What the launcher learns from the data before anything starts, and users' datasets."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.data import sources
from sdpipe_cli.runtime.errors import DataError


def cfg(*overrides: str):
    return compose(list(overrides))


def test_a_byte_corpus_is_described_without_the_stages_reading_it():
    c = cfg("data=synthetic", "model=mlp", "data.max_bytes=20000")
    c.data.resolved = sources.resolve(c)
    seq = c.model.seq_len
    assert c.data.resolved["input"] == {"shape": [seq], "dtype": "int64"}
    assert c.data.resolved["target"] == {"shape": [seq], "dtype": "int64"}
    assert c.data.resolved["train"] == (19000 - 1) // seq
    assert c.data.resolved["read"] == {"bytes": 20000, "sha256": c.data.resolved["read"]["sha256"]}
    x, y = sources.example(c, 3)
    assert x.shape == y.shape == (3, seq) and x.dtype == torch.int64
    assert sources.val_count(c) == c.data.eval_batches == 4
    c.data.eval_batches = None
    assert sources.val_count(c) == c.data.resolved["val"] // c.train.batch_size
    assert sources.workers(c) == 0 and sources.fingerprint(c) == sources.fingerprint(c)


def test_a_checkpoint_of_an_older_record_matches_by_sizes_and_a_content_change_does_not():
    """A record made before content digests were kept has the fingerprint of the sizes alone
    (its resume is told apart from changed data); a change of the content changes the full one."""
    import hashlib
    import json

    c = cfg("data=synthetic", "model=mlp", "data.max_bytes=20000")
    c.data.resolved = sources.resolve(c)
    older = {"bytes": 20000}  # what an older sdpipe recorded of the same data
    assert sources.fingerprint(c, content=False) == hashlib.sha256(
        json.dumps(older, sort_keys=True).encode()).hexdigest()[:16]
    assert sources.fingerprint(c) != sources.fingerprint(c, content=False)
    full = sources.fingerprint(c)
    c.data.resolved.read.sha256 = "0" * 16  # other bytes of the same size
    assert sources.fingerprint(c) != full
    assert sources.fingerprint(c, content=False) == hashlib.sha256(
        json.dumps(older, sort_keys=True).encode()).hexdigest()[:16]


USER = '''
    import torch
    from torch.utils.data import Dataset

    class Squares(Dataset):
        classes = ["even", "odd"]
        def __len__(self):
            return 40
        def __getitem__(self, i):
            return torch.full((2, 4), float(i)), i % 2

    def plain():
        return Squares()

    def pair():
        return Squares(), Squares()

    def nothing(**kw):
        return 42

    def empty(**kw):
        return []

    def sized(size):
        class Sized(Squares):
            def __len__(self):
                return size
            def __getitem__(self, i):
                return torch.full((3, 8, 8), float(i)), i % 2
        return Sized()

    def broken(size):
        raise RuntimeError("no disk")

    class Shuffled(Squares):
        """Its split is drawn from numpy's global RNG, as users' code often does."""
        def __init__(self):
            import numpy
            self.order = numpy.random.permutation(40).tolist()
        def __getitem__(self, i):
            return super().__getitem__(self.order[i])

    def shuffled():
        return Shuffled()

    class Tokens(Dataset):
        def __len__(self):
            return 12
        def __getitem__(self, i):
            return {"input_ids": torch.arange(6) + i, "attention_mask": torch.ones(6, dtype=torch.bool)}, i % 3

    def tokens():
        return Tokens()

    def ragged():
        class Ragged(Squares):
            def __getitem__(self, i):
                return torch.zeros(1 + i % 2), 0
        return Ragged()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_sets.py").write_text(textwrap.dedent(USER))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_sets"
    sys.modules.pop("user_sets", None)


def test_a_users_dataset_is_split_when_it_has_no_validation_set(user_module):
    c = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.plain", "data.val_fraction=0.25")
    splits = sources.open_splits(c)
    assert (len(splits.train), len(splits.val), splits.classes) == (30, 10, 2)
    held = {int(splits.val[i][0][0, 0]) for i in range(10)}
    assert held.isdisjoint(int(splits.train[i][0][0, 0]) for i in range(30))
    record = sources.resolve(c)
    assert record["input"] == {"shape": [2, 4], "dtype": "float32"}
    assert record["target"] == {"shape": [], "dtype": "int64"} and record["classes"] == 2
    c2 = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.pair")
    assert len(sources.open_splits(c2).val) == 40


@pytest.mark.parametrize("fn, words", [("nothing", "map-style"), ("empty", "is empty"),
                                       ("broken", "failed: RuntimeError: no disk"),
                                       ("missing", "cannot import")])
def test_a_bad_users_dataset_is_one_error_naming_the_key(user_module, fn, words):
    c = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.{fn}", "+data.size=3")
    with pytest.raises((DataError, ConfigError)) as info:
        sources.resolve(c)
    assert info.value.key == "data._target_" and words in str(info.value)


def test_a_users_random_split_is_the_same_in_every_process_and_moves_no_rng(user_module):
    import numpy

    c = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.shuffled")
    numpy.random.seed(1)
    torch.manual_seed(1)
    before = numpy.random.rand(), torch.rand(1)
    numpy.random.seed(1)
    torch.manual_seed(1)
    a, b = sources.open_splits(c), sources.open_splits(c)
    assert (numpy.random.rand(), torch.rand(1)) == before  # the training process's draws unmoved
    assert a.train.dataset.order == b.train.dataset.order


def test_dict_inputs_are_described_and_rebuilt_for_every_stage(user_module):
    c = cfg("model=custom", "model._target_=torch.nn.Sequential", "data=custom",
            f"data._target_={user_module}.tokens", "model.num_classes=3", "data.val_fraction=0.25")
    c.data.resolved = sources.resolve(c)
    assert c.data.resolved["input"] == {"dict": {"input_ids": {"shape": [6], "dtype": "int64"},
                                                 "attention_mask": {"shape": [6], "dtype": "bool"}}}
    x, y = sources.example(c, 4)
    assert x["input_ids"].shape == (4, 6) and x["attention_mask"].dtype == torch.bool
    assert y.shape == (4,)


def test_samples_that_cannot_be_batched_are_one_error(user_module):
    from sdpipe_cli.data.loader import Loader
    from sdpipe_cli.data.sampling import Order

    c = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.ragged")
    train = sources.open_splits(c).train
    with pytest.raises(DataError, match="cannot be batched together") as info:
        Loader(train, Order(len(train), 0, 1, 0), 4).get(0)
    assert info.value.key == "data"


def test_a_process_that_sees_other_data_than_the_launcher_stops(user_module):
    from sdpipe_cli.data.feed import Feed

    c = cfg("model=resnet_cifar", "data=custom", f"data._target_={user_module}.plain")
    c.data.resolved = sources.resolve(c)
    Feed(c, 0, 2).close()
    c.data.resolved.train = 31  # as if another node's copy had one sample more
    with pytest.raises(DataError, match="this process reads other data than the run did"):
        Feed(c, 0, 2)


def _batches(feed) -> list:
    out = [feed.batch(step) for step in (1, 2)] + list(feed.validation(2))
    feed.close()
    return [(b.inputs, b.targets) for b in out]


@pytest.mark.parametrize("overrides", [
    ["data=synthetic"], ["data.max_bytes=100000"], ["model=resnet_cifar", "data=digits"],
    ["model=resnet_cifar", "data=custom", "data._target_=user_sets.sized", "+data.size=48",
     "data.val_fraction=0.25"],
])
def test_a_worker_reads_the_same_data_from_its_settings_as_from_the_record(user_module, overrides):
    """A worker's data comes from its typed settings (``config.settings``), not the config
    record: the same batches, validation batches, count, objective and fingerprint, the custom
    set's keyword arguments included."""
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config.schema import objective
    from sdpipe_cli.config.settings import settings_of
    from sdpipe_cli.config.validation import validate
    from sdpipe_cli.data.feed import Feed

    c = cfg(*overrides, "cluster.pipelines=2", "train.batch_size=8")
    validate(c)
    record = prepare(c)[0]
    settings = settings_of(record)
    assert objective(settings) == objective(record) and sources.val_count(settings) == sources.val_count(record)
    assert sources.fingerprint(settings) == sources.fingerprint(record)
    for (xa, ya), (xb, yb) in zip(_batches(Feed(record, 1, 2)), _batches(Feed(settings, 1, 2)), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
