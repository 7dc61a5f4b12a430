"""Pipelines taking unequal shares of the global batch (``pipeline.balance=speed``), with real
processes: the weighted all-reduce's arithmetic, and runs under all-reduce and sdpipe."""

from __future__ import annotations

import datetime
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

SHARES = (3, 2, 1)  # each rank's samples, one micro-batch each


def _weighted_worker(rank: int, port: int, results) -> None:
    from sdpipe_cli.core import balance
    from sdpipe_cli.sync.allreduce import AllReduceSync
    from sdpipe_cli.sync.groups import GroupCache

    world = len(SHARES)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    module, x, y = torch.nn.Linear(4, 1), torch.randn(sum(SHARES), 4), torch.randn(sum(SHARES), 1)
    whole = torch.nn.Linear(4, 1)
    whole.load_state_dict(module.state_dict())
    torch.nn.functional.mse_loss(whole(x), y).backward()  # every sample's mean gradient
    start = sum(SHARES[:rank])
    m = SHARES[rank]
    for i in range(start, start + m):  # as the executor: each micro-batch's loss over m
        (torch.nn.functional.mse_loss(module(x[i:i + 1]), y[i:i + 1]) / m).backward()
    sync = AllReduceSync(GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 60),
                         list(range(world)), torch.device("cpu"), balance.shares(SHARES)[rank])
    sync.after_backward(module, 0)
    results[rank] = max((a.grad - b.grad).abs().max().item()
                        for a, b in zip(module.parameters(), whole.parameters()))
    dist.destroy_process_group()


def test_the_weighted_all_reduce_is_the_mean_gradient_of_every_sample():
    ctx = mp.get_context("forkserver")
    results = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_weighted_worker, args=(r, port, results)) for r in range(len(SHARES))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung and [p.exitcode for p in procs] == [0] * len(SHARES)
    assert max(results.values()) < 1e-6, dict(results)


RUN = ("model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
       "cluster.slowdown=[1,1,1.3]", "pipeline.balance=speed", "train.steps=12", "train.eval_every=0",
       "checkpoint.every=6")


@pytest.mark.parametrize("mode", ["allreduce", "sdpipe"])
def test_a_slower_pipeline_takes_fewer_micro_batches_and_counts_by_them(mode, run_dir, tmp_path):
    out = sdpipe("train", f"run.dir={run_dir}", f"sync={mode}", *RUN)
    assert out.returncode == 0, out.stderr
    assert "micro-batches per pipeline [4, 4, 3]" in out.stderr + out.stdout
    train = metrics(run_dir, "train")
    batch = {m["pipeline"]: m["samples"] / m["step"] for m in train}
    assert batch == {0: 8, 1: 8, 2: 6}  # 2 samples a micro-batch, 3 of them on the slow one
    if mode == "allreduce":  # resumed, each pipeline goes on with its own share, bit for bit
        copy = tmp_path / "copy"
        shutil.copytree(run_dir, copy)
        before = len(metrics(copy))
        out = sdpipe("resume", str(copy / "checkpoints" / "step_6"))
        assert out.returncode == 0, out.stderr[-2000:]
        again = {(m["pipeline"], m["step"]): m["loss"] for m in metrics(copy)[before:]
                 if m["kind"] == "train"}
        first = {(m["pipeline"], m["step"]): m["loss"] for m in train}
        assert sorted(again) == [(p, k) for p in range(3) for k in range(7, 13)]
        assert all(again[key] == first[key] for key in again)
    if mode == "sdpipe":  # the rounds that hold the slow pipeline count each member by its samples
        counts = {0: 4, 1: 4, 2: 3}
        rounds = [g for g in metrics(run_dir, "group") if 2 in g["members"] and g["size"] > 1
                  and 0.0 not in g["grad_shares"]]  # (a stale member pulls: it counts nothing)
        assert rounds
        for g in rounds:
            total = sum(counts[p] for p in g["members"])
            assert g["grad_shares"] == pytest.approx([counts[p] / total for p in g["members"]]), g
