"""The loader: reproducible batches in any process, unreadable samples replaced and named,
the training RNG left alone, background processes that stop."""

from __future__ import annotations

import psutil
import pytest
import torch
from torch.utils.data import Dataset

from sdpipe_cli.data.loader import MAX_BAD_IN_A_ROW, Loader, evaluation_batches
from sdpipe_cli.data.sampling import Order
from sdpipe_cli.runtime.errors import DataError


class Noisy(Dataset):
    """Sample i: (i + a random draw from torch's RNG, i); the indexes in ``bad`` cannot be read."""

    def __init__(self, n: int = 64, bad: frozenset[int] = frozenset()):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.bad:
            raise OSError(f"cannot identify image file 'img{i}.png'")
        return torch.tensor([float(i)]) + torch.rand(1), i

    def describe(self, i: int) -> str:
        return f"img{i}.png"


def batches(loader: Loader, positions) -> list:
    return [loader.get(p) for p in positions]


def same(a, b) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_is_the_same_in_any_process_and_after_a_seek(workers):
    order = lambda: Order(64, 1, 2, seed=3)  # noqa: E731
    reference = batches(Loader(Noisy(), order(), 4), [0, 4, 8, 12])
    loader = Loader(Noisy(), order(), 4, workers=workers)
    try:
        assert all(same(a, b) for a, b in zip(batches(loader, [0, 4, 8, 12]), reference))
        assert same(loader.get(4), reference[1])  # a seek back (a resume) restarts the stream there
        assert same(loader.get(8), reference[2])
    finally:
        loader.close()
    x = reference[0]
    assert x.inputs.shape == (4, 1) and x.targets.dtype == torch.int64
    assert torch.equal(x.inputs.floor().long().squeeze(1), x.targets)  # inputs match their labels
    assert loader.waited_s > 0


def test_the_training_rng_is_left_alone():
    loader = Loader(Noisy(), Order(64, 0, 1, seed=0), 8)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    loader.get(0)
    assert torch.equal(torch.rand(3), expected)


def test_an_unreadable_sample_is_replaced_by_the_next_and_named():
    order = Order(16, 0, 1, seed=0)
    picks = [i for i, _ in order.take(0, 8)]
    broken = frozenset({picks[2]})
    batch = Loader(Noisy(16, broken), Order(16, 0, 1, seed=0), 8).get(0)
    assert batch.bad == [(f"img{picks[2]}.png", f"cannot identify image file 'img{picks[2]}.png'")]
    labels = batch.targets.tolist()
    assert labels[2] == (picks[2] + 1) % 16 and labels[:2] + labels[3:] == picks[:2] + picks[3:]
    # another stage reading the same position agrees, in a background process too
    other = Loader(Noisy(16, broken), Order(16, 0, 1, seed=0), 8, workers=1)
    try:
        assert same(other.get(0), batch)
    finally:
        other.close()


def test_a_broken_data_set_is_one_error_not_a_loop():
    with pytest.raises(DataError, match=f"{MAX_BAD_IN_A_ROW} samples in a row") as info:
        Loader(Noisy(40, frozenset(range(40))), Order(40, 0, 1, seed=0), 4).get(0)
    assert info.value.key == "data" and "img" in str(info.value)


def test_background_processes_stop_on_close():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    loader = Loader(Noisy(), Order(64, 0, 1, seed=0), 4, workers=2)
    loader.get(0)
    assert len({p.pid for p in me.children(recursive=True)} - before) == 2
    loader.close()
    psutil.wait_procs([p for p in me.children(recursive=True) if p.pid not in before], timeout=10)
    assert {p.pid for p in me.children(recursive=True)} - before == set()


def test_validation_batches_are_fixed_and_wrap_a_small_split():
    one = list(evaluation_batches(Noisy(10), 3, 4, seed=0))
    two = list(evaluation_batches(Noisy(10), 3, 4, seed=0, workers=2))
    assert [b.targets.tolist() for b in one] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert all(same(a, b) for a, b in zip(one, two))
    assert torch.equal(one[2].inputs[2:], one[0].inputs[:2])  # a sample's draw depends on it alone


class Labelled(Noisy):
    """Labels 0/1 alternate; ``target(i)`` gives one without reading (as image folders do)."""

    def __getitem__(self, i: int):
        x, _ = super().__getitem__(i)
        return x, i % 2

    def target(self, i: int) -> int:
        return i % 2


def test_a_labels_only_stage_reads_nothing_and_agrees_on_replacements():
    order = Order(16, 0, 1, seed=0)
    picks = [i for i, _ in order.take(0, 8)]
    broken = frozenset({picks[1]})
    first = Loader(Labelled(16, broken), Order(16, 0, 1, seed=0), 8).get(0)
    last = Loader(Labelled(16, broken), Order(16, 0, 1, seed=0), 8, labels_only=True).get(0)
    assert last.inputs is None and last.bad == []  # it read no sample, so met no broken one
    assert torch.equal(first.targets, last.targets)
    # the broken sample was replaced by the next of its own class, two indexes on
    assert first.inputs[1].floor().item() == (picks[1] + 2) % 16
