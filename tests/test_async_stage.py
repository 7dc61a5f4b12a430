"""AsyncStage in real processes over gloo: asynchronous 1F1B with weight stashing, two segments.

A four-stage pipeline runs iterations 0-3 as one segment and 4-5 as another (m = 2), updating
every stage with plain SGD after each backward. Each worker records the weight version of every
forward and backward and its final weights; the test checks them against

* the pure schedule: every backward uses the version its forward used, which is the number of
  updates before that forward (:func:`stash_versions`), and no stage holds more than S - s
  versions (exactly as many as its micro-batches in flight need);
* an independent single-process PipeDream: the stages' action lists run in tick order, each
  forward on a deep copy of its stage as it is at that moment, each backward through that copy,
  its gradient applied to the live stage. Losses and final weights must match.
"""

from __future__ import annotations

import copy
import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from sdpipe_cli.async_stage import AsyncStage, Control
from sdpipe_cli.schedule import async_one_f_one_b, simulate, stash_versions
from sdpipe_cli.stage import PipelineStage

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, MB, SEQ = 32, 8, 2, 3
STAGES, M = 4, 2
SEGMENTS = [(0, 4), (4, 6)]  # iterations [start, end) of each segment; the run stops at 6
LR = 0.5
JOIN_TIMEOUT_S = 120


def make_blocks():
    torch.manual_seed(0)
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
    return [nn.Embedding(VOCAB, WIDTH), *hidden, nn.Linear(WIDTH, VOCAB)]


def bounds(stage):
    return [(0, 2), (2, 3), (3, 5), (5, 6)][stage]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def microbatch(j):
    g = torch.Generator().manual_seed(100 + j)
    return torch.randint(0, VOCAB, (MB, SEQ), generator=g), torch.randint(0, VOCAB, (MB, SEQ), generator=g)


def sgd(module):
    with torch.no_grad():
        for p in module.parameters():
            p -= LR * p.grad
    module.zero_grad(set_to_none=True)


def worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=STAGES, timeout=datetime.timedelta(seconds=60))
    try:
        lo, hi = bounds(rank)
        module = nn.Sequential(*make_blocks()[lo:hi])
        stage = AsyncStage(PipelineStage(
            module, rank, STAGES, rank - 1 if rank else None, rank + 1 if rank < STAGES - 1 else None,
            (MB, SEQ, WIDTH), torch.device("cpu"), loss_fn), M)
        stage.trace = []
        ends = [end for _, end in SEGMENTS]
        losses, drained = {}, []

        def decide(k):
            return Control(go=k < ends[-1], step=k, save=False, last=k + 1 in ends)

        def load(k):
            batch = [microbatch(k * M + i) for i in range(M)]
            return ([x for x, _ in batch] if rank == 0 else None,
                    [y for _, y in batch] if rank == STAGES - 1 else None)

        def update(j, loss):
            sgd(module)
            stage.stash.changed()
            if loss is not None:
                losses[j] = loss

        step = 0
        while True:
            step, control = stage.run_segment(step, decide if rank == 0 else None, load, update)
            if not control.go:
                break
            drained.append(step)
        leftovers = bool(stage._sends) or stage._posted is not None or stage.stash.in_flight
        results[rank] = {"trace": stage.trace, "drained": drained, "losses": losses,
                         "peak": stage.stash.peak_versions, "leftovers": leftovers,
                         "weights": {n: p.detach().clone() for n, p in module.named_parameters()}}
    finally:
        dist.destroy_process_group()


def reference():
    """PipeDream by hand: deep copies as stashes, the tick order of the simulated schedule."""
    blocks = make_blocks()
    live = [nn.Sequential(*blocks[lo:hi]) for lo, hi in map(bounds, range(STAGES))]
    losses = {}
    for start, end in SEGMENTS:
        rows = simulate(async_one_f_one_b, STAGES, (end - start) * M)
        saved = {}  # (stage, i) -> (input, output, the copy of the stage that computed it)
        grads = {}  # (stage, i) -> gradient of that stage's input
        for tick in range(len(rows[0])):
            for s in range(STAGES):
                action = rows[s][tick]
                if action is None:
                    continue
                i, j = action.microbatch, start * M + action.microbatch
                if action.kind == "F":
                    x = microbatch(j)[0] if s == 0 else saved[(s - 1, i)][1].detach().requires_grad_()
                    used = copy.deepcopy(live[s])
                    y = used(x)
                    if s == STAGES - 1:
                        y = loss_fn(y, microbatch(j)[1])
                        losses[j] = float(y.detach())
                    saved[(s, i)] = (x, y, used)
                else:
                    x, y, used = saved.pop((s, i))
                    y.backward(None if s == STAGES - 1 else grads.pop((s + 1, i)))
                    for p_live, p_used in zip(live[s].parameters(), used.parameters()):
                        p_live.grad = p_used.grad
                    sgd(live[s])
                    if s > 0:
                        grads[(s, i)] = x.grad
    return losses, [dict(m.named_parameters()) for m in live]


def peak_versions(stage):
    """The most distinct versions among micro-batches in flight, from the pure schedule."""
    peak = 0
    for start, end in SEGMENTS:
        actions = async_one_f_one_b(STAGES, (end - start) * M, stage)
        versions, in_flight = stash_versions(actions), set()
        for a in actions:
            (in_flight.add if a.kind == "F" else in_flight.discard)(a.microbatch)
            peak = max(peak, len({versions[i] for i in in_flight}))
    return peak


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_async_pipeline_stashes_versions_and_matches_pipedream():
    results = mp.get_context("spawn").Manager().dict()
    ctx = mp.start_processes(worker, args=(free_port(), results), nprocs=STAGES, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"async pipeline hung for {JOIN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    ref_losses, ref_weights = reference()
    total = SEGMENTS[-1][1] * M
    for s in range(STAGES):
        r = results[s]
        assert r["drained"] == [end for _, end in SEGMENTS], s  # every stage drains at 4 and 6
        assert not r["leftovers"], s
        forward = {j: v for kind, j, v in r["trace"] if kind == "F"}
        backward = {j: v for kind, j, v in r["trace"] if kind == "B"}
        assert forward == backward and sorted(forward) == list(range(total)), s
        expected, updates = {}, 0
        for start, end in SEGMENTS:
            for i, v in stash_versions(async_one_f_one_b(STAGES, (end - start) * M, s)).items():
                expected[start * M + i] = updates + v
            updates += (end - start) * M
        assert forward == expected, s
        assert r["peak"] == peak_versions(s) == STAGES - s  # what the micro-batches in flight need
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[s][name], rtol=1e-5, atol=1e-6)
    losses = results[STAGES - 1]["losses"]
    assert sorted(losses) == list(range(total))
    for j, loss in losses.items():
        assert loss == pytest.approx(ref_losses[j], rel=1e-5, abs=1e-6)
