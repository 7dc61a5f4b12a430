"""Benchmark asynchronous 1F1B (``pipeline.schedule=async_1f1b``) against the flushed 1F1B.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_async.py                     # both parts, as quoted in the README
    python scripts/bench_async.py --parts throughput  # only part (b), a few minutes
    python scripts/bench_async.py --steps 10 --throughput-steps 6 --out /tmp/benchasync
                                                      # a smoke test of the script itself

**(a) Convergence at equal samples**, on the default model and data (``gpt_tiny`` on the stdlib
corpus, P = 2, S = 2, m = 4, ``--steps`` iterations per pipeline, real compute): the reference is
the flushed 1F1B with a gradient all-reduce per iteration; against it run async 1F1B with the
semi-decentralized sync per update (PipeDream: an update and a sync round per micro-batch), the
same with the learning rate divided by sqrt(m) (each update sees a batch m times smaller; the
square-root rule for Adam), the same with ``pipeline.weight_versions=2`` (PipeDream-2BW: an update
per iteration, two weight versions), async 1F1B with all-reduce, at both rates (the schedule's
effect without group sync), and the flushed 1F1B with sdpipe (the project's default). ``final val
loss`` is the mean over pipelines of each pipeline's last evaluation; every run trains P x steps x
batch samples. ``vs reference`` is its ratio to the reference's; the target is within 5 %.

**(b) Throughput without the flush bubble**: S = 4 stages, small m, modelled compute
(``cluster.compute_ms``: every micro-batch forward takes that long, its backward twice, whatever
the real compute of the small MLP inside; see ``sdpipe_cli/hetero/emulation.py``), so that the 2 cores of a
small machine do not decide the result; ``CPU %`` and ``overruns`` check it, as in
``scripts/bench_sync.py``. A flushed iteration costs ``(m + S - 1)`` forward+backward slots for
m micro-batches; async 1F1B drains only at the end of the run (``train.eval_every=0``), so
its iteration costs m of them. Expected: samples/s up by ``(m + S - 1) / m``, i.e. the time per
sample down by the bubble fraction ``(S - 1) / (m + S - 1)``. Measured: ``samples/s`` from the
train lines (all pipelines, first to last train line: ``samples_per_s`` of
``sdpipe_cli.analysis``, as in ``bench_sync.py``), and ``saved`` = 1 - (flushed
samples/s) / (samples/s), next to ``bubble``. Rows with P = 2 and ``sync=sdpipe`` add the cost
of a sync round per update.

Everything goes to ``OUT/results.json`` and ``OUT/results.md``; ``--markdown PATH`` also writes the
tables there under a stamp line (date, commit, machine, command; ``scripts/_report.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
from _runner import CpuSampler, classify, run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

TARGET = 1.05  # async + sdpipe within 5 % of the flushed all-reduce's validation loss



def convergence_runs() -> list[tuple[str, list[str]]]:
    """(label, overrides), the reference first; ``lr/sqrt(m)`` from the default config."""
    from sdpipe_cli.config.composition import compose

    defaults = compose([])
    scaled = f"train.lr={defaults.train.lr / math.sqrt(defaults.pipeline.microbatches):.6g}"
    pipedream = ["pipeline.schedule=async_1f1b"]
    return [
        ("1f1b + allreduce (reference)", ["pipeline.schedule=1f1b", "sync=allreduce"]),
        ("async_1f1b + sdpipe", [*pipedream, "sync=sdpipe"]),
        ("async_1f1b + sdpipe, lr/sqrt(m)", [*pipedream, "sync=sdpipe", scaled]),
        ("async_1f1b 2BW + sdpipe", [*pipedream, "pipeline.weight_versions=2", "sync=sdpipe"]),
        ("async_1f1b + allreduce", [*pipedream, "sync=allreduce"]),
        ("async_1f1b + allreduce, lr/sqrt(m)", [*pipedream, "sync=allreduce", scaled]),
        ("1f1b + sdpipe", ["pipeline.schedule=1f1b", "sync=sdpipe"]),
    ]


# (P, sync, m, [(label, schedule overrides)]): the flushed one first in each group
THROUGHPUT = [
    (1, "none", 2, [("1f1b", ["pipeline.schedule=1f1b"]),
                    ("async_1f1b", ["pipeline.schedule=async_1f1b"])]),
    (1, "none", 4, [("1f1b", ["pipeline.schedule=1f1b"]),
                    ("async_1f1b", ["pipeline.schedule=async_1f1b"]),
                    ("async_1f1b 2BW", ["pipeline.schedule=async_1f1b",
                                        "pipeline.weight_versions=2"])]),
    (2, "sdpipe", 4, [("1f1b", ["pipeline.schedule=1f1b"]),
                      ("async_1f1b", ["pipeline.schedule=async_1f1b"]),
                      ("async_1f1b 2BW", ["pipeline.schedule=async_1f1b",
                                          "pipeline.weight_versions=2"])]),
]
STAGES = 4
MICROBATCH_SAMPLES = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Async 1F1B vs flushed 1F1B: convergence at "
                                     "equal samples, and throughput without the flush bubble.")
    parser.add_argument("--parts", default="convergence,throughput",
                        help="convergence, throughput or both (default: both)")
    parser.add_argument("--steps", type=int, default=400,
                        help="train.steps of the convergence runs (default: 400, the default run)")
    parser.add_argument("--throughput-steps", type=int, default=60,
                        help="train.steps of the throughput runs (default: 60)")
    parser.add_argument("--compute-ms", type=float, default=10.0,
                        help="cluster.compute_ms of the throughput runs (default: 10)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    _report.add_markdown_option(parser)
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not set(args.parts) <= {"convergence", "throughput"} or not args.parts:
        parser.error("--parts: choose convergence, throughput or both")
    return args


def run(args, name: str, overrides: list[str], console: Console,
        microbatches: int | None = None) -> dict[str, Any]:
    run_dir, log = args.out / name, args.out / f"{name}.log"
    console.print(f"{name}: running (log: {log})", markup=False, highlight=False)
    with CpuSampler() as cpu:
        code, wall = run_sdpipe([*overrides, f"run.dir={run_dir}"], log, args.timeout)
    status, error = classify(code, log, args.timeout)
    record = {"name": name, "overrides": overrides, "status": status, "error": error,
              "wall_s": round(wall, 1), "cpu_percent": None if cpu.mean is None else round(cpu.mean)}
    if status == "ok":
        lines = analysis.read_metrics(run_dir / "metrics.jsonl")
        record.update(
            final_val_loss=analysis.final_val_loss(lines),
            samples_per_s=analysis.samples_per_s(lines),
            mean_group=analysis.mean_group_size(lines),
            overrun_fraction=(analysis.overrun_fraction(lines, microbatches)
                              if microbatches else None),
            stash_peak_bytes=max((ln.get("stash_peak_bytes", 0)
                                  for ln in analysis.of_kind(lines, "done")), default=0))
    console.print(f"  {status} in {wall:.1f} s" + (f": {error}" if error else ""), markup=False,
                  highlight=False)
    return record


def convergence(args, console: Console) -> dict[str, Any]:
    runs = convergence_runs()
    records = [run(args, f"conv-{i}", [*o, f"train.steps={args.steps}"], console)
               for i, (_, o) in enumerate(runs)]
    for (label, _), r in zip(runs, records):
        r["label"] = label
    ref = records[0].get("final_val_loss")
    for r in records:
        loss = r.get("final_val_loss")
        r["vs_reference"] = loss / ref if loss is not None and ref else None
    return {"steps": args.steps, "runs": records}


def throughput_part(args, console: Console) -> dict[str, Any]:
    groups = []
    for P, sync, m, variants in THROUGHPUT:
        common = ["model=mlp", "data=synthetic", f"cluster.pipelines={P}",
                  f"pipeline.stages={STAGES}", f"pipeline.microbatches={m}",
                  f"train.batch_size={m * MICROBATCH_SAMPLES}", f"sync={sync}",
                  f"train.steps={args.throughput_steps}", "train.eval_every=0",
                  f"cluster.compute_ms={args.compute_ms:g}", "cluster.device=cpu"]
        records = []
        for label, overrides in variants:
            name = f"tput-P{P}-{sync}-m{m}-{label.replace(' ', '-')}"
            r = run(args, name, [*common, *overrides], console, microbatches=m)
            r["label"] = label
            records.append(r)
        flushed = records[0].get("samples_per_s")
        for r in records:
            sps = r.get("samples_per_s")
            r["speedup"] = sps / flushed if sps and flushed else None
            r["saved"] = 1 - flushed / sps if sps and flushed else None
        groups.append({"pipelines": P, "sync": sync, "microbatches": m, "stages": STAGES,
                       "bubble": (STAGES - 1) / (m + STAGES - 1),
                       "expected_speedup": (m + STAGES - 1) / m, "runs": records})
    return {"steps": args.throughput_steps, "compute_ms": args.compute_ms, "groups": groups}


def markdown(results: dict[str, Any]) -> str:
    out = []
    conv = results.get("convergence")
    if conv:
        out += [f"**(a) Convergence at equal samples: gpt_tiny, stdlib, P=2, S=2, m=4, "
                f"{conv['steps']} steps per pipeline (real compute)**", "",
                "| run | status | final val loss | vs reference | mean group | samples/s | "
                "stash peak (kB) | wall (s) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in conv["runs"]:
            out.append(f"| {r['label']} | {r['status']} | {_report.loss(r.get('final_val_loss'))} | "
                       f"{_report.num(r.get('vs_reference'), '.3f')} | "
                       f"{_report.num(r.get('mean_group'), '.2f')} | "
                       f"{_report.rate(r.get('samples_per_s'))} | "
                       f"{_report.num((r.get('stash_peak_bytes') or 0) / 1024, '.0f')} | {r['wall_s']} |")
        out.append("")
        for r in conv["runs"]:
            if "async_1f1b" in r["label"] and "sdpipe" in r["label"]:
                ratio = r.get("vs_reference")
                verdict = "-" if ratio is None else ("yes" if ratio <= TARGET else "no")
                out.append(f"- {r['label']} within 5 % of the reference: {verdict} "
                           f"({_report.num(ratio, '.3f')}x)")
        out.append("")
    tput = results.get("throughput")
    if tput:
        out += [f"**(b) Throughput: mlp, S={STAGES}, compute {tput['compute_ms']:g} ms per forward "
                f"(backward 2x), {tput['steps']} steps, no evaluation until the end**", "",
                "| P | sync | m | schedule | status | samples/s | speedup | expected | saved | "
                "bubble | CPU % | overruns | wall (s) |",
                "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for g in tput["groups"]:
            for r in g["runs"]:
                out.append(
                    f"| {g['pipelines']} | {g['sync']} | {g['microbatches']} | {r['label']} | "
                    f"{r['status']} | {_report.rate(r.get('samples_per_s'))} | "
                    f"{_report.num(r.get('speedup'), '.2f')}x | {_report.ratio(g['expected_speedup'])} | "
                    f"{_report.num(None if r.get('saved') is None else 100 * r['saved'], '.0f')}% | "
                    f"{_report.percent(g['bubble'], 0)} | {_report.num(r.get('cpu_percent'), '.0f')} | "
                    f"{_report.percent(r.get('overrun_fraction'))} | "
                    f"{r['wall_s']} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    taken = args.out.exists() and any(args.out.iterdir())
    if taken:
        console.print(f"bench_async: error: {args.out} is not empty; choose another --out",
                      markup=False, highlight=False)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": _report.command_line(),
                               "environment": _report.environment()}
    if "convergence" in args.parts:
        results["convergence"] = convergence(args, console)
    if "throughput" in args.parts:
        results["throughput"] = throughput_part(args, console)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    env = results["environment"]
    text = (f"```\n$ {results['command']}\n```\n\nPython {env['python']}, torch {env['torch']}, "
            f"{env['cpus']} CPUs.\n\n" + markdown(results))
    (args.out / "results.md").write_text(text)
    print(text)
    if args.markdown is not None:
        console.print(f"markdown: {_report.write_markdown(args.markdown, markdown(results))}",
                      markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
