"""Group weight averaging with real processes: symmetric, weight-preserving, and trained end to end."""

from __future__ import annotations

import datetime
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from conftest import metrics, sdpipe
from sdpipe_cli.config import Config
from sdpipe_cli.sync import GroupCache, average_parameters
from sdpipe_cli.worker import build_stage_module

pytestmark = pytest.mark.multiprocess

WORLD = 4
ROUNDS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random_groups(seed: int) -> list[list[list[int]]]:
    """The same random partitions into groups on every rank (like the scheduler's decisions)."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(ROUNDS):
        ranks = list(range(WORLD))
        rng.shuffle(ranks)
        cuts = sorted(rng.sample(range(1, WORLD), rng.randint(0, WORLD - 1)))
        edges = [0, *cuts, WORLD]
        rounds.append([sorted(ranks[a:b]) for a, b in zip(edges, edges[1:])])
    return rounds


def _averaging_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(100 + rank)
    module = torch.nn.Linear(5, 3)
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 60)
    log = []
    for round_groups in _random_groups(7):
        group = next(g for g in round_groups if rank in g)
        if len(group) > 1:
            average_parameters(module, groups, group)
        flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        log.append(torch.stack(gathered))
    results[rank] = torch.stack(log)
    dist.destroy_process_group()


def test_group_averaging_is_symmetric_and_preserves_the_mean():
    """Members of a group end equal; the mean over all replicas never moves (W_k doubly stochastic)."""
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_averaging_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "averaging processes hung"
    assert all(p.exitcode == 0 for p in procs)
    history = results[0]  # rounds x WORLD x params, as seen by rank 0
    initial = []
    for r in range(WORLD):
        torch.manual_seed(100 + r)
        initial.append(torch.nn.utils.parameters_to_vector(torch.nn.Linear(5, 3).parameters()))
    mean0 = torch.stack(initial).detach().mean(0)
    for k, round_groups in enumerate(_random_groups(7)):
        state = history[k]
        torch.testing.assert_close(state.mean(0), mean0, rtol=0, atol=1e-6)
        for group in round_groups:
            for member in group[1:]:
                assert torch.equal(state[member], state[group[0]])


def _fresh_stages(run_dir) -> dict[int, torch.nn.Module]:
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))
    return {s: build_stage_module(cfg, s) for s in range(cfg.pipeline.stages)}


def test_lr_zero_changes_nothing_anywhere(run_dir):
    """With lr = 0 only averaging acts, and averaging equal replicas must give them back
    (up to float32 rounding of the sum: 3x/3 need not be x to the last bit)."""
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "train.lr=0", "train.steps=10",
                 "model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
                 "run.save_final=true")
    assert out.returncode == 0, out.stderr
    fresh = _fresh_stages(run_dir)
    sizes = {g["size"] for g in metrics(run_dir, "group")}
    assert 3 in sizes  # the final global sync, at least
    files = sorted((run_dir / "final").glob("*.pt"))
    assert len(files) == 6
    for path in files:
        stage = int(path.stem.split("-s")[1])
        saved = torch.load(path, weights_only=True)
        for name, value in fresh[stage].state_dict().items():
            torch.testing.assert_close(saved[name], value, rtol=1e-6, atol=1e-7)


def _final_val(run_dir) -> float:
    evals = metrics(run_dir, "eval")
    last = {}
    for e in evals:
        last[e["pipeline"]] = e["val_loss"]
    return sum(last.values()) / len(last)


def test_four_pipelines_two_stages_converge_like_allreduce(tmp_path):
    """P = 4, S = 2: sdpipe's loss falls as all-reduce's does, and the global sync at the end
    leaves every replica of a stage identical."""
    common = ("model=mlp", "data=synthetic", "cluster.pipelines=4", "pipeline.stages=2",
              "train.steps=30", "train.batch_size=8", "train.eval_every=0")
    runs = {}
    for sync in ("sdpipe", "allreduce"):
        run_dir = tmp_path / sync
        out = sdpipe("train", f"run.dir={run_dir}", f"sync={sync}", *common)
        assert out.returncode == 0, out.stderr
        runs[sync] = run_dir
    first = [m["loss"] for m in metrics(runs["sdpipe"], "train") if m["step"] == 1]
    val = {sync: _final_val(d) for sync, d in runs.items()}
    assert val["sdpipe"] < min(first) - 1.0
    assert val["sdpipe"] < val["allreduce"] * 1.1, val
    done = metrics(runs["sdpipe"], "done")
    for stage in (0, 1):
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 4 * 30
    sizes = [g["size"] for g in metrics(runs["sdpipe"], "group")]
    assert sizes and max(sizes) == 4
