"""Activation memory per pipeline stage under each flushed schedule: the peak of what a stage
keeps alive while it runs its own action list.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_schedule_memory.py                                  # gpt_tiny, S = 4, m = 8
    python scripts/bench_schedule_memory.py --model gpt2 --seq-len 128      # with the hf extra
    python scripts/bench_schedule_memory.py --stages 2 --microbatches 4      # a smoke test
    python scripts/bench_schedule_memory.py --schedules 1f1b,zb_h1,gpipe,interleaved_1f1b,interleaved_zb --layers 6

The claim it checks: ZB-H1 (``pipeline.schedule=zb_h1``) keeps 1F1B's *peak* activation memory
(the first stage's), while its later stages, which 1F1B lets hold fewer micro-batches
(``S - s``), hold what the deferred weight gradients need for up to ``S``; and how much that is,
measured, against the estimate (``run.memory_check``) which counts whole micro-batches.
Interleaved 1F1B (``--chunks v``): stage ``s`` holds up to ``S - s + (v - 1) S`` micro-batches
of a chunk (``1 / v`` of the stage's blocks) at once; the model is cut into ``v x S`` pieces
for it (``--layers``: enough blocks), and the other schedules run on the same model; interleaved
zero bubble (``interleaved_zb``) up to ``v S`` on every stage, each until its ``W``.

**What runs.** In this process, no training and no other process: the stage modules of the run
the overrides describe (``model=... pipeline.stages=S pipeline.microbatches=m``, the partition
resolved as training resolves it), one real micro-batch of the synthetic data, and each stage's
input made as ``scripts/bench_memory.py`` makes it (the earlier stages' output under no_grad,
received in the wire dtype). Then, for each schedule and stage, the stage's action list
(``core.schedule``) is run in order, each action as the executor runs it: ``F`` the forward
(the loss inside on the last stage); 1F1B's and GPipe's ``B`` the whole backward; ZB-H1's ``B``
``stage_backward_input`` and its ``W`` ``stage_backward_weight`` (torch's split, the executor's).
What a micro-batch's gradient would bring from the next stage is a random tensor of its output's
shape.

**What is measured.** Every tensor autograd saves goes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook that counts its storage (once per
storage, parameters excluded) until the tensor is freed (a ``weakref.finalize`` on it); the
stage's input and output, which the executor keeps until the micro-batch's backward, count the
same way. The figure is the peak of the live bytes over the list. It leaves out what
``bench_memory.py`` leaves out (the allocator, temporaries inside one op, gradient buffers), the
same for every schedule.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
import bench_memory  # noqa: E402  (its stage inputs and forward, the executor's two lines)
from _report import mib  # noqa: E402

from sdpipe_cli.pipeline.executor import SPLIT_BACKWARD  # noqa: E402  (the split the executor runs)


class Live:
    """Bytes of distinct storages alive now, and the most at once."""

    def __init__(self, excluded: set[int]):
        self.excluded, self.count, self.size = excluded, {}, {}
        self.now = self.peak = 0

    def hold(self, t) -> None:
        """Count ``t``'s storage until ``t`` is freed."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.excluded:
            return
        if self.count.get(ptr, 0) == 0:
            self.size[ptr] = t.untyped_storage().nbytes()
            self.now += self.size[ptr]
            self.peak = max(self.peak, self.now)
        self.count[ptr] = self.count.get(ptr, 0) + 1
        weakref.finalize(t, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self.count[ptr] -= 1
        if self.count[ptr] == 0:
            self.now -= self.size.pop(ptr)


def run_stage(chunks, target, loss_fn, actions) -> int:
    """Peak live bytes of one stage running ``actions``; ``chunks[c]``: chunk ``c``'s module, its
    input (every micro-batch gets it) and whether it computes the loss (one chunk: the stage)."""
    import torch

    split = importlib.import_module(SPLIT_BACKWARD)
    params = [[p for p in module.parameters() if p.requires_grad] for module, _, _ in chunks]
    live = Live({p.untyped_storage().data_ptr() for mine in params for p in mine})

    def pack(t):
        live.hold(t)
        return t

    flight: dict[tuple[int, int], tuple] = {}  # (chunk, micro-batch) -> (input, output)
    deferred: dict[tuple[int, int], tuple] = {}  # (chunk, micro-batch) -> what its W needs
    splitting = any(a.kind == "W" for a in actions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for action in actions:
            i, (module, x, last) = action.microbatch, chunks[action.chunk]
            if action.kind == "F":
                xi = bench_memory.as_received(x, None, "cpu")
                y = bench_memory.forward(module, xi, target, loss_fn, last, None, False, "cpu")
                for t in bench_memory.tensors_of(xi) + bench_memory.tensors_of(y):
                    live.hold(t)
                flight[(action.chunk, i)] = (xi, y)
                continue
            if action.kind == "W":
                kind, held = deferred.pop((action.chunk, i))
                if kind == "groups":
                    split.stage_backward_weight(iter(params[action.chunk]), held)
                else:  # the first stage's whole backward
                    torch.autograd.backward(*held)
                del held
                continue
            xi, y = flight.pop((action.chunk, i))
            outputs = [y] if last else [t for t in bench_memory.tensors_of(y) if t.requires_grad]
            grads = None if last else [torch.randn_like(t) for t in outputs]
            if splitting:  # a split backward: B now, W later
                inputs = [t for t in bench_memory.tensors_of(xi) if t.requires_grad]
                if inputs:
                    deferred[(action.chunk, i)] = ("groups", split.stage_backward_input(
                        outputs, grads, inputs, iter(params[action.chunk]))[1])
                else:  # the first stage sends nothing back: its W is the whole backward
                    deferred[(action.chunk, i)] = ("whole", (outputs, grads))
            else:
                torch.autograd.backward(outputs, grads)
            del xi, y, outputs, grads
    for module, _, _ in chunks:
        module.zero_grad(set_to_none=True)
    return live.peak


def measure(args: argparse.Namespace) -> dict:
    """Every schedule's stages on the same model, cut into ``chunks x S`` pieces where a
    schedule interleaves (each piece's input made by the pieces before it)."""
    import copy

    from omegaconf import OmegaConf

    from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES, schedule_of
    from sdpipe_cli.core.schedule import in_flight
    from sdpipe_cli.data import sources
    from sdpipe_cli.model import memory, models

    args.batch, args.steps = args.microbatches * args.microbatch, 1
    cfg = bench_memory.prepared(args)
    S, m, v = args.stages, args.microbatches, args.chunks
    modules = [models.build_stage_module(cfg, s).train() for s in range(S)]
    loss_fn = models.loss_function(cfg.model)
    x, target = bench_memory.microbatch(cfg, args.microbatch)
    inputs = bench_memory.stage_inputs(modules, x, None, "cpu")
    names = args.schedules.split(",")
    if any(name in CHUNKED_SCHEDULES for name in names):
        flat = copy.copy(args)  # the same model in v x S stages: the interleaved run's pieces
        flat.stages = S * v
        pieces_cfg = bench_memory.prepared(flat)
        pieces = [models.build_stage_module(pieces_cfg, k).train() for k in range(S * v)]
        piece_inputs = bench_memory.stage_inputs(pieces, x, None, "cpu")
    example = sources.example(cfg, args.microbatch, device="meta")[0]
    rows = []
    for name in names:
        chunks = v if name in CHUNKED_SCHEDULES else 1
        setting = {"schedule": name, "chunks": chunks}
        if chunks > 1:
            setting["partition"] = list(pieces_cfg.pipeline.partition)
        estimate = memory.estimate(OmegaConf.merge(cfg, {"pipeline": setting}), example)
        for s, module in enumerate(modules):
            actions = schedule_of(name, chunks)(S, m, s)
            held = ([(module, inputs[s], s == S - 1)] if chunks == 1 else
                    [(pieces[c * S + s], piece_inputs[c * S + s], c * S + s == S * v - 1)
                     for c in range(v)])
            peak = run_stage(held, target, loss_fn, actions)
            rows.append({"schedule": name, "stage": s, "in_flight": in_flight(actions),
                         "peak_mb": mib(peak), "estimate_mb": None if estimate is None else
                         mib(estimate[s].activations * estimate[s].in_flight)})
    base = {r["stage"]: r["peak_mb"] for r in rows if r["schedule"] == rows[0]["schedule"]}
    for r in rows:
        r["vs_" + rows[0]["schedule"]] = round(r["peak_mb"] / base[r["stage"]], 3) if base[r["stage"]] else None
    return {"model": args.model, "stages": S, "microbatches": m, "microbatch": args.microbatch,
            "seq_len": args.seq_len, "chunks": v, "rows": rows,
            "max_over_stages": {name: max(r["peak_mb"] for r in rows if r["schedule"] == name)
                                for name in args.schedules.split(",")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=4, help="examples per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--schedules", default="1f1b,zb_h1,gpipe",
                        help="also interleaved_1f1b, interleaved_zb (the model needs chunks x stages blocks: "
                             "--layers)")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks a stage (interleaved_*)")
    parser.add_argument("--layers", type=int, default=None, help="model.n_layers (default: the model's)")
    parser.add_argument("--json", type=Path, default=None)
    _report.add_markdown_option(parser)
    args = parser.parse_args(argv)
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    header = (f"{args.model}, S={args.stages}, m={args.microbatches}, micro-batches of "
              f"{args.microbatch} x {args.seq_len}: each stage's peak of live saved tensors, "
              "input and output (MiB)")
    body = f"{header}\n\n{_report.rows_table(result['rows'])}\n"
    _report.publish(body, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
