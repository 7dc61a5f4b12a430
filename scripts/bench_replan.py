"""Re-planning the split after a device slows down (``fault.on_slowdown=replan``): what it gains
and what it costs, against the same run without it and a run planned for the slow device from
its start.

Run it from the repository root::

    python scripts/bench_replan.py --out runs/bench-replan                # 3 seeds, ~20 min
    python scripts/bench_replan.py --out /tmp/r --seeds 0 --steps 60      # a smoke test

P=4 pipelines of S=4 stages of a 16-block model (``model=mlp model.n_layers=14``), compute
modelled from a profile (every block ``--block-ms`` forward, twice that backward), so a stage's
cost follows its blocks. Device ``local:9`` (pipeline 2, stage 1; ``--pipelines 0,2``: pipelines 0
and 2's stage 1) slows to speed 0.25 at ``--at`` seconds of the run clock. Per seed and sync mode:

* ``warn``: the slowdown is named, nothing moves;
* ``replan``: the run re-plans if the measured speeds say it pays (under ``sdpipe`` in place:
  the re-split pipelines restart on their new splits while the others go on);
* ``replan-stop`` (``sdpipe`` only): the same with ``fault.replan_in_place=false``, the whole
  run stopping and going on from its checkpoint resharded;
* ``planned``: the device is slow from the start and the split is the one ``replan`` would
  choose (the partitioner of ``partition=auto`` at those speeds: one for all pipelines under
  ``allreduce``, pipeline 2's own under ``sdpipe``), given from the start.

Columns: the run's samples/s before the slowdown (from 5 s after its first iteration to
``--at``: what replicas averaging per block, in place, cost against per stage), a slowed
pipeline's samples/s after the slowdown (from ``--at`` + 20 s on the run clock
to the end, the mean of the slowed pipelines), the run's samples/s over the same span and over
the whole run, the longest pause of a pipeline that did not slow down (the longest time
between two of its iterations, after ``--at``: what moving cost the others), the final training
loss (mean over pipelines' last 10 iterations: equal budgets), the final validation loss
(after the run's last sync), and the ``replan`` lines.

``--recover-at T``: one ``replan`` run per mode whose devices are back to their speed at ``T``:
the straggler, re-plan and recovery lines (a re-plan, then one back).

``--resume-check``: one ``allreduce`` run with ``replan`` and ``checkpoint.every``, resumed
(``sdpipe resume``, into a new folder) from its first checkpoint after the re-plan: the losses of
every iteration after it, compared with the first run's.

Prints markdown tables; with ``--markdown PATH`` also writes them, stamped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import run_command, run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402
from sdpipe_cli.core.partition import uniform  # noqa: E402
from sdpipe_cli.core.replan import as_config, called_for  # noqa: E402

P, S, BLOCKS, MICROBATCHES, BATCH = 4, 4, 16, 4, 16
PIPELINE, STAGE, SPEED = 2, 1, 0.25  # local:9, pipeline 2's stage 1, slows to a quarter
BASE = ["model=mlp", "model.n_layers=14", "data=synthetic", f"cluster.pipelines={P}",
        f"pipeline.stages={S}", "train.eval_every=0", "cluster.emulation=modelled"]


def device(pipeline: int) -> str:
    """The name of the device of ``pipeline``'s stage ``STAGE`` (one local node, rank order)."""
    return f"local:{pipeline * S + STAGE}"


def changes(slowed: list[int], at: float) -> str:
    """``cluster.changes``: stage ``STAGE`` of each of ``slowed`` at ``SPEED`` from ``at`` s."""
    items = ", ".join(f"{{device: '{device(p)}', speed: {SPEED}, start: {at}}}" for p in slowed)
    return f"cluster.changes=[{items}]"


def planned_split(block_ms: float, own: bool, slowed: list[int]) -> list[str]:
    """The overrides of the split ``replan`` would choose at these speeds (the partitioner of
    ``partition=auto``): one split for all, or (``own``: sdpipe) the slowed pipelines' own."""
    per = 3 * block_ms
    speeds = [[[per / (SPEED if p in slowed and s == STAGE else 1.0)] * BLOCKS for s in range(S)]
              for p in range(P)]
    shared, partitions = as_config(called_for(speeds, own), uniform(BLOCKS, S))
    own_text = ", ".join(f"{q}: {b}" for q, b in partitions.items())
    return [f"pipeline.partition={shared}", f"pipeline.partitions={{{own_text}}}"]


