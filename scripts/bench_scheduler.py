"""Load test of the real scheduler process at scale: how long a replica waits for its group
beyond what the policy meant it to wait, and what the scheduler costs in CPU.

    python scripts/bench_scheduler.py                    # 64 pipelines x 4 stages, then 256 x 1
    python scripts/bench_scheduler.py --pipelines 64 --stages 4 --steps 20 --compute-ms 100
        [--processes 4] [--out DIR] [--json PATH] [--markdown PATH] [--profile]

**Why.** Every replica of every stage blocks on the scheduler once per iteration; the transport
(store queue, one Python process, decision keys) must add little to the wait the policy chooses,
or it slows every pipeline. The goal: p99 <= 2 ms at 64 x 4. Unit tests of the policy cannot show
this, so this script runs the real ``python -m sdpipe_cli.sync.scheduler`` with the launcher's
environment, against a TCPStore it hosts (``store.host_store``, 127.0.0.1, a free port), on a run
config composed, validated and prepared as ``sdpipe train`` does (``sync=sdpipe``, P, S, steps).

**Replicas.** No model runs: P x S threads, spread over ``--processes`` processes, each with its
own store connection, speak the workers' protocol: ``start``, then per iteration a modelled
compute time (``--compute-ms``, the last pipeline 3x slower, +-10 % jitter), ``ready``, a blocking
read of the decision key (then deleted), the ``step`` event every worker sends, and a barrier with
the pipeline's other stages (a flushed pipeline goes on when all its stages have their groups);
``done`` after the decision that says ``stop``. The clock starts when the scheduler has seen every
``start`` (its start-up is left out) and ends when it has handled the last ``done``.

**Reported.** Decision latency of one (replica, round): push of ``ready`` to read of the decision,
minus the time the policy held the round open for that member (``waits`` in the scheduler's
``group`` line): queueing behind other events, handling, publishing, store round trips. p50, p99,
max over all rounds. Split in three with the scheduler's own track of the timeline (the run has
``run.trace=true``; every stamp is on the run clock): ``queue`` (the push to the moment the
scheduler took the batch holding the signal from the queue: the replica's send, the store and the
scheduler's wake-up), ``sched`` (that moment to the decision sent to the store, less the policy's
wait: what the scheduler process owns, the events it handled first included) and ``wake`` (sent
to the replica's read: the store's write and the replica's wake-up; stamped before the send, so
that a read can never precede it). Events/s the scheduler handled (ready, step, done). Its CPU
(user + sys, psutil) per second and per decision, and the time its threads were runnable but waiting for
a core (``queued``, from schedstat: on a shared machine, CPU starvation); the replica processes'
CPU; the machine's 1-minute load average when the clock started.
``--profile`` runs the scheduler under cProfile (``queue_pop`` includes idle waiting).

**Cores.** On a machine of a few cores the replicas' 100-odd threads compete with the scheduler
and the store for them, and their interpreter locks delay each other's sends and reads; a real
cluster's workers are processes on other hosts, and the scheduler and the store have cores of
their own. ``--pin`` models that here: the scheduler and this process (which hosts the store) get
the last core, the replica processes the others.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (a sibling script, not a package)
import _scenarios  # noqa: E402

SCENARIOS = ((64, 4), (256, 1))
GOAL_MS, GOAL_AT = 2.0, (64, 4)  # p99 decision latency the project aims for, and where
SLOW, JITTER = 3.0, 0.1  # the last pipeline's slowdown; relative jitter of each compute time
GO = "bench/go"  # set once the scheduler has seen every replica start
COLUMNS = ("P x S", "events/s", "decisions", "mean group", "p50 ms", "p99 ms", "max ms",
           "queue p50/p99", "sched p50/p99", "wake p50/p99", "sched CPU s/s",
           "sched CPU ms/decision", "sched queued s/s", "replicas CPU s/s", "wall s", "load")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", type=int, help="P (with --stages; default: both scenarios)")
    parser.add_argument("--stages", type=int, help="S")
    parser.add_argument("--steps", type=int, default=20, help="train.steps (default: 20)")
    parser.add_argument("--compute-ms", type=float, default=100.0,
                        help="modelled compute of one stage's iteration, ms (default: 100)")
    parser.add_argument("--processes", type=int, default=4, help="replica processes (default: 4)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a scenario (and any store operation) may take")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_scheduler"),
                        help="folder for the run folders (must not exist yet)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to PATH")
    parser.add_argument("--profile", action="store_true", help="cProfile the scheduler")
    parser.add_argument("--pin", action="store_true",
                        help="the scheduler and the store on the last core, replicas on the others")
    _report.add_markdown_option(parser)
    args = parser.parse_args(argv)
    if (args.pipelines is None) != (args.stages is None):
        parser.error("give both --pipelines and --stages, or neither")
    args.cores = sorted(os.sched_getaffinity(0))  # before --pin narrows this process's
    if args.pin and len(args.cores) < 2:
        parser.error("--pin needs at least 2 cores")
    return args


# -- the replicas: threads in spawned processes ----------------------------------------------------
def replica(p: int, s: int, S: int, port: int, compute_s: float, timeout: float,
            barrier: threading.Barrier, records: list) -> None:
    from sdpipe_cli.runtime import protocol, store

    events = store.namespace(store.connect("127.0.0.1", port, timeout))
    who = {"rank": p * S + s, "pipeline": p, "stage": s}
    rng = random.Random(p * S + s)
    t0 = store.run_clock(events)  # the scheduler's timeline is on this clock too

    def clock() -> float:
        return time.time() - t0

    store.push(events, store.EVENTS, protocol.Report("start", **who, time=0.0,
                                                     fields={"pid": os.getpid()}))
    events.wait([GO])
    started, k = clock(), 0
    while True:
        t_step = clock()
        time.sleep(compute_s * rng.uniform(1 - JITTER, 1 + JITTER))
        key = store.decision_key(s, p, k)
        pushed = clock()
        store.push(events, store.EVENTS, protocol.Ready(**who, iteration=k))
        decision = store.take(events, key, protocol.Group)  # blocks until the scheduler decides
        read = clock()
        records.append((s, p, k, pushed, read))
        k += 1
        step = {"step": k, "samples": 16 * k, "samples_per_s": 16 * k / (read - started),
                "lr": 1e-3, "step_s": read - t_step, "compute_s": pushed - t_step,
                "sync_s": read - pushed, "straggled": 0, "group_size": len(decision.members),
                "round": decision.round, "group_kind": decision.kind,
                "wait_s": read - pushed, "comm_s": 0.0, **({"loss": 1.0} if s == S - 1 else {})}
        store.push(events, store.EVENTS, protocol.Report("step", **who, time=read - started,
                                                         fields=step))
        if decision.stop:
            break
        barrier.wait()  # the pipeline's next iteration needs every stage's group
    store.push(events, store.EVENTS, protocol.Report("done", **who, time=clock() - started,
                                                     fields={"steps": k, "samples": 16 * k}))


def replica_process(pipelines: list[int], S: int, slowdown: list[float], port: int,
                    compute_ms: float, timeout: float, out: str) -> None:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # not a warning per connection (no DNS here)
    from sdpipe_cli.runtime import store

    records: list = []
    errors: list[str] = []
    barriers = {p: threading.Barrier(S, timeout=timeout) for p in pipelines}

    def run(p: int, s: int) -> None:
        try:
            replica(p, s, S, port, compute_ms / 1e3 * slowdown[p], timeout, barriers[p], records)
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the run
            errors.append(f"pipeline {p} stage {s}: {type(err).__name__}: {err}")
            barriers[p].abort()

    threads = [threading.Thread(target=run, args=(p, s), daemon=True)
               for p in pipelines for s in range(S)]
    for t in threads:
        t.start()
    store.namespace(store.connect("127.0.0.1", port, timeout)).wait([GO])
    cpu0, deadline = cpu_s(), time.monotonic() + timeout  # the run's CPU, not the start-up's
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    errors += [f"{t.name} still running after {timeout:g} s" for t in threads if t.is_alive()]
    Path(out).write_text(json.dumps({"records": records, "errors": errors, "cpu_s": cpu_s() - cpu0}))
    os._exit(1 if errors else 0)  # a hung thread must not keep the process alive


def cpu_s() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + sys


def queued_s(pid: int) -> float:
    """Seconds the threads of ``pid`` were runnable but waiting for a core (Linux schedstat)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended, or a kernel without schedstat
    return total


