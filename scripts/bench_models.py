"""The built-in models end to end: every model under every sync mode and schedule, and the
accuracy an image model reaches on real data.

Run it from the repository root after ``pip install -e '.[hf,digits]'``::

    python scripts/bench_models.py matrix --out runs/bench-models      # 6 models: 5 syncs, 3 schedules
    python scripts/bench_models.py matrix --models bert_tiny --steps 2  # a smoke test
    python scripts/bench_models.py digits --out runs/bench-digits      # ResNet-20 on the digits
    python scripts/bench_models.py mlm --out runs/bench-mlm            # bert_tiny on the default corpus

**matrix.** ``sdpipe train`` with P = 2, S = 2, a few iterations of each built-in model (the
ResNets on ``data=digits``, the transformers on byte text) under each ``sync`` mode and each
``pipeline.schedule`` (each mode under 1F1B and each schedule under sdpipe; ``--cross``: every
pair), batches of 4 in 2 micro-batches; a row per run: exit code, first and last
loss, seconds. The models are the real sizes (GPT-2 124M, BERT-base 110M; sequences of 32 tokens
here), so a run of those costs tens of seconds on a CPU.
Tied embeddings need a flushed schedule, so under ``async_1f1b`` the transformers run with
``model.tie_embeddings=false``.

**digits.** ``model=resnet_cifar data=digits train=digits``, P = 2, S = 2, with ``sync=allreduce``
and ``sync=sdpipe``, evaluating every 10 iterations: the time (run clock, from ``metrics.jsonl``)
at which pipeline 0 first reached ``--target`` validation accuracy, and the last accuracy.

**mlm.** ``model=bert_tiny`` (masked LM) on ``data=stdlib``, P = 2, S = 2, sdpipe: the training
loss over the first and the last tenth of the run, and the validation loss at the start and end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _runner import run_command  # noqa: E402

MODELS = {
    "resnet_cifar": ["model=resnet_cifar", "data=digits", "train.optimizer=sgd", "train.lr=0.05"],
    "bert_tiny": ["model=bert_tiny", "data=stdlib"],
    "resnet18": ["model=resnet18", "data=digits", "train.optimizer=sgd", "train.lr=0.05"],
    "resnet50": ["model=resnet50", "data=digits", "train.optimizer=sgd", "train.lr=0.05"],
    "gpt2": ["model=gpt2", "data=stdlib", "model.seq_len=32", "train.lr=3e-4"],
    "bert_base": ["model=bert_base", "data=stdlib", "model.seq_len=32", "train.lr=1e-4"],
}
SYNCS = ["sdpipe", "allreduce", "ps", "adpsgd", "none"]
SCHEDULES = ["1f1b", "gpipe", "async_1f1b"]


def train(run_dir: Path, *overrides: str,
          timeout: float = 1800) -> tuple[int | None, float, list[str]]:
    """(exit code, None past ``timeout``; seconds; the last line of its stderr, or the timeout)."""
    done = run_command("train", [f"run.dir={run_dir}", "cluster.device=cpu", *overrides], None,
                       timeout)
    tail = [done.status] if done.timed_out else done.stderr.strip().splitlines()[-1:]
    return done.returncode, done.wall_s, tail


def lines(run_dir: Path, kind: str) -> list[dict]:
    from sdpipe_cli import analysis

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return analysis.of_kind(analysis.read_metrics(path), kind)


def combinations(args) -> list[tuple[str, str]]:
    """(sync, schedule) pairs: every sync mode under 1F1B and every schedule under sdpipe, or
    (``--cross``) every pair."""
    if args.cross:
        return [(sync, schedule) for sync in args.syncs for schedule in args.schedules]
    pairs = [(sync, "1f1b") for sync in args.syncs]
    return pairs + [("sdpipe", s) for s in args.schedules if ("sdpipe", s) not in pairs]


def matrix(args) -> list[dict]:
    rows = []
    for model in args.models:
        for sync, schedule in combinations(args):
            extra = ["model.tie_embeddings=false"] if (
                schedule == "async_1f1b" and model in ("gpt2", "bert_tiny", "bert_base")) else []
            run_dir = args.out / f"{model}-{sync}-{schedule}"
            rc, seconds, tail = train(run_dir, *MODELS[model], *extra, f"sync={sync}",
                                      f"pipeline.schedule={schedule}", f"train.steps={args.steps}",
                                      "train.batch_size=4", "pipeline.microbatches=2",
                                      "train.eval_every=0", "data.eval_batches=1", "train.warmup=1")
            losses = [m["loss"] for m in lines(run_dir, "train") if "loss" in m]
            row = {"model": model, "sync": sync, "schedule": schedule, "rc": rc,
                   "first_loss": losses[0] if losses else None,
                   "last_loss": losses[-1] if losses else None, "seconds": round(seconds, 1)}
            if rc != 0:
                row["error"] = tail
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def digits(args) -> list[dict]:
    rows = []
    for sync in ("allreduce", "sdpipe"):
        run_dir = args.out / f"digits-{sync}"
        rc, seconds, tail = train(run_dir, "model=resnet_cifar", "data=digits", "train=digits",
                                  f"sync={sync}", "train.eval_every=10", f"train.seed={args.seed}")
        evals = [m for m in lines(run_dir, "eval") if m["pipeline"] == 0]
        reached = next((m for m in evals if m["val_accuracy"] >= args.target), None)
        row = {"sync": sync, "rc": rc, "wall_s": round(seconds, 1),
               "target": args.target, "reached_at_s": reached and round(reached["time"], 1),
               "reached_at_step": reached and reached["step"],
               "final_val_accuracy": evals[-1]["val_accuracy"] if evals else None,
               "final_val_loss": evals[-1]["val_loss"] if evals else None}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def mlm(args) -> list[dict]:
    run_dir = args.out / "bert_tiny-mlm"
    rc, seconds, _ = train(run_dir, "model=bert_tiny", "data=stdlib", f"train.steps={args.steps}",
                           "train.eval_every=50")
    losses = [m["loss"] for m in lines(run_dir, "train") if "loss" in m]
    tenth = max(1, len(losses) // 10)
    evals = [m["val_loss"] for m in lines(run_dir, "eval") if m["pipeline"] == 0]
    row = {"rc": rc, "wall_s": round(seconds, 1), "first_tenth_loss": sum(losses[:tenth]) / tenth,
           "last_tenth_loss": sum(losses[-tenth:]) / tenth, "val_losses": evals}
    print(json.dumps(row), flush=True)
    return [row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["matrix", "digits", "mlm"])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-models"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--syncs", nargs="+", default=SYNCS, choices=SYNCS)
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--cross", action="store_true",
                        help="matrix: every sync mode under every schedule (default: each sync "
                        "mode under 1F1B, each schedule under sdpipe)")
    parser.add_argument("--steps", type=int, default=None, help="matrix: 3; mlm: 300")
    parser.add_argument("--target", type=float, default=0.9, help="digits: validation accuracy")
    parser.add_argument("--seed", type=int, default=0)
    _report.add_markdown_option(parser)
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.what == "matrix" else 300)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {"matrix": matrix, "digits": digits, "mlm": mlm}[args.what](args)
    (args.out / f"{args.what}.json").write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(f"markdown: {_report.write_markdown(args.markdown, _report.rows_table(rows))}")
    failed = [r for r in rows if r["rc"] != 0]
    print(f"{len(rows) - len(failed)} ok, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
