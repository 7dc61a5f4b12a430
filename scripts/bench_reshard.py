"""Resume a run on other layouts and show that training goes on where it was.

Trains one run (default: gpt_tiny, sync=sdpipe, P=4, S=2) to the end with a checkpoint halfway,
then, for each target layout, copies the run, drops the checkpoints after the halfway one, and
``sdpipe resume``s it on that layout (the checkpoint is resharded). Per layout it reports:

* the loss of the first resumed iterations against the saved run's last ones before the
  checkpoint (mean and spread) and the uninterrupted run's next ones;
* the samples trained in all, against the run's budget (``P x train.steps x batch``);
* the final validation loss against the uninterrupted run's.

    python scripts/bench_reshard.py --steps 200 --markdown docs/results/reshard.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_markdown_option, loss, rows_table, write_markdown  # noqa: E402  (siblings)
from _runner import Run, run_command  # noqa: E402

LAYOUTS = {"P=3 S=3 [2,4]": ("cluster.pipelines=3", "pipeline.stages=3", "pipeline.partition=[2,4]"),
           "P=6 S=2": ("cluster.pipelines=6",),
           "P=4 S=2 (same)": ()}


def sdpipe(*args: str) -> Run:
    """``sdpipe ARGS``, output captured; SystemExit if it fails."""
    return run_command(args[0], args[1:], None, 3600).check()


def lines(run: Path) -> list[dict]:
    from sdpipe_cli import analysis

    return analysis.read_metrics(run / "metrics.jsonl")


def trains(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") == "train" and "loss" in r]


def final_val(rows: list[dict]) -> float:
    return [r for r in rows if r.get("kind") == "eval"][-1]["val_loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pipelines", type=int, default=4)
    parser.add_argument("--window", type=int, default=10, help="iterations compared each side")
    parser.add_argument("--sync", default="sdpipe")
    parser.add_argument("--extra", nargs="*", default=["model=gpt_tiny"])
    add_markdown_option(parser)
    args = parser.parse_args()
    half = args.steps // 2
    root = Path(tempfile.mkdtemp(prefix="bench-reshard-"))
    full = root / "full"
    t0 = time.time()
    sdpipe("train", f"run.dir={full}", f"sync={args.sync}", f"cluster.pipelines={args.pipelines}",
           "pipeline.stages=2", f"train.steps={args.steps}", f"checkpoint.every={half}",
           "checkpoint.keep=0", *args.extra)
    rows = lines(full)
    ckpts = sorted((full / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    source = min(ckpts, key=lambda p: abs(int(p.name.split("_")[1]) - half))
    manifest = json.loads((source / "manifest.json").read_text())
    at = {int(p): k for p, k in manifest["steps"].items()}
    bs = manifest["config"]["train"]["batch_size"]
    budget = args.pipelines * args.steps * bs
    before = [r["loss"] for r in trains(rows)
              if at[r["pipeline"]] - args.window < r["step"] <= at[r["pipeline"]]]
    after_ref = [r["loss"] for r in trains(rows)
                 if at[r["pipeline"]] < r["step"] <= at[r["pipeline"]] + args.window]
    table = [{"layout": f"P={args.pipelines} S=2, uninterrupted", "first resumed loss": statistics.mean(after_ref),
              "samples": budget, "budget": budget, "final val": final_val(rows)}]
    print(f"saved run: checkpoint {source.name} (iterations {at}); loss over the {args.window} "
          f"iterations before it: {loss(statistics.mean(before))} +- {loss(statistics.pstdev(before))}")
    for name, overrides in LAYOUTS.items():
        run = root / name.split()[0].replace("=", "") / "run"
        shutil.copytree(full, run)
        for ckpt in (run / "checkpoints").iterdir():
            if int(ckpt.name.split("_")[1]) > int(source.name.split("_")[1]):
                shutil.rmtree(ckpt)
        start = len(lines(run))
        out = sdpipe("resume", str(run), *overrides)
        resumed = lines(run)[start:]
        resume_line = next(r for r in resumed if r.get("kind") == "resume")
        begin = {int(p): k for p, k in resume_line["steps"].items()}
        first = [r["loss"] for r in trains(resumed) if r["step"] <= begin[r["pipeline"]] + args.window]
        done = {}
        for r in resumed:
            if r.get("kind") == "train":
                done[r["pipeline"]] = max(done.get(r["pipeline"], 0), r["samples"])
        table.append({"layout": name, "first resumed loss": statistics.mean(first),
                      "samples": sum(done.values()), "budget": budget,
                      "final val": final_val(resumed)})
        print(f"{name}: " + "; ".join(line for line in out.stderr.splitlines()
                                      if "resharded" in line or "warning" in line))
    body = (f"Saved run: {args.sync}, P={args.pipelines}, S=2, {args.steps} steps, "
            f"{' '.join(args.extra)}; checkpoint {source.name}. Loss over the {args.window} "
            f"iterations before it: {loss(statistics.mean(before))} (sd {loss(statistics.pstdev(before))}); "
            f"'first resumed loss': mean over each pipeline's first {args.window} iterations "
            f"after it.\n\n" + rows_table(table))
    print(body)
    print(f"({time.time() - t0:.0f} s; runs in {root})")
    if args.markdown:
        write_markdown(args.markdown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