def rate_after(lines: list[dict], since: float, pipelines: list[int],
               until: float = float("inf")) -> float | None:
    """Samples/s of ``pipelines`` from run-clock ``since`` to their last train line (before
    ``until``)."""
    total = 0.0
    for p in pipelines:
        mine = sorted((m["time"], m["samples"]) for m in lines if m["kind"] == "train"
                      and m["pipeline"] == p and since <= m["time"] <= until)
        if len(mine) < 2:
            return None
        total += (mine[-1][1] - mine[0][1]) / (mine[-1][0] - mine[0][0])
    return total


def longest_pause(lines: list[dict], since: float, pipelines: list[int]) -> float | None:
    """The longest time between two iterations of any of ``pipelines`` after ``since``."""
    gaps = []
    for p in pipelines:
        times = sorted(m["time"] for m in lines
                       if m["kind"] == "train" and m["pipeline"] == p and m["time"] >= since)
        gaps += [b - a for a, b in zip(times, times[1:])]
    return max(gaps, default=None)


def final_loss(lines: list[dict]) -> float:
    last = {}
    for m in lines:
        if m["kind"] == "train" and m.get("loss") is not None:
            last.setdefault(m["pipeline"], []).append(m["loss"])
    return statistics.mean(statistics.mean(v[-10:]) for v in last.values())


def one(out: Path, name: str, overrides: list[str], timeout: float) -> list[dict]:
    run = out / name
    code, _ = run_sdpipe([f"run.dir={run}", *BASE, *overrides], out / f"{name}.log", timeout)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}): see {out / (name + '.log')}")
    return analysis.read_metrics(run / "metrics.jsonl")


def final_val_loss(lines: list[dict]) -> float | None:
    """The run's last evaluation (after its final sync), averaged over the pipelines."""
    last = {m["pipeline"]: m["val_loss"] for m in lines
            if m["kind"] == "eval" and m.get("val_loss") is not None}
    return statistics.mean(last.values()) if last else None


def row(name: str, lines: list[dict], since: float, slowed: list[int], at: float) -> dict:
    replans = [m for m in lines if m["kind"] == "replan"]
    slow = rate_after(lines, since, slowed)
    others = [p for p in range(P) if p not in slowed]
    start = min((m["time"] for m in lines if m["kind"] == "train"), default=0.0)
    return {"run": name,
            "run before": _report.rate(rate_after(lines, start + 5.0, list(range(P)), at)
                                       if at > start + 10.0 else None),
            "slow pipeline after": _report.rate(None if slow is None else slow / len(slowed)),
            "run after": _report.rate(rate_after(lines, since, list(range(P)))),
            "run, whole": _report.rate(analysis.samples_per_s(lines)),
            "others' longest pause (s)": _report.num(longest_pause(lines, at, others), ".2f"),
            "final loss": _report.loss(final_loss(lines)),
            "final val loss": _report.loss(final_val_loss(lines)),
            "replan": ", ".join(f"{m['partition']}->{m['proposed']} "
                                f"{'in place' if m.get('in_place') else 'go' if m['go'] else 'no'}"
                                for m in replans) or "-"}


def resume_check(out: Path, profile: Path, steps: int, at: float, timeout: float) -> str:
    """A re-planned run resumed after its re-plan: the same losses, bit for bit?"""
    first = out / "resume-first"
    lines = one(out, "resume-first", ["sync=allreduce", f"train.steps={steps}",
                                      f"profile={profile}", "checkpoint.every=10",
                                      "checkpoint.keep=0", "fault.on_slowdown=replan",
                                      f"cluster.changes=[{{device: '{device(PIPELINE)}', speed: {SPEED}, "
                                      f"start: {at}}}]"], timeout)
    moved = [m for m in lines if m["kind"] == "replan" and m["go"]]
    resumed = [m for m in lines if m["kind"] == "resume"]
    if not moved or not resumed:
        return "resume check: the run did not re-plan (slowdown before the baseline, or too late)"
    after = [m["step"] for m in lines if m["kind"] == "checkpoint"
             and m["time"] > resumed[0]["time"] and m["step"] < steps]
    if not after:
        return "resume check: no checkpoint after the re-plan"
    again = out / "resume-again"
    run_command("resume", [str(first / "checkpoints" / f"step_{after[0]}"), f"run.dir={again}"],
                out / "resume-again.log", timeout).check("the resume")

    def tail(run: Path) -> dict:
        return {(m["pipeline"], m["step"]): m["loss"] for m in
                analysis.read_metrics(run / "metrics.jsonl")
                if m["kind"] == "train" and m["step"] > after[0]}
    a, b = tail(first), tail(again)
    same = a == b and len(a) == P * (steps - after[0])
    return (f"resume check: re-planned {moved[0]['partition']} -> {moved[0]['proposed']}, resumed "
            f"from step_{after[0]}: {len(b)} losses after it, "
            f"{'identical bit for bit' if same else 'DIFFERENT'} to the first run's")


