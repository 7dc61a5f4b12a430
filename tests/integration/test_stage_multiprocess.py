"""FlushedStage in real processes over gloo: a pipelined iteration equals the unsplit model.

One spawn per pipeline depth runs every (schedule, micro-batch count) combination, so process
start-up (importing torch) is paid once. Each worker compares its own stage's loss and
gradients with the whole model run in-process on the whole batch. A hang fails the test after
a timeout instead of blocking the suite.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdpipe_cli.core.schedule import SCHEDULES, Action, get_schedule
from sdpipe_cli.pipeline.stage import FlushedStage
from tests.helpers import free_port, spawn_and_join

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, BATCH, SEQ = 256, 16, 8, 4
MICROBATCHES = (1, 4, 8)
TOL = 1e-5
JOIN_TIMEOUT_S = 120


def make_blocks():
    torch.manual_seed(0)
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
    return [nn.Embedding(VOCAB, WIDTH), *hidden, nn.Linear(WIDTH, VOCAB)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def bounds(num_blocks, stages):
    """Contiguous [lo, hi) block ranges, the first stages taking the remainder."""
    size, extra = divmod(num_blocks, stages)
    edges = [0]
    for s in range(stages):
        edges.append(edges[-1] + size + (s < extra))
    return list(zip(edges, edges[1:]))


def reference():
    """Loss and per-block parameter gradients of the whole model on the whole batch."""
    blocks = make_blocks()
    tokens, targets = make_batch()
    loss = loss_fn(nn.Sequential(*blocks)(tokens), targets)
    loss.backward()
    return loss.item(), [[p.grad.clone() for p in b.parameters()] for b in blocks]


def make_stage(stage, stages, blocks, m, ranks=None, **hooks):
    ranks = ranks if ranks is not None else list(range(stages))
    lo, hi = bounds(len(blocks), stages)[stage]
    return FlushedStage(
        nn.Sequential(*blocks[lo:hi]),
        stage=stage,
        num_stages=stages,
        prev_rank=ranks[stage - 1] if stage > 0 else None,
        next_rank=ranks[stage + 1] if stage < stages - 1 else None,
        boundaries=(BATCH // m, SEQ, WIDTH),
        device=torch.device("cpu"),
        loss_fn=loss_fn,
        **hooks,
    )


def check_iteration(stage, stages, errors):
    """Run every combination on ``stage``; append a line to ``errors`` for each mismatch."""
    ref_loss, ref_grads = reference()
    tokens, targets = make_batch()
    blocks = make_blocks()
    lo, hi = bounds(len(blocks), stages)[stage]
    first, last = stage == 0, stage == stages - 1
    for name in sorted(SCHEDULES):
        for m in MICROBATCHES:
            tag = f"stage {stage}/{stages} {name} m={m}"
            seen, seconds = [], []
            pipe = make_stage(
                stage, stages, blocks, m,
                before_action=lambda a, seen=seen: seen.append(("before", a)),
                on_action=lambda a, sec, seen=seen, seconds=seconds: (seen.append(("after", a)),
                                                                      seconds.append(sec)),
            )
            inputs = list(tokens.chunk(m)) if first else None
            targs = list(targets.chunk(m)) if last else None
            pipe.module.zero_grad(set_to_none=True)
            actions = get_schedule(name)(stages, m, stage)
            loss = pipe.run(actions, inputs, targs)

            expected_hooks = [(when, a) for a in actions for when in ("before", "after")]
            if seen != expected_hooks or min(seconds) < 0:
                errors.append(f"{tag}: hooks saw {seen} {seconds}")
            if last != (loss is not None) or (last and abs(loss - ref_loss) > TOL):
                errors.append(f"{tag}: loss {loss}, expected {ref_loss if last else None}")
            for b in range(lo, hi):
                for p, want in zip(blocks[b].parameters(), ref_grads[b]):
                    if p.grad is None or not torch.allclose(p.grad, want, atol=TOL, rtol=TOL):
                        errors.append(f"{tag}: gradient of block {b} differs")
            if not pipe.executor.link.idle:
                errors.append(f"{tag}: communication left in flight")

            loss = pipe.forward_only(inputs, targs, microbatches=m)
            if last != (loss is not None) or (last and abs(loss - ref_loss) > TOL):
                errors.append(f"{tag}: forward_only loss {loss}, expected {ref_loss}")


def worker(rank, stages, port):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=stages,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        errors = []
        check_iteration(rank, stages, errors)
        assert not errors, "\n".join(errors)
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_matches_single_process(stages):
    spawn_and_join(worker, (stages, free_port()), stages, JOIN_TIMEOUT_S,
                   f"pipeline of {stages} stages")


def test_single_stage_needs_no_process_group():
    assert not dist.is_initialized()
    errors = []
    check_iteration(0, 1, errors)
    assert not errors, "\n".join(errors)


def test_run_rejects_bad_action_lists():
    pipe = make_stage(0, 1, make_blocks(), 2)
    tokens, targets = make_batch()
    data = dict(inputs=list(tokens.chunk(2)), targets=list(targets.chunk(2)))
    for bad in (
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
        [Action("B", 0), Action("F", 0)],
        [Action("F", 0), Action("F", 1), Action("B", 0)],
        [],
    ):
        with pytest.raises(ValueError):
            pipe.run(bad, **data)
    with pytest.raises(ValueError):  # an unknown kind cannot even be made
        Action("X", 0)
    with pytest.raises(ValueError, match="targets"):
        pipe.run(get_schedule("1f1b")(1, 2, 0), inputs=data["inputs"])


def test_wrong_activation_shape_fails_before_sending():
    # Built for one micro-batch (BATCH rows), run with two of BATCH // 2 rows each.
    pipe = make_stage(0, 2, make_blocks(), 1, ranks=[0, 1])
    tokens, _ = make_batch()
    with pytest.raises(RuntimeError, match="must keep its shape"):
        pipe.run(get_schedule("gpipe")(2, 2, 0), inputs=list(tokens.chunk(2)))


def test_constructor_validates_neighbours():
    with pytest.raises(ValueError):
        make_stage(0, 2, make_blocks(), 1, ranks=[None, None])
    with pytest.raises(ValueError):
        FlushedStage(nn.Identity(), 2, 2, 0, None, (1,), torch.device("cpu"), loss_fn)
