"""AsyncStage in real processes over gloo: asynchronous 1F1B with weight stashing, two segments.

A four-stage pipeline runs two segments of iterations, updating every stage with plain SGD:
PipeDream (m = 2, iterations 0-3 and 4-5, an update after every backward) and PipeDream-2BW
(m = 4, iterations 0-2 and 3, gradients accumulated over an iteration and one update at its end,
at most two versions). Each worker records the weight version of every forward and backward and
its final weights; the test checks them against

* the pure schedule: every backward uses the version its forward used, which is the number of
  updates before that forward (:func:`stash_versions` for PipeDream), and no stage holds more
  versions than its micro-batches in flight need (S - s; two with 2BW);
* an independent single-process PipeDream: the stages' action lists run in tick order, each
  forward on a deep copy of its stage as it is at that moment, each backward through that copy,
  its gradient applied to the live stage (accumulated over the window). Losses and final weights
  must match.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from sdpipe_cli.core.schedule import async_one_f_one_b, stash_versions, tick_order
from sdpipe_cli.pipeline.async_stage import AsyncStage
from sdpipe_cli.pipeline.executor import Executor
from sdpipe_cli.pipeline.p2p import Control
from tests.helpers import free_port, spawn_and_join

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, MB, SEQ = 32, 8, 2, 3
STAGES = 4
# name: (m, micro-batches per update, versions bound, segments as iterations [start, end))
MODES = {"pipedream": (2, 1, None, [(0, 4), (4, 6)]), "2bw": (4, 4, 2, [(0, 3), (3, 4)])}
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
    x = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (MB, SEQ), generator=g)


def sgd(module, window):
    with torch.no_grad():
        for p in module.parameters():
            p -= LR * p.grad / window
    module.zero_grad(set_to_none=True)


def run_mode(rank, mode, checkpointing=False):
    M, window, versions, segments = MODES[mode]
    lo, hi = bounds(rank)
    module = nn.Sequential(*make_blocks()[lo:hi])
    stage = AsyncStage(Executor(
        module, rank, STAGES, rank - 1 if rank else None, rank + 1 if rank < STAGES - 1 else None,
        (MB, SEQ, WIDTH), torch.device("cpu"), loss_fn, checkpointing=checkpointing), M, versions)
    stage.trace = []
    ends = [end for _, end in segments]
    losses, drained = {}, []

    def decide(k):
        return Control(go=k < ends[-1], step=k, save=False, last=k + 1 in ends)

    def load(k):
        batch = [microbatch(k * M + i) for i in range(M)]
        return ([x for x, _ in batch] if rank == 0 else None,
                [y for _, y in batch] if rank == STAGES - 1 else None)

    def update(j, loss):
        if loss is not None:
            losses[j] = loss
        if (j + 1) % window == 0:
            sgd(module, window)
            stage.stash.changed()

    step = 0
    while True:
        step, control = stage.run_segment(step, decide if rank == 0 else None, load, update)
        if not control.go:
            break
        drained.append(step)
    leftovers = not stage.executor.link.idle or stage.stash.in_flight
    return {"trace": stage.trace, "drained": drained, "losses": losses,
            "peak": stage.stash.peak_versions, "bound": stage.stash.bound, "leftovers": leftovers,
            "weights": {n: p.detach().clone() for n, p in module.named_parameters()}}


def worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=STAGES, timeout=datetime.timedelta(seconds=60))
    try:
        results[rank] = {**{mode: run_mode(rank, mode) for mode in MODES},
                         "pipedream-ckpt": run_mode(rank, "pipedream", checkpointing=True)}
    finally:
        dist.destroy_process_group()


def reference(mode):
    """PipeDream by hand: deep copies as stashes, the tick order of the schedule."""
    M, window, _, segments = MODES[mode]
    blocks = make_blocks()
    live = [nn.Sequential(*blocks[lo:hi]) for lo, hi in map(bounds, range(STAGES))]
    losses = {}
    backwards = [0] * STAGES
    for start, end in segments:
        rows = tick_order(async_one_f_one_b, STAGES, (end - start) * M)
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
                        p_live.grad = p_used.grad if p_live.grad is None else p_live.grad + p_used.grad
                    backwards[s] += 1
                    if backwards[s] % window == 0:
                        sgd(live[s], window)
                    if s > 0:
                        grads[(s, i)] = x.grad
    return losses, [dict(m.named_parameters()) for m in live]


def expected_versions(mode, stage):
    """Each batch id's weight version, and the most versions in flight, from the pure schedule:
    the updates before its forward (one per ``window`` backwards)."""
    M, window, _, segments = MODES[mode]
    versions, peak, updates = {}, 0, 0
    for start, end in segments:
        actions = async_one_f_one_b(STAGES, (end - start) * M, stage)
        per_backward = stash_versions(actions)  # backwards before each forward
        of = {i: updates + b // window for i, b in per_backward.items()}
        in_flight = set()
        for a in actions:
            (in_flight.add if a.kind == "F" else in_flight.discard)(a.microbatch)
            peak = max(peak, len({of[i] for i in in_flight}))
        versions.update({start * M + i: v for i, v in of.items()})
        updates += (end - start) * M // window
    return versions, peak



def test_async_pipeline_stashes_versions_and_matches_pipedream():
    results = mp.get_context("forkserver").Manager().dict()
    spawn_and_join(worker, (free_port(), results), STAGES, JOIN_TIMEOUT_S, "async pipeline")
    for mode, (M, _, bound, segments) in MODES.items():
        ref_losses, ref_weights = reference(mode)
        total = segments[-1][1] * M
        for s in range(STAGES):
            r = results[s][mode]
            tag = f"{mode} stage {s}"
            assert r["drained"] == [end for _, end in segments], tag  # all drain at the same ids
            assert not r["leftovers"], tag
            forward = {j: v for kind, j, v in r["trace"] if kind == "F"}
            backward = {j: v for kind, j, v in r["trace"] if kind == "B"}
            assert forward == backward and sorted(forward) == list(range(total)), tag
            versions, peak = expected_versions(mode, s)
            assert forward == versions, tag
            # As many versions as the micro-batches in flight need, never more than the bound.
            assert r["peak"] == peak == r["bound"] == min(STAGES - s, bound or STAGES), tag
            for name, value in r["weights"].items():
                torch.testing.assert_close(value, ref_weights[s][name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, tag=tag, name=name: f"{tag} {name}: {m}")
        losses = results[STAGES - 1][mode]["losses"]
        assert sorted(losses) == list(range(total)), mode
        for j, loss in losses.items():
            assert loss == pytest.approx(ref_losses[j], rel=1e-5, abs=1e-6), (mode, j)
    # Recomputing each forward in its backward (activation checkpointing) runs the stashed
    # weights again, not the live ones nor anything else: the same losses and weights, exactly.
    assert results[STAGES - 1]["pipedream-ckpt"]["losses"] == results[STAGES - 1]["pipedream"]["losses"]
    for s in range(STAGES):
        for name, value in results[s]["pipedream-ckpt"]["weights"].items():
            assert torch.equal(value, results[s]["pipedream"]["weights"][name]), (s, name)


class AddTwo(nn.Module):
    """h + a + b, all of one shape: autograd returns one tensor as the gradient of a and of b."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(MB, SEQ, WIDTH))
        self.b = nn.Parameter(torch.zeros(MB, SEQ, WIDTH))

    def forward(self, h):
        return h + self.a + self.b


def test_single_stage_accumulates_gradients_that_autograd_returns_shared():
    """In process (S = 1 needs no process group): four micro-batches accumulated into .grad, as
    PipeDream-2BW does, equal one backward of their summed losses, even where autograd hands the
    same tensor to two parameters."""
    torch.manual_seed(0)
    blocks = [nn.Embedding(VOCAB, WIDTH), AddTwo(), nn.Linear(WIDTH, VOCAB)]
    module = nn.Sequential(*blocks)
    reference = copy.deepcopy(module)
    stage = AsyncStage(Executor(module, 0, 1, None, None, (MB, SEQ, WIDTH),
                                torch.device("cpu"), loss_fn), 4, versions=2)
    batch = [microbatch(i) for i in range(4)]
    grads = {}

    def update(j, loss):
        if j == 3:
            grads.update({n: p.grad.clone() for n, p in module.named_parameters()})

    done, control = stage.run_segment(
        0, lambda k: Control(True, k, False, True),
        lambda k: ([x for x, _ in batch], [y for _, y in batch]), update)
    assert done == 1 and control.last
    sum(loss_fn(reference(x), y) for x, y in batch).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