# -- one scenario ---------------------------------------------------------------------------------
def write_config(args: argparse.Namespace, P: int, S: int, run_dir: Path) -> Path:
    from sdpipe_cli.cli import preparing
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.run_file import save_run_config
    from sdpipe_cli.config.validation import validate

    cfg = compose(["sync=sdpipe", "model=mlp", "data=synthetic", "cluster.device=cpu",
                   f"cluster.pipelines={P}", f"pipeline.stages={S}", f"train.steps={args.steps}",
                   _scenarios.slowdown(_scenarios.slowdowns("straggler", P, SLOW)),
                   f"run.dir={run_dir.resolve()}",
                   f"run.timeout={args.timeout}", "run.trace=true",
                   f"run.trace_events={4 * P * S * (args.steps + 2)}"])
    validate(cfg)
    cfg, _, _ = preparing.prepare(cfg)
    save_run_config(cfg, run_dir / "config.yaml")
    return run_dir / "config.yaml"


def start_scheduler(run_dir: Path, port: int, world: int, profile: bool) -> subprocess.Popen:
    """The scheduler, as the launcher starts it (environment, own session, dies with us)."""
    from sdpipe_cli.runtime.processes import die_with_parent

    env = {**os.environ, "SDPIPE_RUN_DIR": str(run_dir.resolve()), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1",
           "SDPIPE_CONFIG": str((run_dir / "config.yaml").resolve()), "OMP_NUM_THREADS": "1"}
    wrap = ["-m", "cProfile", "-o", str(run_dir / "scheduler.prof")] if profile else []
    with (run_dir / "logs" / "scheduler.log").open("ab") as log:
        return subprocess.Popen([sys.executable, *wrap, "-m", "sdpipe_cli.sync.scheduler"],
                                env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)


