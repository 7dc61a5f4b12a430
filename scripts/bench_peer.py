"""Samples/s of one sdpipe pipeline against torch.distributed.pipelining's own schedule of the same kind.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_peer.py                  # S = 2, m = 4, batch 16: 3 pairs, 30 timed steps
    python scripts/bench_peer.py --stages 4 --microbatches 8 --batch 32
    python scripts/bench_peer.py --model-overrides "model=gpt_tiny model.n_layers=8"
    python scripts/bench_peer.py --schedule zb_h1 --stages 4 --microbatches 8 --batch 32
    python scripts/bench_peer.py --pairs 1 --steps 5 --warmup 2 --out /tmp/bp   # a smoke test

The claim it checks: on one pipeline, sdpipe's flushed schedule is at least as fast as PyTorch's
own: ``--schedule 1f1b`` (the default) against ``Schedule1F1B``, ``--schedule zb_h1`` against
``ScheduleInterleavedZeroBubble`` with one stage per process (torch's zero-bubble schedule, its
backward split into the input's and the weights' gradients as sdpipe's ``zb_h1`` splits it),
``--schedule interleaved_1f1b --chunks v`` against ``ScheduleInterleaved1F1B`` with ``v`` stages
per process (chunk ``c`` of process ``s`` the piece ``c x S + s`` of ``v x S`` uniform pieces, as
sdpipe's ``pipeline.chunks`` cuts them), and ``--schedule interleaved_zb --chunks v`` against
``ScheduleInterleavedZeroBubble`` with the same ``v`` stages per process.

**What runs.** Both sides train the project's byte-level GPT blocks
(``sdpipe_cli.model.bytes_lm.build_blocks``) from one composed config (``--model-overrides`` plus
the pipeline and training keys below, composed once with ``sdpipe_cli.config.composition.compose``),
seeded with ``train.seed`` before the build, cut into ``--stages`` contiguous stages by the
uniform partition (``core.partition.resolve("uniform", ...)``), on CPU with gloo, one process
per stage and one intra-op thread per process (``OMP_NUM_THREADS=1``, as sdpipe's CPU workers):

* **sdpipe**: ``sdpipe train sync=allreduce cluster.pipelines=1 pipeline.stages=S
  pipeline.schedule=SCHEDULE pipeline.microbatches=m train.batch_size=B train.grad_clip=0 train.warmup=0
  train.schedule=constant data=synthetic cluster.device=cpu``, ``--warmup + --steps`` iterations.
* **torch**: S processes spawned here; each keeps its slice as ``nn.Sequential``, wraps it in
  ``PipelineStage(module, rank, S, device=cpu)`` (shapes inferred from the first micro-batch) and
  runs ``Schedule1F1B(stage, n_microbatches=m, loss_fn=cross_entropy)`` (or
  ``ScheduleInterleavedZeroBubble([stage], ...)``): ``schedule.step(x)`` on
  the first stage, ``schedule.step(target=y, losses=losses)`` on the last, ``schedule.step()`` in
  between, each with ``return_outputs=False`` (sdpipe does not gather the last stage's logits
  either); ``zero_grad`` before and ``optimizer.step()`` after on every stage.

Both use the same optimizer, built by ``sdpipe_cli.model.optim.build_optimizer`` from the same
config (AdamW, lr 3e-3 constant, betas (0.9, 0.95), no weight decay), the same loss
(``sdpipe_cli.model.models.cross_entropy``) and no gradient clipping. Losses agree too: sdpipe
back-propagates ``loss_i / m`` per micro-batch; Schedule1F1B back-propagates each micro-batch's
mean loss and, with its default ``scale_grads=True``, divides the gradients by ``m`` after the
last backward: both are the gradient of the mean over micro-batches of the per-micro-batch mean.
The data differ (sdpipe's synthetic Markov bytes, random bytes ``torch.randint(0, 256, ...)`` on
the torch side): the same shapes and dtypes, so the same compute.

**What is timed.** Steady-state training only, on both sides. torch: ``--warmup`` untimed steps
(they include the schedule's shape inference and the first optimizer step), a barrier, then
``--steps`` steps and a barrier, timed on the first stage: ``steps x batch / elapsed``.
sdpipe: not ``summary.json``'s ``samples_per_s`` (which counts from the end of the first
iteration) but the ``kind: train`` lines of ``metrics.jsonl``, stamped by the last stage at the
end of each iteration in seconds since the run's start: (samples at the last step - samples at
step ``--warmup``) / (time of the last step - time of step ``--warmup``). Start-up (process start,
model build, process groups, stores) and the first ``--warmup`` iterations are thereby excluded
on the sdpipe side exactly as the warm-up is on the torch side.

**Order.** The two sides alternate ``--pairs`` times (sdpipe first in even pairs, torch first
in odd ones), so that a change in the machine's load hits both alike; the figure is the ratio
of the medians, sdpipe over torch (above 1: sdpipe faster). Every run has a time limit
(``--timeout``); a run over it is stopped (SIGTERM, then SIGKILL) and the script fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _runner import free_port, run_command  # noqa: E402

DEFAULT_MODEL = "model=gpt_tiny model.d_model=128 model.n_layers=4 model.d_hidden=512 model.seq_len=64"
GRACE_S = 20.0  # after SIGTERM, before SIGKILL, for the torch side's processes


def shared_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides both sides are built from (the sdpipe side adds ``run.dir``)."""
    return [*shlex.split(args.model_overrides), "data=synthetic", "sync=allreduce",
            "cluster.pipelines=1", f"pipeline.stages={args.stages}",
            f"pipeline.schedule={args.schedule}",
            f"pipeline.chunks={chunks_of(args)}",
            f"pipeline.microbatches={args.microbatches}", f"train.batch_size={args.batch}",
            f"train.steps={args.warmup + args.steps}", "train.eval_every=0", "train.log_every=1",
            "train.grad_clip=0", "train.warmup=0", "train.schedule=constant", "cluster.device=cpu"]


