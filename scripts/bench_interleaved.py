"""One pipeline's iteration time under 1F1B, interleaved 1F1B and interleaved zero bubble, beside what
each timeline predicts.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_interleaved.py                         # S = 4, m = 8, v = 2, 3 repeats
    python scripts/bench_interleaved.py --chunks 3 --repeats 1  # three chunks a stage
    python scripts/bench_interleaved.py --against-torch --schedule interleaved_zb
    python scripts/bench_interleaved.py --evaluation --forward-ms 10

The claim it checks: with each stage's model cut into ``v`` chunks
(:mod:`sdpipe_cli.core.interleaved`), an iteration takes what its timeline says, ``(S - 1)``
idle actions per stage of ``1 / v`` the length of 1F1B's, so it is shorter than 1F1B's by their
ticks' ratio.

**What runs.** ``S`` gloo processes, one per stage, run the pipeline executors themselves
(:class:`~sdpipe_cli.pipeline.stage.FlushedStage` for 1F1B,
:class:`~sdpipe_cli.pipeline.interleaved_stage.InterleavedStage` for the interleaved schedule) on
a model of ``S x v`` equal pieces: 1F1B's stage ``s`` holds pieces ``s v .. s v + v - 1``, the
interleaved ones' chunk ``c`` piece ``c S + s``. Compute is modelled: an action is padded with a
sleep to ``--forward-ms`` per stage's worth of forward (a chunk's: ``1 / v`` of it), a backward
twice that (interleaved zero bubble's ``B`` and ``W`` half of it each), so that the time is the
schedule's and not this machine's. The schedules take turns
``--repeats`` times, each ``--steps`` iterations after 2; every iteration starts on a barrier.

**Against torch** (``--against-torch``). The same pieces, real compute (no padding; pieces
``--width`` wide), sdpipe's ``InterleavedStage`` against torch's own
``ScheduleInterleaved1F1B`` (``--schedule interleaved_zb``: ``ScheduleInterleavedZeroBubble``)
over one ``PipelineStage`` per chunk (``stage_index`` its virtual stage), each step followed
by AdamW's on every process; the two alternate ``--repeats`` times, ``--steps`` timed steps
after 2, timed on stage 0 between barriers. Its table: ms per step and samples/s, sdpipe over
torch.

**Evaluation** (``--evaluation``). ``InterleavedStage.forward_only``, which runs every stage's
forwards in training's order and waits on its sends at the end, against each micro-batch
through every chunk before the next (what it did before), on pieces whose forward waits
``--forward-ms / v`` as on a device (the forward calls no hook to pad); predicted by
``tick_order`` of each order's forwards, a tick a chunk's forward (pipelined: ``v m + S - 1``).

**What is predicted.** :func:`~sdpipe_cli.core.schedule.tick_order` runs the same action lists
on a clock of one tick per chunk's forward (two per backward, one per ``B`` and per ``W``);
1F1B's actions are ``v`` times as long. An iteration takes ``ticks x forward / v``; transfers
and the barrier are not in it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _runner  # noqa: E402

from sdpipe_cli.core.interleaved import CHUNKED, forward_order, interleaved_1f1b, interleaved_zero_bubble, virtual_stage  # noqa: E402
from sdpipe_cli.core.schedule import Action, Kind, one_f_one_b, tick_order  # noqa: E402
from sdpipe_cli.pipeline.interleaved_stage import InterleavedStage  # noqa: E402
from sdpipe_cli.pipeline.stage import FlushedStage  # noqa: E402

WIDTH, BATCH = 32, 32


def piece(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())


def loss_fn(y, t):
    return ((y - t) ** 2).mean()


def padded(seconds_for):
    """An ``on_action`` hook that sleeps each action up to its modelled seconds."""
    def hook(action, took):
        time.sleep(max(0.0, seconds_for(action) - took))
    return hook


def worker(rank, args, port, out: str):
    torch.set_num_threads(1)
    stages, chunks, m = args.stages, args.chunks, args.microbatches
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=120))
    wrap = dist.new_group(list(range(stages)))
    torch.manual_seed(0)
    pieces = [piece() for _ in range(stages * chunks)]
    forward = args.forward_ms / 1000
    shape = (BATCH // m, WIDTH)
    data = list(torch.randn(BATCH, WIDTH).chunk(m)) if rank == 0 else None
    targets = list(torch.randn(BATCH, WIDTH).chunk(m)) if rank == stages - 1 else None

    def stage_seconds(action):
        return forward * (2 if action.kind is Kind.B else 1)

    def split_seconds(action):  # B and W: half a backward each
        return forward

    flushed = FlushedStage(nn.Sequential(*pieces[rank * chunks:(rank + 1) * chunks]), rank, stages,
                           rank - 1 if rank else None, rank + 1 if rank < stages - 1 else None,
                           shape, torch.device("cpu"), loss_fn, on_action=padded(stage_seconds))
    interleaved = InterleavedStage(
        [pieces[virtual_stage(rank, c, stages)] for c in range(chunks)], rank, stages,
        list(range(stages)), [shape] * chunks, torch.device("cpu"), loss_fn, wrap=wrap,
        on_action=padded(lambda a: stage_seconds(a) / chunks))
    zero_bubble = InterleavedStage(
        [pieces[virtual_stage(rank, c, stages)] for c in range(chunks)], rank, stages,
        list(range(stages)), [shape] * chunks, torch.device("cpu"), loss_fn, wrap=wrap,
        on_action=padded(lambda a: split_seconds(a) / chunks))
    runs = {"1f1b": (flushed, one_f_one_b(stages, m, rank)),
            "interleaved": (interleaved, interleaved_1f1b(chunks)(stages, m, rank)),
            "interleaved_zb": (zero_bubble, interleaved_zero_bubble(chunks)(stages, m, rank))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:  # each first in turn
            pipe, actions = runs[name]
            for k in range(2 + args.steps):
                dist.barrier()
                began = time.perf_counter()
                pipe.run(actions, data, targets)
                took = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if k >= 2:
                    times[name].append(float(took))
    if rank == 0:
        result: dict = {name: statistics.median(t) for name, t in times.items()}
        result["repeats"] = {name: [statistics.median(t[i * args.steps:(i + 1) * args.steps])
                                    for i in range(args.repeats)] for name, t in times.items()}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def peer_worker(rank, args, port, out: str):
    """``--against-torch``: both sides' steps on this stage, timed on stage 0."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    torch.set_num_threads(1)
    stages, chunks, m, width = args.stages, args.chunks, args.microbatches, args.width
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=120))
    wrap = dist.new_group(list(range(stages)))
    torch.manual_seed(0)
    pieces = {side: [piece(width) for _ in range(stages * chunks)] for side in ("sdpipe", "torch")}
    mine = {side: [ps[virtual_stage(rank, c, stages)] for c in range(chunks)]
            for side, ps in pieces.items()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, width, generator=g), torch.randn(args.batch, width, generator=g)
    ours = InterleavedStage(mine["sdpipe"], rank, stages, list(range(stages)),
                            [(args.batch // m, width)] * chunks, torch.device("cpu"), loss_fn,
                            wrap=wrap)
    actions = CHUNKED[args.schedule](chunks)(stages, m, rank)
    peer = ScheduleInterleavedZeroBubble if args.schedule == "interleaved_zb" else ScheduleInterleaved1F1B
    theirs = peer(
        [PipelineStage(module, virtual_stage(rank, c, stages), stages * chunks,
                       torch.device("cpu")) for c, module in enumerate(mine["torch"])],
        n_microbatches=m, loss_fn=loss_fn)
    optimizers = {side: torch.optim.AdamW([p for mod in mods for p in mod.parameters()], lr=1e-3)
                  for side, mods in mine.items()}

    def step(side: str) -> None:
        optimizers[side].zero_grad(set_to_none=True)
        if side == "sdpipe":
            ours.run(actions, list(x.chunk(m)) if rank == 0 else None,
                     list(y.chunk(m)) if rank == stages - 1 else None)
        elif rank == 0:
            theirs.step(x, return_outputs=False)
        elif rank == stages - 1:
            theirs.step(target=y, losses=[], return_outputs=False)
        else:
            theirs.step(return_outputs=False)
        optimizers[side].step()

    times: dict[str, list[float]] = {"sdpipe": [], "torch": []}
    for r in range(args.repeats):
        for side in (("sdpipe", "torch") if r % 2 == 0 else ("torch", "sdpipe")):
            for _ in range(2):
                step(side)
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.steps):
                step(side)
            dist.barrier()
            times[side].append((time.perf_counter() - began) / args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


class Waiting(nn.Module):
    """A piece whose forward waits ``seconds`` as on a device (evaluation calls no hooks)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.inner = seconds, piece()

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def evaluation_worker(rank, args, port, out: str):
    """``--evaluation``: ``InterleavedStage.forward_only`` (pipelined) against each micro-batch
    through every chunk before the next, every send waited on at once."""
    torch.set_num_threads(1)
    stages, chunks, m = args.stages, args.chunks, args.microbatches
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages, timeout=datetime.timedelta(seconds=120))
    wrap = dist.new_group(list(range(stages)))
    pieces = [Waiting(args.forward_ms / 1000 / chunks) for _ in range(stages * chunks)]
    pipe = InterleavedStage([pieces[virtual_stage(rank, c, stages)] for c in range(chunks)], rank,
                            stages, list(range(stages)), [(BATCH // m, WIDTH)] * chunks,
                            torch.device("cpu"), loss_fn, wrap=wrap)
    data, targets = list(torch.randn(BATCH, WIDTH).chunk(m)), list(torch.randn(BATCH, WIDTH).chunk(m))
    x, y = (data if rank == 0 else None), (targets if rank == stages - 1 else None)

    def one_at_a_time():
        for i in range(m):
            for ex in pipe.chunks:
                ex.forward_one(i, x, y)
                ex.link.wait_sends()

    runs = {"pipelined": lambda: pipe.forward_only(x, y, microbatches=m), "one_at_a_time": one_at_a_time}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            for k in range(2 + args.steps):
                dist.barrier()
                began = time.perf_counter()
                runs[name]()
                dist.barrier()
                if k >= 2:
                    times[name].append(time.perf_counter() - began)
    if rank == 0:
        Path(out).write_text(json.dumps({name: statistics.median(t) for name, t in times.items()}))
    dist.destroy_process_group()


def evaluation(args) -> int:
    times = spawned(evaluation_worker, args)
    s, v, m, forward = args.stages, args.chunks, args.microbatches, args.forward_ms
    print(f"evaluation, S={s}, m={m}, v={v}, {forward:g} ms a stage's forward (waited, as on a "
          f"device); ms per evaluation (median), predicted from the pieces' waits")
    print("| order | predicted | measured |")
    print("|---|---|---|")
    orders = {"pipelined": lambda S, m, stage: [Action(Kind.F, i, c) for i, c in forward_order(m, S, v)],
              "one_at_a_time": lambda S, m, stage: [Action(Kind.F, i, c) for i in range(m) for c in range(v)]}
    predicted = {name: len(tick_order(fn, s, m, None, v)[0]) * forward / v for name, fn in orders.items()}
    for name, t in times.items():
        print(f"| {name} | {predicted[name]:.1f} | {t * 1000:.1f} |")
    print(f"pipelined over one at a time: {times['one_at_a_time'] / times['pipelined']:.2f}x")
    return 0


def spawned(fn, args) -> dict:
    """``fn(rank, args, port, out)`` in one process per stage; what stage 0 wrote to ``out``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        port = _runner.free_port()
        mp.start_processes(fn, args=(args, port, str(out)), nprocs=args.stages,
                           start_method="forkserver")
        return json.loads(out.read_text())


def against_torch(args) -> int:
    times = spawned(peer_worker, args)
    print(f"{args.schedule}: S={args.stages}, m={args.microbatches}, v={args.chunks}, batch {args.batch}, pieces "
          f"{args.width} wide, real compute; {args.repeats} repeats of {args.steps} steps")
    print("| side | ms per step (median) | per repeat | samples/s |")
    print("|---|---|---|---|")
    for side in ("sdpipe", "torch"):
        ms = statistics.median(times[side]) * 1000
        each = ", ".join(f"{t * 1000:.1f}" for t in times[side])
        print(f"| {side} | {ms:.1f} | {each} | {args.batch / ms * 1000:.1f} |")
    ratio = statistics.median(times["torch"]) / statistics.median(times["sdpipe"])
    print(f"sdpipe over torch, samples/s: {ratio:.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against-torch", action="store_true",
                        help="real compute, against torch's schedule of the same kind")
    parser.add_argument("--schedule", choices=tuple(CHUNKED), default="interleaved_1f1b",
                        help="--against-torch: which interleaved schedule")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--evaluation", action="store_true",
                        help="the pipelined evaluation against one micro-batch at a time")
    args = parser.parse_args(argv)
    if args.against_torch:
        return against_torch(args)
    if args.evaluation:
        return evaluation(args)
    s, v, m, forward = args.stages, args.chunks, args.microbatches, args.forward_ms
    predicted = {
        "1f1b": len(tick_order(one_f_one_b, s, m, {Kind.B: 2})[0]) * forward,
        "interleaved": len(tick_order(interleaved_1f1b(v), s, m, {Kind.B: 2}, v)[0]) * forward / v,
        "interleaved_zb": len(tick_order(interleaved_zero_bubble(v), s, m, None, v)[0]) * forward / v,
    }
    measured = spawned(worker, args)
    print(f"S={s}, m={m}, v={v}, forward {forward:g} ms a stage (backward twice), "
          f"{args.repeats} repeats of {args.steps} iterations; ms per iteration")
    print("| schedule | predicted | measured (median) | per repeat | of predicted | vs 1F1B |")
    print("|---|---|---|---|---|---|")
    for name in predicted:
        ms = measured[name] * 1000
        each = ", ".join(f"{x * 1000:.1f}" for x in measured["repeats"][name])
        speedup = measured["1f1b"] / measured[name]
        print(f"| {name} | {predicted[name]:.1f} | {ms:.1f} | {each} | "
              f"{predicted[name] / ms:.3f} | {speedup:.3f} "
              f"(predicted {predicted['1f1b'] / predicted[name]:.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
