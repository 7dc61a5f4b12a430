"""The training order: disjoint per-pipeline shards, fresh epochs, positions that resume exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.data.sampling import Order, seed_of
from sdpipe_cli.runtime.errors import DataError

sizes = st.tuples(st.integers(1, 400), st.integers(1, 6)).filter(lambda t: t[0] >= t[1])


@settings(max_examples=60, deadline=None)
@given(sizes, st.integers(0, 2**31), st.integers(0, 3))
def test_an_epochs_shards_are_disjoint_equal_and_cover_all_but_the_remainder(nP, seed, epoch):
    n, pipelines = nP
    orders = [Order(n, p, pipelines, seed) for p in range(pipelines)]
    m = orders[0].shard_size
    shards = [[o.index(epoch * m + k) for k in range(m)] for o in orders]
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == m * pipelines == n - n % pipelines
    assert all(0 <= i < n for i in flat)


@settings(max_examples=40, deadline=None)
@given(sizes, st.integers(0, 2**31), st.integers(0, 500), st.integers(1, 40))
def test_a_batch_is_a_function_of_its_position_alone(nP, seed, position, batch):
    n, pipelines = nP
    fresh = Order(n, pipelines - 1, pipelines, seed)
    used = Order(n, pipelines - 1, pipelines, seed)
    used.take(0, 3 * batch)  # another history, another cached epoch
    assert fresh.take(position, batch) == used.take(position, batch)
    stream = used.batches(position, batch)
    assert next(stream) == fresh.take(position, batch)
    assert next(stream) == fresh.take(position + batch, batch)


def test_epochs_reshuffle_and_seeds_differ():
    a = Order(1000, 0, 2, seed=0)
    first, second = a.take(0, 500), a.take(500, 500)
    assert sorted(i for i, _ in first) != [i for i, _ in first]  # shuffled
    assert [i for i, _ in first] != [i for i, _ in second]  # a fresh permutation
    assert set(i for i, _ in first) != set(i for i, _ in second)  # and fresh shards
    assert a.take(0, 10) != Order(1000, 0, 2, seed=1).take(0, 10)
    assert len({k for _, k in a.take(0, 100)}) == 100  # every sample its own transform seed


def test_keys_are_stable_across_processes_and_runs():
    assert seed_of("sample", 0, 1, 2) == seed_of("sample", 0, 1, 2) < 2**63
    assert Order(10, 0, 1, 7).key(3) == seed_of("sample", 7, 0, 3)


def test_too_few_samples_for_the_pipelines_names_the_key():
    with pytest.raises(DataError) as info:
        Order(3, 0, 4, 0)
    assert info.value.key == "cluster.pipelines"