# -- sdpipe ----------------------------------------------------------------------------------------

def sdpipe_side(args: argparse.Namespace) -> float:
    """One ``sdpipe train`` (``_runner.run_command``: past ``--timeout`` it is stopped, SIGTERM
    then SIGKILL, and its workers die with it or are stopped by it); its steady-state rate."""
    run_dir = args.out / f"sdpipe-{time.monotonic_ns()}"
    run = run_command("train", [f"run.dir={run_dir}", *shared_overrides(args)], None, args.timeout)
    if run.timed_out:
        raise SystemExit(f"sdpipe run over {args.timeout} s: {run_dir}")
    if not run.ok:
        raise SystemExit(f"sdpipe run failed ({run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    return steady_rate(run_dir / "metrics.jsonl", args.warmup, args.warmup + args.steps)


def steady_rate(metrics: Path, first: int, last: int) -> float:
    """Samples/s of pipeline 0 between the end of iteration ``first`` and of iteration ``last``:
    its solo rate over those iterations (``sdpipe_cli.analysis``)."""
    from sdpipe_cli import analysis

    lines = analysis.read_metrics(metrics)
    steps = {m["step"] for m in analysis.of_kind(lines, "train") if m["pipeline"] == 0}
    if first not in steps or last not in steps:
        raise SystemExit(f"{metrics}: no train line for step {first} or {last}")
    return analysis.solo_rates(lines, steps=(first, last))[0]


# -- torch.distributed.pipelining --------------------------------------------------------------------

def run_torch(args: argparse.Namespace, cfg_yaml: str) -> float:
    """S spawned processes, one per stage; the first stage's steady-state samples/s."""
    result = args.out / f"torch-{time.monotonic_ns()}.json"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=torch_worker, daemon=True,
                         args=(rank, args.stages, port, cfg_yaml, args.schedule, args.microbatches,
                               args.warmup, args.steps, args.timeout, str(result)))
             for rank in range(args.stages)]
    for p in procs:
        p.start()
    failed = wait_all(procs, time.monotonic() + args.timeout)
    if failed:
        raise SystemExit(f"torch run: {failed}")
    return json.loads(result.read_text())["samples_per_s"]


def wait_all(procs: list, deadline: float) -> str | None:
    """Wait for every process until ``deadline``; on a failure or past it, stop the rest.
    Returns what went wrong, or None."""
    failed = None
    while failed is None and any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            failed = "over the time limit"
        else:
            bad = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            failed = f"stage {bad[0]} exited with {procs[bad[0]].exitcode}" if bad else None
            time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(GRACE_S)
        if p.is_alive():
            p.kill()
        p.join(GRACE_S)
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed is None and bad:
        failed = f"stage {bad[0]} exited with {procs[bad[0]].exitcode}"
    return failed


