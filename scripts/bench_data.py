"""The share of a training step that a stage spends waiting for its data, for images and tokens.

Run it from the repository root after ``pip install -e '.[test]'``::

    python scripts/bench_data.py                    # images and tokens, default settings, 30 steps
    python scripts/bench_data.py --batch 64         # bigger batches: four times the images a step
    python scripts/bench_data.py --steps 10 --images 200 --out /tmp/bd   # a smoke test

The claim it checks: with the data loader at its default settings, a reading stage (the first,
which needs the inputs, or the last, which needs the targets) waits for data less than 5 % of a
step when the step's compute is GPU-like (``cluster.compute_ms=20``: each micro-batch's forward
takes 20 ms and its backward 40 ms, modelled; the real compute runs inside that budget).

**What runs** (each an ``sdpipe train`` of ``--steps`` iterations at the defaults otherwise:
P = 2 pipelines, S = 2 stages, m = 4 micro-batches, ``--batch`` samples per iteration):

* ``images``: ``data=imagefolder`` on ``--images`` JPEGs of 400x300 pixels in 10 class folders,
  written here (smooth gradients plus noise, so that decoding costs what a photograph's does);
  ImageNet's training transform to 224x224 (decode, random resized crop, flip, normalise) in the
  default number of background processes; the model a two-block convolutional classifier
  (``model=custom``), cheap enough that its real compute fits in the modelled 20 ms;
* ``images, no workers``: the same with ``data.num_workers=0`` (decoding in the training
  process), to show what the background processes buy;
* ``tokens``: ``data=tokens`` on the standard library's sources (the first 2 MB) prepared with
  ``sdpipe prepare text stdlib --tokenizer bpe:4096``; ``model=gpt_tiny``, memory-mapped windows,
  default settings (no background process).

**What is measured.** Every reading stage reports ``data_s`` (seconds it blocked for its batch)
and ``step_s`` (its iteration) per iteration in ``metrics.jsonl`` (``kind`` ``train`` for the
last stage, ``data`` for the first). The share is sum(data_s) / sum(step_s) over iterations after
the first ``--skip`` (the background processes' start), per reading stage; the table shows the
largest over stages and pipelines.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ms, percent, rows_table, write_markdown  # noqa: E402
from _runner import run_command  # noqa: E402

TINY_CLASSIFIER = '''
    """Two blocks cheap enough for a CPU to stay within a 20 ms modelled forward."""
    from torch import nn

    def build(num_classes=10):
        return nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 7, stride=8), nn.ReLU()),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)))
'''


def write_images(root: Path, count: int, classes: int = 10) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:300, 0:400]
    for i in range(count):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        base = np.stack([(xs * (c + 1) + ys * (i % 7) + 40 * c) % 256 for c in range(3)], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def sdpipe(*args: str, env: dict | None = None, timeout: float = 900) -> None:
    """``sdpipe ARGS`` (``env`` added to the environment); SystemExit if it fails."""
    run_command(args[0], args[1:], None, timeout, env=env).check(f"sdpipe {' '.join(args[:3])} ...")


def share(run: Path, skip: int) -> dict:
    waits: dict[tuple, list[float]] = {}
    from sdpipe_cli import analysis

    for m in analysis.read_metrics(run / "metrics.jsonl"):
        if "data_s" not in m or m["step"] <= skip:
            continue
        key = (m["pipeline"], m.get("stage", "last"))
        totals = waits.setdefault(key, [0.0, 0.0, 0])
        totals[0] += m["data_s"]
        totals[1] += m["step_s"]
        totals[2] += 1
    worst = max(waits.values(), key=lambda t: t[0] / t[1])
    return {"step_ms": 1000 * worst[1] / worst[2], "data_ms": 1000 * worst[0] / worst[2],
            "share": worst[0] / worst[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="first iterations left out")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--out", help="keep the data and runs here (default: a temporary folder)")
    parser.add_argument("--markdown", help="also write the table here, stamped")
    args = parser.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_data-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "lib").mkdir(exist_ok=True)
    (root / "lib" / "tiny_classifier.py").write_text(textwrap.dedent(TINY_CLASSIFIER))
    env = {"PYTHONPATH": str(root / "lib")}
    t = time.time()
    if not (root / "images").exists():
        write_images(root / "images", args.images)
    if not (root / "tokens").exists():
        sdpipe("prepare", "text", "stdlib", "--out", str(root / "tokens"), "--tokenizer", "bpe:4096",
               "--max-bytes", "2000000")
    print(f"data written in {time.time() - t:.0f} s under {root}", file=sys.stderr)
    common = (f"train.steps={args.steps}", f"train.batch_size={args.batch}", "train.eval_every=0",
              f"cluster.compute_ms={args.compute_ms}", "checkpoint.every=0")
    images = ("model=custom", "model._target_=tiny_classifier.build", "data=imagefolder",
              f"data.path={root / 'images'}", "data.val_fraction=0.1")
    cases = [("images", images), ("images, no workers", (*images, "data.num_workers=0")),
             ("tokens", ("model=gpt_tiny", "data=tokens", f"data.path={root / 'tokens'}"))]
    rows = []
    for name, overrides in cases:
        run = root / "runs" / name.replace(", ", "-").replace(" ", "_")
        if run.exists():
            raise SystemExit(f"{run} exists; use a new --out")
        sdpipe("train", f"run.dir={run}", *common, *overrides, env=env)
        result = share(run, args.skip)
        config = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
        workers = config["data"]["num_workers"]
        rows.append({"data": name, "workers": "default" if workers is None else workers,
                     "step ms": ms(result["step_ms"], 0), "data wait ms": ms(result["data_ms"], 1),
                     "share": percent(result["share"], space=True)})
        print(f"{name}: {rows[-1]['share']} of a step", file=sys.stderr)
    table = rows_table(rows)
    print(table)
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
