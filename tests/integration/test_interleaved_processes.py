"""InterleavedStage in real processes over gloo: an interleaved iteration (v chunks a stage) gives
the unsplit model's loss and gradients, as 1F1B does, and its pipelined evaluation the loss,
with two stages (each the other's neighbour both ways, across the wrap channel) and with four;
and the project's own models (gpt, ResNet-20), trained a few steps on four stages of two
chunks, end with 1F1B's losses and weights.

One spawn per layout runs every (chunks, micro-batches) case, so process start-up is paid once;
a hang fails the test after a timeout instead of blocking the suite.
"""

from __future__ import annotations

import copy
import datetime
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdpipe_cli.core.interleaved import interleaved_1f1b, interleaved_zero_bubble, virtual_stage
from sdpipe_cli.core.partition import stage_ranges, uniform
from sdpipe_cli.core.schedule import Action, Kind, one_f_one_b
from sdpipe_cli.pipeline.interleaved_stage import InterleavedStage
from sdpipe_cli.pipeline.p2p import Directed
from sdpipe_cli.pipeline.stage import FlushedStage
from tests.helpers import free_port, spawn_and_join

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, BATCH, SEQ = 64, 16, 8, 4
BLOCKS = 10  # embedding, 8 hidden, head: up to 8 virtual stages of at least one block
TOL = 1e-5
JOIN_TIMEOUT_S = 120
EVAL_BATCH = 12  # in 3, 6 or 12 micro-batches: groups of 2 or 4 stages, some with a shorter last one
SCHEDULES = (interleaved_1f1b, interleaved_zero_bubble)  # the second splits each backward: B, W


def make_blocks():
    torch.manual_seed(0)
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS - 2)]
    return [nn.Embedding(VOCAB, WIDTH), *hidden, nn.Linear(WIDTH, VOCAB)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batch(size: int = BATCH):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (size, SEQ), generator=g),
            torch.randint(0, VOCAB, (size, SEQ), generator=g))


def pieces(virtual: int) -> list[tuple[int, int]]:
    """The blocks of each virtual stage, [lo, hi), as the partitioner cuts them uniformly."""
    return stage_ranges(uniform(BLOCKS, virtual), BLOCKS)


def reference():
    """The unsplit model's loss on the whole batch and each block's gradients."""
    blocks = make_blocks()
    inputs, targets = make_batch()
    whole = loss_fn(nn.Sequential(*blocks)(inputs), targets)
    whole.backward()
    return whole.item(), [[p.grad.clone() for p in b.parameters()] for b in blocks]