def run_scenario(args: argparse.Namespace, P: int, S: int) -> dict[str, Any]:
    from sdpipe_cli.analysis import read_metrics
    from sdpipe_cli.runtime import store

    run_dir = args.out / f"{P}x{S}"
    (run_dir / "logs").mkdir(parents=True)
    write_config(args, P, S, run_dir)
    master, _ = store.host_store("127.0.0.1", 0, args.timeout)
    events = store.namespace(master)
    events.set(store.T0, repr(time.time()))
    sched = start_scheduler(run_dir, master.port, P * S, args.profile)
    n = max(1, min(args.processes, P))
    outs = [run_dir / f"replicas-{i}.json" for i in range(n)]
    procs = [multiprocessing.get_context("spawn").Process(target=replica_process, daemon=True, args=(
        list(range(i, P, n)), S, _scenarios.slowdowns("straggler", P, SLOW), master.port, args.compute_ms,
        args.timeout, str(out))) for i, out in enumerate(outs)]
    deadline = time.monotonic() + args.timeout

    def check(what: str) -> None:
        if sched.poll() is not None and not (run_dir / "summary.json").exists():
            raise RuntimeError(f"the scheduler exited {what}; see {run_dir}/logs/scheduler.log")
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a replica process failed {what}; see {run_dir}/replicas-*.json")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{P} x {S}: not done {what} within {args.timeout:g} s")
        time.sleep(0.01)

    try:
        for proc in procs:
            proc.start()
        if args.pin:
            os.sched_setaffinity(sched.pid, args.cores[-1:])
            os.sched_setaffinity(0, args.cores[-1:])  # the store's thread
            for proc in procs:
                os.sched_setaffinity(proc.pid, args.cores[:-1])
        while (store.read_progress(events) or {}).get("started", 0) < P * S:
            check("before every replica started")
        def sample() -> tuple[float, float, float]:
            return (time.monotonic(), sum(psutil.Process(sched.pid).cpu_times()[:2]),
                    queued_s(sched.pid))

        first = last = sample()
        load = os.getloadavg()[0]  # the machine's, shared with whatever else runs on it
        events.set(GO, "1")
        # the scheduler writes summary.json right after its loop: the sample before is the end
        while not (run_dir / "summary.json").exists():
            last = sample()
            check("before the end of the run")
        wall, cpu, queued = (b - a for a, b in zip(first, last))
        if sched.wait(max(1.0, deadline - time.monotonic())) != 0:
            raise RuntimeError(f"the scheduler exited {sched.returncode}; see {run_dir}/logs")
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:  # nothing outlives a scenario, whatever happened
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if sched.poll() is None:
            sched.kill()
            sched.wait(10)
    replicas = [json.loads(out.read_text()) for out in outs]
    errors = [e for r in replicas for e in r["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} replica error(s), the first: {errors[0]}")
    lines = read_metrics(run_dir / "metrics.jsonl")
    groups = [g for g in lines if g["kind"] == "group"]
    held = {(g["stage"], p, k): w for g in groups
            for p, k, w in zip(g["members"], g["iterations"], g["waits"])}
    taken, published = timeline(run_dir, P * S)
    records = [rec for r in replicas for rec in r["records"]]
    latency = sorted(read - pushed - held[(s, p, k)] for s, p, k, pushed, read in records)
    parts = {"queue": sorted(taken[(s, p, k)] - pushed for s, p, k, pushed, _ in records),
             "sched": sorted(published[(s, p, k)] - taken[(s, p, k)] - held[(s, p, k)]
                             for s, p, k, _, _ in records),
             "wake": sorted(read - published[(s, p, k)] for s, p, k, _, read in records)}
    progress = sum(1 for g in lines if g["kind"] in ("train", "sync", "done"))  # step, done events
    return {"pipelines": P, "stages": S, "steps": args.steps, "compute_ms": args.compute_ms,
            "rounds": len(latency), "decisions": len(groups),
            "mean_group": sum(g["size"] for g in groups) / len(groups),
            "events_per_s": (len(latency) + progress) / wall,
            "latency_ms": {"min": latency[0] * 1e3, "p50": pct(latency, 0.5) * 1e3,
                           "p99": pct(latency, 0.99) * 1e3, "max": latency[-1] * 1e3},
            "parts_ms": {name: {"p50": pct(x, 0.5) * 1e3, "p99": pct(x, 0.99) * 1e3}
                         for name, x in parts.items()},
            "pinned": args.pin,
            "scheduler_cpu_s": cpu, "scheduler_cpu_per_s": cpu / wall,
            "scheduler_cpu_ms_per_decision": cpu / len(groups) * 1e3,
            "scheduler_queued_per_s": queued / wall,
            "replicas_cpu_per_s": sum(r["cpu_s"] for r in replicas) / wall, "wall_s": wall,
            "load_avg_1m": load, "run_dir": str(run_dir)}


def timeline(run_dir: Path, rank: int) -> tuple[dict, dict]:
    """From the scheduler's track (``logs/<rank>.trace.json``), per (stage, pipeline,
    iteration): when it took the batch holding the ready signal from the queue, and when it
    published the decision (run-clock seconds).

    The batch's moment, not the signal's own stamp: the policy's clock (and so the wait it
    reports) reads one moment per batch, and a signal handled late in its batch, answered early
    in a later one, would otherwise come out with a negative ``sched``."""
    doc = json.loads((run_dir / "logs" / f"{rank}.trace.json").read_text())
    if doc["dropped"]:
        raise RuntimeError(f"the scheduler's timeline dropped {doc['dropped']} events")
    batches = sorted(e["ts"] for e in doc["events"] if e["cat"] == "scheduler")
    taken, published = {}, {}
    for e in doc["events"]:
        if e["cat"] == "ready":
            popped = batches[bisect.bisect_right(batches, e["ts"]) - 1]  # the batch it came in
            taken[(e["tid"] - 1, e["args"]["pipeline"], e["args"]["iteration"])] = popped / 1e6
        elif e["cat"] == "round":
            end = (e["ts"] + e["dur"]) / 1e6
            for p, k in zip(e["args"]["members"], e["args"]["iterations"]):
                published[(e["tid"] - 1, p, k)] = end
    return taken, published


def pct(ascending: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return ascending[max(0, math.ceil(q * len(ascending)) - 1)]


# -- report ---------------------------------------------------------------------------------------
def cells(r: dict[str, Any]) -> list[str]:
    lat, parts = r["latency_ms"], r["parts_ms"]
    num, ms = _report.num, _report.ms
    return [f"{r['pipelines']} x {r['stages']}", num(r["events_per_s"], ".0f"), str(r["decisions"]),
            num(r["mean_group"], ".2f"), ms(lat["p50"]), ms(lat["p99"]), ms(lat["max"]),
            *(f"{ms(parts[x]['p50'])} / {ms(parts[x]['p99'])}" for x in ("queue", "sched", "wake")),
            num(r["scheduler_cpu_per_s"], ".2f"), ms(r["scheduler_cpu_ms_per_decision"]),
            num(r["scheduler_queued_per_s"], ".2f"), num(r["replicas_cpu_per_s"], ".2f"),
            num(r["wall_s"], ".1f"), num(r["load_avg_1m"], ".1f")]


def goal_line(results: list[dict[str, Any]]) -> str:
    goal = f"goal: p99 <= {GOAL_MS:g} ms at {GOAL_AT[0]} x {GOAL_AT[1]}"
    at = [r for r in results if (r["pipelines"], r["stages"]) == GOAL_AT]
    if not at:
        return f"{goal} (not run)"
    p99, own = at[0]["latency_ms"]["p99"], at[0]["parts_ms"]["sched"]["p99"]
    return (f"{goal}: {_report.ms(p99)} ms, {'met' if p99 <= GOAL_MS else 'NOT met'} "
            f"(the scheduler's own part: {_report.ms(own)} ms, {'met' if own <= GOAL_MS else 'NOT met'})")


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    rows += ["| " + " | ".join(cells(r)) + " |" for r in results]
    return (f"Scheduler load: {args.steps} steps, {args.compute_ms:g} ms compute per iteration, "
            f"last pipeline {SLOW:g}x slower"
            f"{'; scheduler and store pinned to a core of their own' if args.pin else ''}\n\n"
            + "\n".join(rows) + "\n\n" + goal_line(results))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    args.out.mkdir(parents=True, exist_ok=False)
    results = []
    for P, S in [(args.pipelines, args.stages)] if args.pipelines else SCENARIOS:
        console.print(f"{P} pipelines x {S} stages ...")
        results.append(run_scenario(args, P, S))
    table = Table(title="scheduler decision latency and cost")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(*cells(r))
    console.print(table)
    console.print(goal_line(results))
    for path in (args.out / "results.json", args.json):
        if path:
            path.write_text(json.dumps(results, indent=1))
    if args.markdown:
        console.print(f"markdown: {_report.write_markdown(args.markdown, markdown(results, args))}")
    if args.profile:
        import pstats
        for r in results:
            console.print(f"cProfile of the scheduler, {r['pipelines']} x {r['stages']}:")
            pstats.Stats(f"{r['run_dir']}/scheduler.prof").sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
