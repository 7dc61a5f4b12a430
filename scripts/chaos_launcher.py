"""SIGKILL the launcher itself at every moment of a run, then check that nothing outlives it and
that the run resumes.

For each delay in ``--from`` .. ``--to`` seconds (step ``--step``): start ``sdpipe train`` (its own
session, a P=2 x S=2 run with checkpoints every few steps), watch every process it starts (workers,
scheduler, the fork server, the resource tracker, data loaders: its descendants, polled), SIGKILL
the launcher after that delay, wait ``--grace`` seconds, and count the processes still alive. When
the killed run had a complete checkpoint, ``sdpipe resume RUN`` must finish it (exit 0). Run from
the repository root after ``pip install -e .``::

    python scripts/chaos_launcher.py                         # 0.5 s .. 6 s, every 0.5 s
    python scripts/chaos_launcher.py --from 1 --to 2 --markdown runs/chaos-launcher.md

Printed (and with ``--markdown PATH`` written under a provenance stamp): per delay, the phase the
run was in (from its folder: no folder, starting, training), the processes seen, those alive
``--grace`` s after the kill, the newest checkpoint and the resume's exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _report import write_markdown  # noqa: E402  (sibling modules, not a package)
from _runner import run_command, start_command  # noqa: E402

from sdpipe_cli import checkpoint  # noqa: E402


def overrides(run_dir: Path, steps: int, sync: str) -> list[str]:
    return [f"run.dir={run_dir}", "model=mlp", "data=synthetic", "cluster.pipelines=2",
            "pipeline.stages=2", f"train.steps={steps}", "train.eval_every=0",
            "cluster.compute_ms=20", "checkpoint.every=5", f"sync={sync}"]


def watch(proc: subprocess.Popen, until: float) -> dict[int, psutil.Process]:
    """Every descendant of ``proc`` seen until ``until`` (monotonic), by pid."""
    seen: dict[int, psutil.Process] = {}
    root = psutil.Process(proc.pid)
    while time.monotonic() < until and proc.poll() is None:
        try:
            for child in root.children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    return seen


def alive(seen: dict[int, psutil.Process]) -> list[int]:
    """Those of ``seen`` still running (is_running: the same process, not a reused pid, told by
    its start time since boot, which a stepped system clock does not move)."""
    out = []
    for pid, p in seen.items():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def phase(run_dir: Path) -> str:
    if not run_dir.exists():
        return "no run folder"
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and '"kind": "train"' in metrics.read_text(errors="replace"):
        return "training"
    return "starting"


def one(delay: float, out: Path, steps: int, grace: float, timeout: float, sync: str) -> dict:
    run_dir = out / f"kill-{delay:g}s"
    # the launcher under test, in its own session: started as any run (its log beside its
    # folder), then SIGKILLed at ``delay`` on purpose, not stopped in order
    with (out / f"kill-{delay:g}s.log").open("w") as log:
        proc = start_command("train", overrides(run_dir, steps, sync), log, cwd=REPO,
                             new_session=True)
    seen = watch(proc, time.monotonic() + delay)
    finished = proc.poll() is not None
    if not finished:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    when = phase(run_dir)
    time.sleep(grace)
    left = alive(seen)
    for pid in left:  # do not let one case spoil the next
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    newest = checkpoint.latest(run_dir) if run_dir.exists() else None
    resumed = None
    if newest is not None and not finished:
        resume = run_command("resume", [str(run_dir)], None, timeout, cwd=REPO)
        resumed = "timeout" if resume.timed_out else resume.returncode
    return {"delay": delay, "phase": "ended first" if finished else when, "seen": len(seen),
            "left": left, "checkpoint": newest.name if newest else "-", "resume": resumed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="start", type=float, default=0.5)
    parser.add_argument("--to", type=float, default=6.0)
    parser.add_argument("--step", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=40, help="train.steps of each run")
    parser.add_argument("--sync", default="sdpipe", help="sync mode of each run (allreduce: a "
                        "checkpoint every 5 steps; sdpipe: at the global syncs after them)")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=Path(time.strftime("runs/chaos-launcher-%Y%m%d-%H%M%S")))
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"--out {args.out} exists: each kill needs a fresh run folder")
    args.out.mkdir(parents=True)
    rows, delay = [], args.start
    while delay <= args.to + 1e-9:
        row = one(delay, args.out, args.steps, args.grace, args.timeout, args.sync)
        rows.append(row)
        print(f"kill at {delay:4.1f} s ({row['phase']}): {row['seen']} processes seen, "
              f"{len(row['left'])} alive {args.grace:g} s later; checkpoint {row['checkpoint']}, "
              f"resume exit {row['resume']}", flush=True)
        delay += args.step
    table = ["| kill after | phase | processes seen | alive after | newest checkpoint | resume exit |",
             "|---:|---|---:|---:|---|---:|"]
    table += [f"| {r['delay']:g} s | {r['phase']} | {r['seen']} | {len(r['left'])} | "
              f"{r['checkpoint']} | {'-' if r['resume'] is None else r['resume']} |" for r in rows]
    if args.markdown:
        write_markdown(args.markdown, "\n".join(table))
    bad = [r for r in rows if r["left"] or r["resume"] not in (None, 0)]
    print(f"{len(rows)} kills: {len(bad)} left a process or failed to resume")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