def torch_worker(rank: int, world: int, port: int, cfg_yaml: str, schedule: str, m: int,
                 warmup: int, steps: int, timeout: float, result: str) -> None:
    """Stage ``rank`` of the torch pipeline; the first stage writes the rate to ``result``."""
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, as sdpipe's launcher sets it
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_yaml)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    try:
        step = make_step(cfg, rank, world, schedule, m)
        for _ in range(warmup):
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        elapsed = time.perf_counter() - start
        if rank == 0:
            rate = steps * int(cfg.train.batch_size) / elapsed
            Path(result).write_text(json.dumps({"samples_per_s": rate, "elapsed_s": elapsed}))
    finally:
        dist.destroy_process_group()


def make_step(cfg, rank: int, world: int, schedule_name: str, m: int):
    """One training iteration of stage ``rank``: schedule.step, then the optimizer's step."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from sdpipe_cli.core.interleaved import stage_blocks
    from sdpipe_cli.core.partition import resolve
    from sdpipe_cli.model.bytes_lm import build_blocks
    from sdpipe_cli.model.models import cross_entropy
    from sdpipe_cli.model.optim import build_optimizer

    torch.manual_seed(int(cfg.train.seed))  # as build_stage_module: every process builds it all
    blocks = build_blocks(cfg.model)
    v = int(cfg.pipeline.chunks)  # interleaved: chunk c of this rank is piece c x world + rank
    held = stage_blocks(resolve("uniform", len(blocks), world * v, None), len(blocks), world)[rank]
    chunks = [nn.Sequential(*blocks[start:stop_]).train() for start, stop_ in held]
    stages = [PipelineStage(chunk, c * world + rank, world * v, device=torch.device("cpu"))
              for c, chunk in enumerate(chunks)]
    if schedule_name in ("zb_h1", "interleaved_zb"):
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=cross_entropy)
    elif schedule_name == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=cross_entropy)
    else:
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=cross_entropy)
    optimizer = build_optimizer([p for chunk in chunks for p in chunk.parameters()], cfg.train)
    shape = (int(cfg.train.batch_size), int(cfg.model.seq_len))
    first, last = rank == 0, rank == world - 1

    def step() -> None:
        inputs = (torch.randint(0, 256, shape),) if first else ()
        target = torch.randint(0, 256, shape) if last else None
        losses: list | None = [] if last else None
        optimizer.zero_grad(set_to_none=True)
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        if last:
            float(torch.stack(losses).detach().mean())  # the iteration's loss, as sdpipe's reports
        optimizer.step()

    return step


# -- main ------------------------------------------------------------------------------------------

INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")


def chunks_of(args: argparse.Namespace) -> int:
    return args.chunks if args.schedule in INTERLEAVED else 1


def check(args: argparse.Namespace) -> None:
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1 (the first step pays set-up)")
    if args.microbatches < args.stages:
        raise SystemExit("--microbatches must be at least --stages (torch's schedules need it)")
    if args.batch % args.microbatches:
        raise SystemExit("--batch must be a multiple of --microbatches")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", choices=("1f1b", "zb_h1", *INTERLEAVED), default="1f1b")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks a stage (interleaved_*)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--model-overrides", default=DEFAULT_MODEL)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-peer"))
    args = parser.parse_args()
    check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    from sdpipe_cli.config.composition import compose

    cfg_yaml = OmegaConf.to_yaml(compose(shared_overrides(args)), resolve=True)
    sdpipe, peer = [], []
    for pair in range(args.pairs):
        if pair % 2 == 0:
            sdpipe.append(sdpipe_side(args))
            peer.append(run_torch(args, cfg_yaml))
        else:
            peer.append(run_torch(args, cfg_yaml))
            sdpipe.append(sdpipe_side(args))
    result = {"schedule": args.schedule, "stages": args.stages, "microbatches": args.microbatches, "batch": args.batch,
              "chunks": chunks_of(args),
              "steps": args.steps, "warmup": args.warmup, "model_overrides": args.model_overrides,
              "samples_per_s_sdpipe": [round(x, 1) for x in sdpipe],
              "samples_per_s_torch": [round(x, 1) for x in peer],
              "median_sdpipe": round(statistics.median(sdpipe), 1),
              "median_torch": round(statistics.median(peer), 1),
              "sdpipe_over_torch": round(statistics.median(sdpipe) / statistics.median(peer), 3)}
    print(json.dumps({"measured": _report.stamp(), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
