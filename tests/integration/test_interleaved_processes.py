"""InterleavedStage in real processes over gloo: an interleaved iteration (v chunks a stage) gives
the unsplit model's loss and gradients, as 1F1B does, with two stages (each the other's
neighbour both ways, across the wrap channel) and with four.

One spawn per layout runs every (chunks, micro-batches) case, so process start-up is paid once;
a hang fails the test after a timeout instead of blocking the suite.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdpipe_cli.core.interleaved import interleaved_1f1b, virtual_stage
from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.pipeline.interleaved_stage import InterleavedStage
from tests.helpers import free_port, spawn_and_join

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, BATCH, SEQ = 64, 16, 8, 4
BLOCKS = 10  # embedding, 8 hidden, head: up to 8 virtual stages of at least one block
TOL = 1e-5
JOIN_TIMEOUT_S = 120


def make_blocks():
    torch.manual_seed(0)
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS - 2)]
    return [nn.Embedding(VOCAB, WIDTH), *hidden, nn.Linear(WIDTH, VOCAB)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def pieces(virtual: int) -> list[tuple[int, int]]:
    """The blocks of each virtual stage, [lo, hi): the first ones take the remainder."""
    size, extra = divmod(BLOCKS, virtual)
    edges = [0]
    for k in range(virtual):
        edges.append(edges[-1] + size + (k < extra))
    return list(zip(edges, edges[1:]))


def reference():
    blocks = make_blocks()
    tokens, targets = make_batch()
    loss = loss_fn(nn.Sequential(*blocks)(tokens), targets)
    loss.backward()
    return loss.item(), [[p.grad.clone() for p in b.parameters()] for b in blocks]


def check(stage, stages, errors, wrap):
    ref_loss, ref_grads = reference()
    tokens, targets = make_batch()
    for chunks in (1, 2, 4 // stages + 1):
        for m in (stages, 2 * stages):
            tag = f"stage {stage}/{stages} v={chunks} m={m}"
            blocks, ranges = make_blocks(), pieces(stages * chunks)
            mine = [ranges[virtual_stage(stage, c, stages)] for c in range(chunks)]
            seen = []
            pipe = InterleavedStage(
                [nn.Sequential(*blocks[lo:hi]) for lo, hi in mine], stage, stages,
                list(range(stages)), [(BATCH // m, SEQ, WIDTH)] * chunks, torch.device("cpu"),
                loss_fn, wrap=wrap, on_action=lambda a, _, seen=seen: seen.append(a))
            actions = interleaved_1f1b(chunks)(stages, m, stage)
            loss = pipe.run(actions, list(tokens.chunk(m)) if stage == 0 else None,
                            list(targets.chunk(m)) if stage == stages - 1 else None)
            if seen != actions:
                errors.append(f"{tag}: the hooks saw {seen}")
            last = stage == stages - 1
            if last != (loss is not None) or (last and abs(loss - ref_loss) > TOL):
                errors.append(f"{tag}: loss {loss}, expected {ref_loss if last else None}")
            for lo, hi in mine:
                for b in range(lo, hi):
                    for p, want in zip(blocks[b].parameters(), ref_grads[b]):
                        if p.grad is None or not torch.allclose(p.grad, want, atol=TOL, rtol=TOL):
                            errors.append(f"{tag}: gradient of block {b} differs")
            if not all(ex.link.idle for ex in pipe.chunks):
                errors.append(f"{tag}: communication left in flight")


def worker(rank, stages, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=60))
    try:
        wrap = dist.new_group(list(range(stages)))  # the wrap channel: the same processes
        errors: list[str] = []
        check(rank, stages, errors, wrap)
        assert not errors, "\n".join(errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stages", [2, 4])
def test_interleaved_pipeline_matches_the_whole_model(stages):
    spawn_and_join(worker, (stages, free_port()), stages, JOIN_TIMEOUT_S,
                   f"interleaved pipeline of {stages} stages")


def test_run_refuses_a_chunk_out_of_order():
    pipe = InterleavedStage([nn.Identity(), nn.Identity()], 0, 1, [0], [(1,), (1,)],
                            torch.device("cpu"), loss_fn)
    bad = [Action(Kind.F, 0, 1), Action(Kind.F, 0, 0), Action(Kind.B, 0, 1), Action(Kind.B, 0, 0)]
    with pytest.raises(ValueError, match="comes before|must be"):
        pipe.run([Action(Kind.B, 0, 0), *bad[1:]], [torch.zeros(1)], [torch.zeros(1)])
    with pytest.raises(ValueError, match="outside"):
        pipe.run([*bad, Action(Kind.F, 0, 2)], [torch.zeros(1)], [torch.zeros(1)])
