"""Fault injection for ``fault.on_pipeline_loss=restart``: kill or stop random workers of a real run.

In the spirit of torchft's punisher: one ``sdpipe train`` run with sync=sdpipe, and, while it
trains, N faults at random times, each on a random worker: SIGKILL (a crash) or SIGSTOP (a hang,
which the scheduler must notice within ``run.heartbeat_timeout`` and the launcher then kills). Run
it from the repository root after ``pip install -e .``::

    python scripts/chaos.py                                # 10 faults in a P=4, S=2 run
    python scripts/chaos.py --kills 8 --stops 2 --baseline # and a run without faults to compare
    python scripts/chaos.py --kills 2 --stops 0 --steps 40 --out /tmp/chaos   # a smoke test
    python scripts/chaos.py --kills 5 --stops 0 --scheduler-kills 3   # the scheduler among the victims
    python scripts/chaos.py --kills 2 --stops 0 --heal-source-kills 2 --second-losses 2   # during heals

Usage::

    python scripts/chaos.py [--kills 8] [--stops 2] [--scheduler-kills 0] [--pipelines 4] [--stages 2] [--steps 300]
        [--compute-ms 10] [--gap 1.0 3.0] [--seed 0] [--heartbeat 8] [--model mlp] [--out runs/chaos]
        [--timeout 900] [--baseline] [--extra OVERRIDE ...]

**Faults.** The first comes once training runs (a ``train`` line), each next one a uniform random
``--gap`` seconds after the previous pipeline was healed again (its ``heal`` lines are in), so
that at most one pipeline is down at a time and every fault hits a full run. Kills and stops
come in a random order; the victim is a random worker. ``--scheduler-kills`` adds SIGKILLs of the
scheduler to the plan, each once the scheduler killed before is live again (its
``scheduler_restart`` line is in). Faults during recovery: ``--heal-source-kills`` kills a worker,
then the replica the scheduler names to heal it, as soon as it is named (its ``group`` line with
``heal``: before or while it sends; ``after_the_heal`` says when the heal had already finished);
``--second-losses`` kills a worker, then another replica of its stage as soon as the first's
pipeline is started again, before it heals; ``--checkpoint-kills`` kills a worker as soon as a
checkpoint's staging folder appears, while its shards are written (``during`` names it). A fault
is not injected once the run has
reached 90% of its budget (a loss during the last global sync is not made good, see
docs/FAULT_TOLERANCE.md).

**Checks** (:func:`check`), printed as a table and written to ``OUT/chaos.json``:

- ``exit 0``: the run completed;
- ``budget``: the pipelines' final iterations sum to P x ``train.steps``;
- ``identical``: at the end every stage's replicas have one parameter digest (replicas that were
  still healing when the run ended are left out, and counted);
- ``no orphans``: no process whose pid a ``logs/*.pid`` file or a fault recorded is still alive;
- ``checkpoints``: every complete checkpoint passes ``checkpoint.verify`` (checksums, manifest);
- ``restarts`` and ``heals``: one restart per worker fault, S heals per restart; one
  ``scheduler_restart`` per scheduler kill, and its **downtime**: from the kill to the new
  scheduler's replay done (it acts on events again);
- per fault, the pipeline's **downtime**: from the fault to its stages' heals (for a stop, this
  includes the ``run.heartbeat_timeout`` it takes to notice); and the **time lost**
  per fault: (this run's wall time - the baseline's) / faults, with ``--baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _runner import run_command, start_command  # noqa: E402, I001  (a sibling module, not a package)
from sdpipe_cli import analysis, checkpoint  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics lines so far (one being written is left out), [] before there are any."""
    path = run_dir / "metrics.jsonl"
    return analysis.read_metrics(path, check=False) if path.exists() else []


def overrides(args, run_dir: Path, faults: int) -> list[str]:
    """The ``sdpipe train`` overrides of a run that may lose ``faults`` pipelines."""
    return [f"run.dir={run_dir}", f"model={args.model}", "data=synthetic",
            f"cluster.pipelines={args.pipelines}", f"pipeline.stages={args.stages}",
            f"train.steps={args.steps}", "train.eval_every=0",
            f"cluster.compute_ms={args.compute_ms}", "cluster.device=cpu",
            "fault.on_pipeline_loss=restart", f"fault.max_restarts={faults}",
            "fault.restart_backoff=0.2", f"run.heartbeat_timeout={args.heartbeat}",
            f"sync.group_timeout={args.heartbeat / 2:g}",
            f"checkpoint.every={max(1, args.steps // 4)}", *args.extra]


