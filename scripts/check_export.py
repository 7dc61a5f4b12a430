"""After training, end to end: train each kind of model pipeline-parallel, export it, load the export
with the library its users use, and compare three losses on the run's validation batches.

Run it from the repository root after ``pip install -e '.[test]'``::

    python scripts/check_export.py --out runs/check-export            # the four kinds, small
    python scripts/check_export.py --out runs/check-export-124m --gpt2-124m   # GPT-2 small's size

For each model (gpt2 on BPE token shards with the tokenizer sdpipe prepare trained, bert_tiny
masked LM on bytes, ResNet-20 on the digits, a user's model with a tied weight) it runs
``sdpipe train`` on P=2 pipelines of S=2 stages with sync=sdpipe and ``run.save_final=true``,
then ``sdpipe export`` and ``sdpipe eval`` (each a process of its own, as a user runs them), and
in this process loads the export as its users would: ``AutoModelForCausalLM`` /
``AutoModelForMaskedLM.from_pretrained`` (counting missing and unexpected keys), or the built
model with ``load_state_dict(strict=True)``. Its loss on the run's fixed validation batches
(the library's own forward, averaged per micro-batch as the run's eval averages) is compared with
the run's last ``eval`` record and with ``sdpipe eval``'s. ``--gpt2-124m`` also exports a
12-layer, 768-wide GPT-2 (124M parameters) after 2 iterations, and reports the export's time
and peak memory (``ru_maxrss`` of the export process, as for every export).

Prints one markdown table and writes ``results.json`` under ``--out`` (a new folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import megabytes, mib, rows_table  # noqa: E402  (sibling modules, not a package)
from _runner import Run, run_command  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMALL = ["cluster.pipelines=2", "pipeline.stages=2", "sync=sdpipe", "run.save_final=true",
         "train.eval_every=0"]
GPT2_SMALL = ["model=gpt2", "model.seq_len=32", "model.d_model=64", "model.n_layers=4",
              "model.n_heads=4", "model.d_hidden=256", "model.hf.n_positions=64"]
USER_NETS = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.emb = nn.Embedding(256, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.out = nn.Linear(width, 256, bias=False)
        self.out.weight = self.emb.weight  # tied
    def forward(self, ids):
        return self.out(self.body(self.emb(ids)))
    def pipeline_blocks(self):
        return [self.emb, self.body, self.out]

def build(width=32):
    return Net(width)
'''


def sdpipe(*args: str, env: dict | None = None) -> Run:
    """``sdpipe ARGS`` from the repository root (``env`` added to the environment), output
    captured; SystemExit if it fails."""
    return run_command(args[0], args[1:], None, 3600, cwd=REPO, env=env).check()


def last_eval(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == "eval"][-1]


def batches_of(run: Path):
    from sdpipe_cli.data import sources
    from sdpipe_cli.data.loader import evaluation_batches

    cfg = OmegaConf.load(run / "config.yaml")
    splits = sources.open_splits(cfg)
    return cfg, [(b.inputs, b.targets) for b in evaluation_batches(
        splits.val, sources.val_count(cfg), int(cfg.train.batch_size), int(cfg.train.seed))]


def library_loss(run: Path, forward) -> tuple[float, float | None]:
    """The loss (and accuracy) of ``forward`` on the run's validation batches, averaged per
    micro-batch then per batch, as the run's eval does."""
    cfg, batches = batches_of(run)
    m = int(cfg.pipeline.microbatches)
    per_batch, right, total = [], 0, 0
    with torch.no_grad():
        for x, y in batches:
            parts = []
            for xc, yc in zip(x.chunk(m), y.chunk(m)):
                logits = forward(xc)
                parts.append(float(F.cross_entropy(logits.flatten(0, -2), yc.flatten(),
                                                   ignore_index=-100)))
                counted = yc != -100
                right += int((logits.argmax(-1) == yc)[counted].sum())
                total += int(counted.sum())
            per_batch.append(sum(parts) / m)
    return sum(per_batch) / len(per_batch), right / total


def sdpipe_eval(export: Path, env=None) -> float:
    out = sdpipe("eval", str(export), env=env)
    line = next(x for x in out.stderr.splitlines() if x.startswith("eval: "))
    return float(line.split("val_loss ")[1].split()[0].rstrip(","))


# sdpipe's entry point in a process that reports its own peak memory as its last line: ``python -c
# PEAK COMMAND ARGS`` runs ``sdpipe COMMAND ARGS`` (the peak of that process, not of all this one's
# children, which RUSAGE_CHILDREN would give)
PEAK = ("import resource, runpy, sys\n"
        "sys.argv = ['sdpipe', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('sdpipe_cli', run_name='__main__')\n"
        "finally:\n    print('peak_rss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
        " file=sys.stderr)\n")


def exported(run: Path, export: Path, env=None) -> dict:
    out = run_command("export", [str(run), "--out", str(export)], None, 3600, cwd=REPO, env=env,
                      entry=(sys.executable, "-c", PEAK)).check(f"sdpipe export {run}")
    peak_kb = int(out.stderr.strip().splitlines()[-1].split()[-1])
    manifest = json.loads((export / "export.json").read_text())
    size = sum((export / f).stat().st_size for f in manifest["files"])
    return {"export_s": round(out.wall_s, 2), "mb": megabytes(size), "format": manifest["format"],
            "replicas": manifest["replicas"]["how"], "export peak MB": mib(peak_kb * 1024, None)}