def check(stage, stages, errors, groups):
    group, wrap = groups
    ref_loss, ref_grads = reference()
    tokens, targets = make_batch()
    for chunks, m, schedule in itertools.product(sorted({1, 2, 4 // stages + 1}),  # three chunks
                                                 (stages, 2 * stages), SCHEDULES):  # where they fit
        tag = f"{schedule.__name__} stage {stage}/{stages} v={chunks} m={m}"
        blocks, ranges = make_blocks(), pieces(stages * chunks)
        mine = [ranges[virtual_stage(stage, c, stages)] for c in range(chunks)]
        seen = []
        pipe = InterleavedStage(
            [nn.Sequential(*blocks[lo:hi]) for lo, hi in mine], stage, stages,
            list(range(stages)), [(BATCH // m, SEQ, WIDTH)] * chunks, torch.device("cpu"),
            loss_fn, group=group, wrap=wrap, on_action=lambda a, _, seen=seen: seen.append(a))
        actions = schedule(chunks)(stages, m, stage)
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
    tokens, targets = make_batch(EVAL_BATCH)
    with torch.no_grad():
        ref_loss = loss_fn(nn.Sequential(*make_blocks())(tokens), targets).item()
    # groups of S micro-batches, the last one shorter where m is not a multiple of S
    for chunks, m in itertools.product(sorted({2, 4 // stages + 1}), (3, 6, EVAL_BATCH)):
        tag = f"evaluation stage {stage}/{stages} v={chunks} m={m}"
        blocks, ranges = make_blocks(), pieces(stages * chunks)
        pipe = InterleavedStage(
            [nn.Sequential(*blocks[lo:hi]) for lo, hi in
             (ranges[virtual_stage(stage, c, stages)] for c in range(chunks))], stage, stages,
            list(range(stages)), [(EVAL_BATCH // m, SEQ, WIDTH)] * chunks, torch.device("cpu"),
            loss_fn, group=group, wrap=wrap)
        loss = pipe.forward_only(list(tokens.chunk(m)) if stage == 0 else None,
                                 list(targets.chunk(m)) if stage == stages - 1 else None, microbatches=m)
        last = stage == stages - 1
        if last != (loss is not None) or (last and abs(loss - ref_loss) > TOL):
            errors.append(f"{tag}: loss {loss}, expected {ref_loss if last else None}")
        if not all(ex.link.idle for ex in pipe.chunks):
            errors.append(f"{tag}: communication left in flight")


def worker(rank, stages, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=60))
    try:
        # as the worker makes them: a group for each direction (NCCL's streams), the wrap's too
        everyone = list(range(stages))
        groups = (Directed(None, dist.new_group(everyone)),
                  Directed(dist.new_group(everyone), dist.new_group(everyone)))
        errors: list[str] = []
        check(rank, stages, errors, groups)
        assert not errors, "\n".join(errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stages", [2, 4])
def test_interleaved_pipeline_matches_the_whole_model(stages):
    spawn_and_join(worker, (stages, free_port()), stages, JOIN_TIMEOUT_S,
                   f"interleaved pipeline of {stages} stages")


def test_run_refuses_a_chunk_out_of_order():
    pipe = InterleavedStage([nn.Identity()], 0, 1, [0], [(1,)], torch.device("cpu"), loss_fn)
    data = ([torch.zeros(1)], [torch.zeros(1)])
    with pytest.raises(ValueError, match="comes before"):
        pipe.run([Action(Kind.B, 0), Action(Kind.F, 0)], *data)
    with pytest.raises(ValueError, match="outside"):
        pipe.run([Action(Kind.F, 0), Action(Kind.B, 0), Action(Kind.F, 0, 1)], *data)


def test_chunks_need_two_stages_and_with_two_a_wrap_group():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="two stages or more"):
        InterleavedStage([nn.Identity(), nn.Identity()], 0, 1, [0], [(1,)] * 2, cpu, loss_fn)
    with pytest.raises(ValueError, match="wrap channel needs a process group"):
        InterleavedStage([nn.Identity(), nn.Identity()], 0, 2, [0, 1], [(1,)] * 2, cpu, loss_fn)


# -- the project's own models, over several optimizer steps -----------------------------------------

MODELS = {  # each cut into 8 virtual stages: four stages of two chunks
    "gpt": dict(arch="gpt", vocab_size=256, seq_len=16, d_model=32, n_layers=6, n_heads=2,
                d_hidden=64, dropout=0.0),
    "resnet_cifar": dict(arch="resnet_cifar", num_classes=10),
}
STEPS, MICRO = 3, 4
INTERLEAVED = {"interleaved": interleaved_1f1b, "interleaved_zb": interleaved_zero_bubble}


def model_batch(arch: str, seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    if arch == "gpt":
        tokens = torch.randint(0, 256, (8, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def train_both(stage: int, stages: int, name: str, wrap) -> dict:
    """One layout's run of 1F1B (stage ``s`` holds the model's ``s``-th quarter) and of
    interleaved 1F1B and zero bubble (its chunks the ``s``-th and ``s + 4``-th eighths), each from the same
    initial weights, AdamW, ``STEPS`` steps: this stage's losses and blocks' weights."""
    from omegaconf import OmegaConf

    from sdpipe_cli.config.schema import ModelConfig
    from sdpipe_cli.model import models

    cfg = OmegaConf.create({"model": OmegaConf.structured(ModelConfig(**MODELS[name]))})
    arch = cfg.model.arch
    torch.manual_seed(0)
    blocks = models.build(cfg.model)[0]
    loss_fn = models.loss_function(cfg.model)
    example = model_batch(arch, 0)[0].chunk(MICRO)[0]
    layouts = models.boundaries(cfg, example)  # what leaves each block but the last
    n, chunks = len(blocks), 2

    def pair(lo: int, hi: int):
        return (layouts[lo - 1] if lo else None, layouts[hi - 1] if hi < n else None)

    out: dict = {}
    for kind in ("1f1b", *INTERLEAVED):
        mine = copy.deepcopy(blocks)
        if kind == "1f1b":
            lo, hi = stage_ranges(uniform(n, stages), n)[stage]
            pipe: Any = FlushedStage(nn.Sequential(*mine[lo:hi]), stage, stages,
                                     stage - 1 if stage else None,
                                     stage + 1 if stage < stages - 1 else None, pair(lo, hi),
                                     torch.device("cpu"), loss_fn)
            held, actions = list(range(lo, hi)), one_f_one_b(stages, MICRO, stage)
        else:
            ranges = stage_ranges(uniform(n, stages * chunks), n)
            mine_ranges = [ranges[virtual_stage(stage, c, stages)] for c in range(chunks)]
            pipe = InterleavedStage([nn.Sequential(*mine[lo:hi]) for lo, hi in mine_ranges],
                                    stage, stages, list(range(stages)),
                                    [pair(lo, hi) for lo, hi in mine_ranges], torch.device("cpu"),
                                    loss_fn, wrap=wrap)
            held = [b for lo, hi in mine_ranges for b in range(lo, hi)]
            actions = INTERLEAVED[kind](chunks)(stages, MICRO, stage)
        params = [p for b in held for p in mine[b].parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        losses = []
        x, y = model_batch(arch, 0)  # one batch, learned a little more at each step
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss = pipe.run(actions, list(x.chunk(MICRO)) if stage == 0 else None,
                            list(y.chunk(MICRO)) if stage == stages - 1 else None)
            optimizer.step()
            losses.append(loss)
        out[kind] = {"losses": losses,
                     "blocks": {b: {k: v.clone() for k, v in mine[b].state_dict().items()}
                                for b in held}}
    return out


def model_worker(rank, stages, port, name):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=60))
    try:
        wrap = dist.new_group(list(range(stages)))
        mine = train_both(rank, stages, name, wrap)
        everyone: list = [None] * stages
        dist.all_gather_object(everyone, mine)
        for kind in INTERLEAVED:
            if rank == stages - 1:
                a, b = mine["1f1b"]["losses"], mine[kind]["losses"]
                assert all(abs(x - y) <= 1e-6 for x, y in zip(a, b)), (name, kind, a, b)
                assert a[-1] < a[0], (name, a)  # it trains
            if rank == 0:
                weights = {k: {blk: w for part in everyone for blk, w in part[k]["blocks"].items()}
                           for k in ("1f1b", kind)}
                assert weights["1f1b"].keys() == weights[kind].keys()
                for blk, state in weights["1f1b"].items():
                    for key, value in state.items():
                        other = weights[kind][blk][key]
                        assert torch.allclose(value.float(), other.float(), atol=1e-6, rtol=0), (
                            name, kind, blk, key, (value.float() - other.float()).abs().max())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_project_s_models_train_as_under_1f1b(name):
    """gpt (8 blocks) and ResNet-20 (11, BatchNorm's running statistics among the weights), four
    stages of two chunks, three AdamW steps, interleaved 1F1B and zero bubble: the losses of 1F1B
    to 1e-6 and the same weights."""
    spawn_and_join(model_worker, (4, free_port(), name), 4, JOIN_TIMEOUT_S,
                   f"interleaved {name} on four stages")