def pid_of(run_dir: Path, rank: int | str) -> int | None:
    try:
        return int((run_dir / "logs" / f"{rank}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def quiet(lines: list[dict], stages: int, scheduler_kills: int) -> bool:
    """Nothing is recovering: every lost pipeline was restarted and every stage of its latest
    incarnation healed since, and the scheduler came back from every kill."""
    if sum(m["kind"] == "scheduler_restart" for m in lines) < scheduler_kills:
        return False
    last_loss: dict[int, float] = {}
    last_restart: dict[int, float] = {}
    for m in lines:
        if m["kind"] == "lost":
            last_loss[m["pipeline"]] = m["time"]
        elif m["kind"] == "restart":
            last_restart[m["pipeline"]] = m["time"]
    for pipeline, lost_at in last_loss.items():
        restarted = last_restart.get(pipeline)
        if restarted is None or restarted < lost_at:
            return False
        healed = sum(m["kind"] == "heal" and m["pipeline"] == pipeline and m["time"] >= restarted
                     for m in lines)
        if healed < stages:
            return False
    return True


def _kill(run_dir: Path, rank, sig: signal.Signals, start: float, stages: int, kind: str,
          log) -> dict | None:
    pid = pid_of(run_dir, rank)
    if pid is None:
        return None
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    pipeline = None if rank == "scheduler" else rank // stages
    entry = {"time": round(time.monotonic() - start, 3), "rank": rank, "pipeline": pipeline,
             "signal": sig.name, "pid": pid, "kind": kind}
    log(f"chaos: {sig.name} to {'the scheduler' if pipeline is None else f'rank {rank}'} "
        f"(pipeline {pipeline}, {kind}) at {entry['time']:.1f} s")
    return entry


def _during_recovery(run_dir: Path, proc: subprocess.Popen, first: dict, fault: str,
                     stages: int, pipelines: int, start: float, rng: random.Random,
                     log) -> dict | None:
    """The second fault of a recovery scenario, once the first (``first``) is being recovered:
    ``heal-source``: the replica the scheduler names to heal the lost one, as soon as it is named
    (before or while it sends); ``second-loss``: another replica of the same stage, as soon as
    the lost pipeline is started again (before it heals)."""
    victim, stage = first["pipeline"], first["rank"] % stages
    seen = len(read_metrics(run_dir))
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        fresh = read_metrics(run_dir)[seen:]
        if fault == "heal-source":
            named = next((m for m in fresh if m["kind"] == "group" and m["stage"] == stage
                          and victim in [q for q, _ in m.get("heal", [])]), None)
            if named is not None:
                healed_first = any(m["kind"] == "heal" and m["pipeline"] == victim
                                   and m["stage"] == stage for m in fresh)
                entry = _kill(run_dir, named["members"][0] * stages + stage, signal.SIGKILL,
                              start, stages, fault, log)
                if entry is not None:
                    entry["after_the_heal"] = healed_first
                return entry
        elif any(m["kind"] == "restart" and m["pipeline"] == victim for m in fresh):
            others = [p for p in range(pipelines) if p != victim]
            return _kill(run_dir, rng.choice(others) * stages + stage, signal.SIGKILL, start,
                         stages, fault, log)
        time.sleep(0.01)
    return None


def _await_staging(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> str | None:
    """The name of the next save's staging folder, as soon as it appears (polled every 5 ms)."""
    folder = run_dir / "checkpoints"
    before = {p.name for p in folder.glob(".staging-*")} if folder.is_dir() else set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        fresh = [p.name for p in folder.glob(".staging-*")] if folder.is_dir() else []
        new = sorted(set(fresh) - before)
        if new:
            return new[0]
        time.sleep(0.005)
    return None


def punish(run_dir: Path, proc: subprocess.Popen, plan: list[str], workers: int, stages: int,
           gap: tuple[float, float], budget: int, rng: random.Random,
           log=print) -> list[dict]:
    """Inject ``plan`` into the run, as the module docstring says; returns what was done: time
    (s since the first train line), rank, signal, pid, kind."""
    done: list[dict] = []
    start = None
    while start is None and proc.poll() is None:
        if any(m["kind"] == "train" for m in read_metrics(run_dir)):
            start = time.monotonic()
        time.sleep(0.05)
    for fault in plan:
        deadline = time.monotonic() + rng.uniform(*gap)
        scheduler_kills = sum(d["rank"] == "scheduler" for d in done)
        while proc.poll() is None:
            if quiet(read_metrics(run_dir), stages, scheduler_kills) and \
                    time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        progress = sum(m["step"] for m in _last_train(read_metrics(run_dir)).values())
        if proc.poll() is not None or progress >= 0.9 * budget:
            log(f"chaos: run too far along for more faults ({progress}/{budget} iterations)")
            break
        if fault == "checkpoint":  # once a save's staging folder appears
            staged = _await_staging(run_dir, proc)
            if staged is None:
                continue
        rank = "scheduler" if fault == "scheduler" else rng.randrange(workers)
        sig = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
        entry = _kill(run_dir, rank, sig, start, stages, "kill" if fault in (
            "heal-source", "second-loss") else fault, log)
        if entry is None:
            continue
        if fault == "checkpoint":
            entry["during"] = staged
        done.append(entry)
        if fault in ("heal-source", "second-loss"):
            second = _during_recovery(run_dir, proc, entry, fault, stages, workers // stages,
                                      start, rng, log)
            if second is not None:
                done.append(second)
    return done


def _last_train(lines: list[dict]) -> dict[int, dict]:
    last: dict[int, dict] = {}
    for m in lines:
        if m["kind"] == "train":
            last[m["pipeline"]] = m
    return last


def orphans(run_dir: Path, pids: list[int]) -> list[int]:
    """Live processes among ``pids`` and those the run's pid files name."""
    named = [pid_of(run_dir, int(f.stem) if f.stem.isdigit() else f.stem)
             for f in (run_dir / "logs").glob("*.pid") if f.stem.isdigit() or f.stem == "scheduler"]
    alive = []
    for pid in {p for p in [*pids, *named] if p}:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(alive)


def check(run_dir: Path, returncode: int, faults: list[dict], pipelines: int, stages: int,
          steps: int) -> dict:
    """The checks of the module docstring, as a dict (``ok``: all of them passed)."""
    lines = read_metrics(run_dir)
    done: dict[int, dict] = {}
    for m in lines:
        if m["kind"] == "done":
            done[m["rank"]] = m  # the last incarnation's
    last = _last_train(lines)  # a pipeline dropped for good reports no done line
    finals = {p: last[p]["step"] if p in last else 0 for p in range(pipelines)}
    unhealed = sorted(r for r, d in done.items() if d.get("healed") is False)
    digests = {s: {d["param_digest"] for r, d in done.items()
                   if d["stage"] == s and r not in unhealed} for s in range(stages)}
    invalid = []
    for ckpt in checkpoint.complete_checkpoints(run_dir):
        try:
            checkpoint.verify(ckpt)
        except Exception as err:  # noqa: BLE001 - any refusal counts
            invalid.append(f"{ckpt.name}: {err}")
    restarts = [m for m in lines if m["kind"] == "restart"]
    heals = [m for m in lines if m["kind"] == "heal"]
    lost = [m for m in lines if m["kind"] == "lost"]
    # the faults' clock starts at the first train line (polled every 50 ms): on the run's clock
    first = min((m["time"] for m in lines if m["kind"] == "train"), default=0.0)
    downtime, scheduler_down = [], []
    again = sorted(m["time"] for m in lines if m["kind"] == "scheduler_restart")
    for fault in faults:
        at = first + fault["time"]
        if fault["rank"] == "scheduler":
            live = [t for t in again if t >= at]
            scheduler_down.append(round(live[0] - at, 3) if live else None)
            continue
        later = sorted(h["time"] for h in heals if h["pipeline"] == fault["pipeline"]
                       and h["time"] >= at)
        downtime.append(round(later[stages - 1] - at, 3) if len(later) >= stages else None)
    result = {
        "exit": returncode, "budget": sum(finals.values()), "target": pipelines * steps,
        "final_iterations": finals, "identical": all(len(v) == 1 for v in digests.values()),
        "unhealed_at_end": unhealed, "checkpoints": len(checkpoint.complete_checkpoints(run_dir)),
        "invalid_checkpoints": invalid, "faults": len(faults), "lost": len(lost),
        "restarts": len(restarts), "heals": len(heals),
        "heal_bytes": sorted({h["bytes"] for h in heals}),
        "heal_seconds": [h["seconds"] for h in heals],
        "heal_transfer_s": [h.get("transfer_s") for h in heals], "downtime_s": downtime,
        "scheduler_kills": len(scheduler_down), "scheduler_restarts": len(again),
        "scheduler_downtime_s": scheduler_down,
        "orphans": orphans(run_dir, [f["pid"] for f in faults]),
        "staging_left": sorted(p.name for p in (run_dir / "checkpoints").glob(".staging-*"))
        if (run_dir / "checkpoints").is_dir() else [],
        "interrupted_saves": {f["during"]: (run_dir / "checkpoints" / f["during"].removeprefix(
            ".staging-")).is_dir() for f in faults if f.get("during")},
    }
    # a loss during a heal may cost the healing pipeline too (its transfer fails): at least one
    # loss per worker fault, and every loss restarted
    result["ok"] = (returncode == 0 and result["budget"] == result["target"]
                    and result["identical"] and not invalid and not result["orphans"]
                    and not result["staging_left"]
                    and len(lost) >= len(faults) - len(scheduler_down)
                    and len(restarts) == len(lost) and len(again) == len(scheduler_down))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", help="a model config (heal time per stage size)")
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--stops", type=int, default=2)
    parser.add_argument("--scheduler-kills", type=int, default=0)
    parser.add_argument("--heal-source-kills", type=int, default=0,
                        help="kills whose pipeline's heal source is killed as soon as it is named")
    parser.add_argument("--second-losses", type=int, default=0,
                        help="kills followed by a kill in the same stage while the first heals")
    parser.add_argument("--checkpoint-kills", type=int, default=0,
                        help="kills as soon as a checkpoint's staging folder appears")
    parser.add_argument("--pipelines", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compute-ms", type=float, default=10)
    parser.add_argument("--gap", type=float, nargs=2, default=(1.0, 3.0))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--baseline", action="store_true", help="also a run without faults")
    parser.add_argument("--extra", nargs="*", default=[])
    args = parser.parse_args()
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the run's session is killed too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    plan = (["kill"] * args.kills + ["stop"] * args.stops + ["scheduler"] * args.scheduler_kills
            + ["heal-source"] * args.heal_source_kills + ["second-loss"] * args.second_losses
            + ["checkpoint"] * args.checkpoint_kills)
    rng.shuffle(plan)
    report: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()}}
    if args.baseline:
        baseline = run_command("train", overrides(args, args.out / "baseline", 0),
                               args.out / "baseline.log", args.timeout)
        rc = baseline.returncode  # None: past --timeout, stopped
        report["baseline"] = {"exit": rc, "wall_s": round(baseline.wall_s, 2)}
        print(f"baseline: exit {rc}, {report['baseline']['wall_s']} s")
    run_dir = args.out / "chaos"
    log_path = args.out / "chaos.log"
    started = time.monotonic()
    with open(log_path, "w") as log_file:
        # a recovery scenario may cost up to three losses (the victim, the second, the victim
        # again when its heal fails)
        budget = len(plan) + 2 * (args.heal_source_kills + args.second_losses)
        # its own session, killed whole below: faults leave stopped workers and restarted ones
        proc = start_command("train", overrides(args, run_dir, budget), log_file, new_session=True)
        try:
            faults = punish(run_dir, proc, plan, args.pipelines * args.stages, args.stages,
                            tuple(args.gap), args.pipelines * args.steps, rng)
            rc = proc.wait(timeout=args.timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.monotonic() - started
    result = check(run_dir, rc, faults, args.pipelines, args.stages, args.steps)
    result["wall_s"] = round(wall, 2)
    if "baseline" in report and faults:
        result["time_lost_per_fault_s"] = round(
            (wall - report["baseline"]["wall_s"]) / len(faults), 2)
    report.update(chaos=result, faults=faults)
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1))
    for key in ("ok", "exit", "faults", "lost", "restarts", "heals", "budget", "target",
                "identical", "unhealed_at_end", "checkpoints", "invalid_checkpoints", "orphans",
                "heal_bytes", "heal_seconds", "heal_transfer_s", "downtime_s", "scheduler_kills",
                "scheduler_restarts", "scheduler_downtime_s", "staging_left",
                "interrupted_saves", "wall_s",
                "time_lost_per_fault_s"):
        if key in result:
            print(f"{key:>22}: {result[key]}")
    print(f"log: {log_path}; results: {args.out / 'chaos.json'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