def recover_check(out: Path, profile: Path, sync: str, steps: int, at: float, back: float,
                  timeout: float, slowed: list[int]) -> str:
    """One ``replan`` run whose devices slow at ``at`` and are back to their speed at ``back``:
    the re-plans it made, and the split it ended with."""
    slow = ", ".join(f"{{device: '{device(p)}', speed: {SPEED}, start: {at}, end: {back}}}"
                     for p in slowed)
    lines = one(out, f"recover-{sync}", [f"sync={sync}", f"train.steps={steps}",
                                         f"profile={profile}", "fault.on_slowdown=replan",
                                         f"cluster.changes=[{slow}]"], timeout)
    events = [f"{m['kind']} {m['device']} at {m['time']:.1f} s"
              + (f": {m['partition']} -> {m['proposed']} "
                 f"{'in place' if m.get('in_place') else 'go' if m['go'] else 'no'}"
                 if m["kind"] == "replan" else "")
              for m in lines if m["kind"] in ("straggler", "recovered", "replan")]
    legs = sorted((out / f"recover-{sync}").glob("config.resume-*.yaml"))
    moved = sorted((out / f"recover-{sync}").glob("config.replan*.yaml"))
    return (f"recover check ({sync}, slow from {at:g} s to {back:g} s): " + "; ".join(events)
            + f"; {len(legs)} resumed leg(s), {len(moved)} re-split(s) in place")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--syncs", default="allreduce,sdpipe")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--block-ms", type=float, default=2.5)
    parser.add_argument("--at", type=float, default=20.0, help="run-clock seconds of the slowdown")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--variants", default="warn,replan,replan-stop,planned",
                        help="which runs per seed and mode (comma-separated)")
    parser.add_argument("--pipelines", default=str(PIPELINE),
                        help="the pipelines whose stage-1 device slows down (comma-separated)")
    parser.add_argument("--resume-check", action="store_true",
                        help="only check that a re-planned run resumes bit-exactly")
    parser.add_argument("--recover-at", type=float, default=None,
                        help="only check re-planning back: the device is back to its speed at "
                             "this run-clock second (one run per --syncs mode)")
    _report.add_markdown_option(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = _scenarios.write_profile(args.out / "profile.json", "mlp", BLOCKS,
                                       BATCH // MICROBATCHES, args.block_ms)
    if args.resume_check:
        print(resume_check(args.out, profile, args.steps, args.at, args.timeout))
        return 0
    slowed = [int(p) for p in args.pipelines.split(",") if p]
    if args.recover_at is not None:
        for sync in [s for s in args.syncs.split(",") if s]:
            print(recover_check(args.out, profile, sync, args.steps, args.at, args.recover_at,
                                args.timeout, slowed))
        return 0

    def slow(at: float) -> str:
        return changes(slowed, at)

    tables = []
    for sync in [s for s in args.syncs.split(",") if s]:
        split = planned_split(args.block_ms, sync == "sdpipe", slowed)
        rows = []
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            common = [f"sync={sync}", f"train.steps={args.steps}", f"train.seed={seed}",
                      f"profile={profile}"]
            replan = [slow(args.at), "fault.on_slowdown=replan"]
            variants = [("warn", [slow(args.at)]), ("replan", replan),
                        ("replan-stop", [*replan, "fault.replan_in_place=false"]),
                        ("planned", [slow(0.0), *split])]
            for name, extra in variants:
                if name not in args.variants.split(",") or (name == "replan-stop"
                                                           and sync != "sdpipe"):
                    continue  # the other modes always stop
                label = f"{sync}-{name}-seed{seed}"
                lines = one(args.out, label, [*common, *extra], args.timeout)
                since = 0.0 if name == "planned" else args.at + 20.0
                rows.append(row(label, lines, since, slowed, 0.0 if name == "planned" else args.at))
                print(json.dumps(rows[-1]), flush=True)
        tables.append(f"### sync={sync} (planned: {' '.join(split)})\n\n"
                      + _report.rows_table(rows))
    body = "\n\n".join(tables) + "\n"
    _report.publish(body, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
