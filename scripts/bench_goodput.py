"""Goodput under faults: how much of the fault-free limit a run keeps while workers keep dying.

A 4-pipeline run with one device 3x slower (``cluster.slowdown=[1,1,1,3]``), a random worker
SIGKILLed every ``--period`` seconds from its first train line, compared across the ways a run can
survive that:

- ``limit``: ``sync=none`` without faults: every pipeline at its own pace, nobody waits, nobody
  dies; its summed solo rates (``sdpipe_cli.analysis``'s ``limit``) are the denominator;
- ``sdpipe``: the default sync with ``fault.on_pipeline_loss=restart``: the lost pipeline's
  workers are started again and heal from live replicas while the others train on;
- ``allreduce``: ``sync=allreduce`` with ``fault.on_failure=restart``: the whole run starts again
  from its latest checkpoint (torchrun's ``--max-restarts``), losing the work since;
- with ``--fault-free``, ``sdpipe`` and ``allreduce`` without faults too, to tell what the faults
  cost from what the straggler costs.

Every run checkpoints every ``--checkpoint-every`` iterations (default ``steps / 40``: all-reduce's
restarts roll back to the latest one, and with a checkpoint every ``steps / 10`` a run here lost
every leg's work to the next kill before reaching the next checkpoint, and never finished; the
others pay for checkpointing alike) and evaluates four times. **Goodput** is the run's samples/s
(``analysis.samples_per_s``: each pipeline's samples after its first train line, over the span
from the earliest train line to the latest), so the time spent restarting, healing and redoing
work lost at a rollback counts against it: a rolled-back pipeline's ``samples`` go back with it.
As in ``chaos.py``, no fault is injected once the run has done 90 % of its budget (a loss during
the last global sync is not made good). A killed rank that is not running at its moment (its
run is restarting) is killed as soon as it runs again, within the same period.

    python scripts/bench_goodput.py                              # 3 seeds, 300 steps, 20 s
    python scripts/bench_goodput.py --seeds 0 --steps 120 --period 10 --out /tmp/gp   # a smoke
    python scripts/bench_goodput.py --markdown docs/results/goodput.md

Prints a table per run and the means over seeds, and writes ``OUT/goodput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _report import add_markdown_option, loss, num, rate, rows_table, write_markdown  # noqa: E402
from _runner import start_command, stop  # noqa: E402
from _scenarios import slowdowns  # noqa: E402
from chaos import orphans, pid_of, read_metrics  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

MODES = {
    "limit": ["sync=none"],
    "sdpipe": ["sync=sdpipe", "fault.on_pipeline_loss=restart"],
    "allreduce": ["sync=allreduce", "fault.on_failure=restart"],
}


def overrides(args, mode: str, run_dir: Path, seed: int, faults: bool) -> list[str]:
    """The ``sdpipe train`` overrides of one run (``faults``: it may lose that many workers)."""
    restarts = 10 ** 4 if faults and mode != "limit" else 3
    return [f"run.dir={run_dir}", f"model={args.model}", "data=synthetic",
            f"cluster.pipelines={args.pipelines}", f"pipeline.stages={args.stages}",
            "cluster.slowdown=[" + ",".join(f"{f:g}" for f in slowdowns(
                "straggler", args.pipelines, args.slow)) + "]",
            f"train.steps={args.steps}", f"train.eval_every={max(1, args.steps // 4)}",
            f"cluster.compute_ms={args.compute_ms}", "cluster.device=cpu", f"train.seed={seed}",
            f"checkpoint.every={args.checkpoint_every or max(1, args.steps // 40)}",
            f"fault.max_restarts={restarts}",
            "fault.restart_backoff=0.2", *MODES[mode], *args.extra]


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def punish(run_dir: Path, proc, workers: int, period: float, budget: int,
           rng: random.Random) -> list[dict]:
    """SIGKILL a random worker every ``period`` s from the first train line until the run ends or
    has done 90 % of ``budget`` iterations; what was killed, when (s since the first train line)."""
    killed: list[dict] = []
    while proc.poll() is None and analysis.first_train_time(read_metrics(run_dir)) is None:
        time.sleep(0.05)
    start = time.monotonic()
    tick = 1
    while proc.poll() is None:
        due = start + tick * period
        while proc.poll() is None and time.monotonic() < due:
            time.sleep(0.05)
        done = sum(analysis.iterations(read_metrics(run_dir)).values())
        if proc.poll() is not None or done >= 0.9 * budget:
            break
        rank = rng.randrange(workers)
        while proc.poll() is None and time.monotonic() < due + period:
            pid = pid_of(run_dir, rank)  # a rank being restarted has no live pid: wait for it
            if _alive(pid) and pid not in {k["pid"] for k in killed}:
                os.kill(pid, signal.SIGKILL)
                killed.append({"time": round(time.monotonic() - start, 2), "rank": rank,
                               "pid": pid})
                print(f"  SIGKILL rank {rank} at {killed[-1]['time']:.1f} s", flush=True)
                break
            time.sleep(0.1)
        tick += 1
    return killed


def one_run(args, mode: str, seed: int, faults: bool) -> dict:
    name = f"{mode}{'' if faults or mode == 'limit' else '-fault-free'}_seed{seed}"
    run_dir = args.out / name
    print(f"{name} ...", flush=True)
    started = time.monotonic()
    with open(args.out / f"{name}.log", "w") as log:
        proc = start_command("train", overrides(args, mode, run_dir, seed, faults), log,
                             new_session=True)
        try:
            killed = (punish(run_dir, proc, args.pipelines * args.stages, args.period,
                             args.pipelines * args.steps, random.Random(seed))
                      if faults and mode != "limit" else [])
            rc = proc.wait(timeout=args.timeout)
        except BaseException:
            stop(proc)
            raise
    lines = read_metrics(run_dir)
    restarts = [m for m in lines if m["kind"] == "restart"]
    return {"run": name, "mode": mode, "faults": faults and mode != "limit", "seed": seed,
            "exit": rc, "wall_s": round(time.monotonic() - started, 1),
            "samples_per_s": analysis.samples_per_s(lines),
            "limit": analysis.limit(analysis.solo_rates(lines)) if mode == "limit" else None,
            "final_val": analysis.final_val_loss(lines), "killed": len(killed),
            "restarts": len(restarts), "iterations": sum(analysis.iterations(lines).values()),
            "orphans": orphans(run_dir, [k["pid"] for k in killed])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--period", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--pipelines", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--slow", type=float, default=3.0, help="the last pipeline's slowdown")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--compute-ms", type=float, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="iterations between checkpoints (default: steps / 40)")
    parser.add_argument("--fault-free", action="store_true",
                        help="also sdpipe and all-reduce without faults")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=Path("runs/goodput"))
    parser.add_argument("--extra", nargs="*", default=[])
    add_markdown_option(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:  # seeds outermost: a passing load on the machine hits every mode
        plan = [("limit", False), ("sdpipe", True), ("allreduce", True)]
        if args.fault_free:
            plan += [("sdpipe", False), ("allreduce", False)]
        seed_limit = None
        for mode, faults in plan:
            result = one_run(args, mode, seed, faults)
            seed_limit = result["limit"] if mode == "limit" else seed_limit
            result["of_limit"] = analysis.fraction_of_limit(result["samples_per_s"], seed_limit)
            results.append(result)
            print(f"  exit {result['exit']}, {rate(result['samples_per_s'])} samples/s, "
                  f"{num(result['of_limit'], '.2f')} of the limit, val {loss(result['final_val'])}, "
                  f"{result['killed']} killed, {result['restarts']} restarts", flush=True)
    (args.out / "goodput.json").write_text(json.dumps(results, indent=1))
    per_run = rows_table([{k: r[k] for k in ("run", "exit", "killed", "restarts", "wall_s")}
                          | {"samples/s": rate(r["samples_per_s"]),
                             "of the limit": num(r["of_limit"], ".2f"),
                             "final val": loss(r["final_val"])} for r in results])
    summary = []
    for (mode, faults) in dict.fromkeys((r["mode"], r["faults"]) for r in results):
        rows = [r for r in results if r["mode"] == mode and r["faults"] == faults]
        shares = [r["of_limit"] for r in rows if r["of_limit"] is not None]
        vals = [r["final_val"] for r in rows if r["final_val"] is not None]
        summary.append({"run": mode + (" (faults)" if faults else ""), "seeds": len(rows),
                        "all exit 0": all(r["exit"] == 0 for r in rows),
                        "killed": sum(r["killed"] for r in rows),
                        "of the limit (mean)": num(statistics.mean(shares), ".2f") if shares else "-",
                        "of the limit (min-max)": (f"{min(shares):.2f}-{max(shares):.2f}"
                                                   if shares else "-"),
                        "final val (mean)": loss(statistics.mean(vals)) if vals else "-"})
    body = "Per run:\n\n" + per_run + "\n\nMeans over seeds:\n\n" + rows_table(summary) + "\n"
    print(body)
    if args.markdown:
        write_markdown(args.markdown, body)
    return 0 if all(r["exit"] == 0 and not r["orphans"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