def check_hf(name: str, run: Path, export: Path, masked: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    model, info = cls.from_pretrained(export, output_loading_info=True)
    model.eval()
    loss, _ = library_loss(run, lambda x: model(input_ids=x).logits)
    row = {"model": name, "loaded by": f"transformers.{cls.__name__}",
           "missing/unexpected": f"{len(info['missing_keys'])}/{len(info['unexpected_keys'])}",
           "library loss": loss}
    if not masked:
        ids = torch.tensor([[1, 2, 3]])
        row["generate"] = tuple(model.generate(ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=4, do_sample=False).shape)
    return row


def check_state_dict(name: str, run: Path, export: Path, model) -> dict:
    result = model.load_state_dict(torch.load(export / "model.pt", weights_only=True), strict=True)
    model.eval()
    loss, accuracy = library_loss(run, model)
    return {"model": name, "loaded by": f"{type(model).__name__}.load_state_dict(strict=True)",
            "missing/unexpected": f"{len(result.missing_keys)}/{len(result.unexpected_keys)}",
            "library loss": loss, "library accuracy": accuracy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gpt2-124m", action="store_true")
    args = parser.parse_args()
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=False)
    steps = f"train.steps={args.steps}"
    rows = []

    tokens = out / "tokens"
    sdpipe("prepare", "text", "stdlib", "--out", str(tokens), "--tokenizer", "bpe:512",
           "--max-bytes", "2000000")
    run = out / "gpt2"
    sdpipe("train", f"run.dir={run}", *SMALL, *GPT2_SMALL, steps, "model.vocab_size=512",
           "data=tokens", f"data.path={tokens}")
    info = exported(run, out / "gpt2-export")
    rows.append({**check_hf("gpt2 (BPE tokens)", run, out / "gpt2-export", masked=False), **info,
                 "run eval": last_eval(run)["val_loss"], "sdpipe eval": sdpipe_eval(out / "gpt2-export")})

    run = out / "bert"
    sdpipe("train", f"run.dir={run}", *SMALL, steps, "model=bert_tiny", "data=stdlib")
    info = exported(run, out / "bert-export")
    rows.append({**check_hf("bert_tiny (masked LM)", run, out / "bert-export", masked=True), **info,
                 "run eval": last_eval(run)["val_loss"], "sdpipe eval": sdpipe_eval(out / "bert-export")})

    from sdpipe_cli.model import resnet

    run = out / "resnet"
    sdpipe("train", f"run.dir={run}", *SMALL, "model=resnet_cifar", "data=digits", "train=digits",
           steps, "train.eval_every=0")
    info = exported(run, out / "resnet-export")
    row = check_state_dict("resnet_cifar (digits)", run, out / "resnet-export",
                           resnet.build("resnet_cifar", num_classes=10))
    rows.append({**row, **info, "run eval": last_eval(run)["val_loss"],
                 "run accuracy": last_eval(run)["val_accuracy"],
                 "sdpipe eval": sdpipe_eval(out / "resnet-export")})

    lib = out / "lib"
    lib.mkdir()
    (lib / "check_export_nets.py").write_text(USER_NETS)
    sys.path.insert(0, str(lib))
    env = {"PYTHONPATH": str(lib)}
    import check_export_nets

    run = out / "custom"
    sdpipe("train", f"run.dir={run}", *SMALL, steps, "model=custom", "data=stdlib",
           "model._target_=check_export_nets.build", "model.seq_len=32", env=env)
    info = exported(run, out / "custom-export", env=env)
    rows.append({**check_state_dict("a user's model (tied)", run, out / "custom-export",
                                    check_export_nets.build()), **info,
                 "run eval": last_eval(run)["val_loss"],
                 "sdpipe eval": sdpipe_eval(out / "custom-export", env=env)})

    if args.gpt2_124m:
        run = out / "gpt2-124m"
        sdpipe("train", f"run.dir={run}", *SMALL, "model=gpt2", "data=stdlib", "train.steps=2",
               "train.batch_size=4", "pipeline.microbatches=2", "model.seq_len=64")
        info = exported(run, out / "gpt2-124m-export")
        row = check_hf("gpt2 124M", run, out / "gpt2-124m-export", masked=False)
        rows.append({**row, **info, "run eval": last_eval(run)["val_loss"]})

    keys = ["model", "format", "replicas", "loaded by", "missing/unexpected", "run eval",
            "sdpipe eval", "library loss", "run accuracy", "library accuracy", "generate",
            "export_s", "mb", "export peak MB"]
    print(rows_table(rows, keys, float_format=".6f"), end="")
    worst = max(max(abs(r["library loss"] - r["run eval"]),
                    abs(r.get("sdpipe eval", r["run eval"]) - r["run eval"])) for r in rows)
    print(f"\nlargest difference from the run's last eval: {worst:.2e}")
    (out / "results.json").write_text(json.dumps({"rows": rows, "largest_difference": worst},
                                                 indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
