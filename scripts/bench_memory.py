"""Per pipeline stage: the memory and the samples/s of activation checkpointing and of bf16.

Run it from the repository root after ``pip install -e '.[hf]'``::

    python scripts/bench_memory.py                          # gpt2, S = 4, 1 round of 6-step runs
    python scripts/bench_memory.py --model bert_base --pairs 3 --steps 20 --out runs/bench-memory
    python scripts/bench_memory.py --stages 2 --seq-len 32 --no-runs          # memory only, a smoke test
    python scripts/bench_memory.py --stages 2 --seq-len 32 --steps 2 --pairs 1   # with real runs

Four combinations: ``train.precision`` fp32 or bf16, each with
``pipeline.activation_checkpointing`` false and true. One JSON object is printed.

**Memory (in this process, no training).** On the CPU the process's RSS does not show the
activation peak inside an iteration (the allocator keeps freed pages, and the peak is transient),
so this measures what checkpointing and precision change: the bytes the autograd graph keeps
for the backward. For each stage ``s`` it builds the stage's module (``build_stage_module``, the
partition resolved by ``preparing.prepare``), makes one micro-batch's real input (stage 0: token
ids of the synthetic corpus; stage ``s > 0``: the earlier stages' output, computed under
``no_grad`` in the same precision, cast to the wire dtype as a received message is, then
``requires_grad_()``), and runs ONE forward the way ``Executor.forward`` does: the two lines
that wrap it (``torch.autocast`` when the precision is low, ``checkpoint(run, x,
use_reentrant=False)`` when checkpointing, and the loss on the last stage inside autocast) are
replicated here, because the executor itself needs a link to its neighbours. The forward runs
under ``torch.autograd.graph.saved_tensors_hooks``, whose pack hook records the storage of every
saved tensor (deduplicated by ``untyped_storage().data_ptr()``, counted by its ``nbytes()``):

* a storage of one of the module's parameters is not counted (it is static memory);
* a low-precision copy of a parameter that autocast made and the graph saved (``ToCopyBackward0``,
  through views only, of a parameter) is counted apart, as ``weight_casts``: it lives as long as
  its micro-batch's graph, so each micro-batch in flight holds one;
* every other storage is ``saved``: the activations proper.

To those it adds ``held``: what the executor keeps for the backward beyond the graph, if the hook
did not see it already: the stage's input, its output and the packed send buffer (kept until the
micro-batch's gradient comes back). The sum is the stage's memory per micro-batch in flight; under
1F1B stage ``s`` of ``S`` keeps at most ``min(S - s, m)`` micro-batches in flight, so that times
the per-micro-batch bytes is its activation peak. ``static`` is the stage's parameters, their
gradients and AdamW's two moments, all fp32 in every combination (bf16 is autocast: weights and
optimizer state stay fp32). ``total = static + peak``. With checkpointing, that peak leaves out
the recompute: the micro-batch whose backward runs rebuilds its whole graph, so
``peak_recompute = (in_flight - 1) x ckpt-on bytes + 1 x ckpt-off bytes`` (the same as ``peak``
without checkpointing), and ``total_recompute`` with it; the ratios are given for both. On the
last stage (one micro-batch in flight) checkpointing then saves nothing.

What it leaves out: the allocator (fragmentation, cached blocks), temporaries that live only
inside one op or only during the backward (the gradients of activations; the recompute only
as the estimate above), the receive buffers of gradients and pending gradient sends, the
autograd nodes themselves, and the stash of tensors saved by a graph branch that is discarded
before the forward ends (counted here, since the hook keeps a reference). The saved tensors are
the CPU kernels' choices: on a GPU, ``scaled_dot_product_attention`` may pick a kernel that saves
less (no (T, T) attention weights). Where a GPU is visible, one real forward and backward per
stage and combination also reports ``torch.cuda.max_memory_allocated`` above the stage's static
memory (parameters and pre-allocated gradients), for one micro-batch.

**samples/s (real runs).** ``sdpipe train`` (P = 1, ``sync=allreduce``, ``data=synthetic``, on
the CPU), each combination in turn, ``--pairs`` rounds (the order rotates every round, so that a
change in the machine's load hits all alike). A run's samples/s comes from its ``metrics.jsonl``:
the samples of the steps after the first (warm-up) one over the time between the first and the
last step's lines, which leaves out start-up. The ratios are the medians over rounds of each
round's ratio. ``--no-runs`` skips this part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from _report import mib  # noqa: E402
from _runner import run_command  # noqa: E402

COMBOS = [(precision, ckpt) for precision in ("fp32", "bf16") for ckpt in (False, True)]
# autograd nodes that only view or cast their one input: a saved tensor reached from a parameter
# through these alone is a (cast) copy of that parameter, not an activation
VIEW_NODES = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
              "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "SliceBackward0", "SqueezeBackward0",
              "UnsqueezeBackward0", "ReshapeAliasBackward0"}
# the ratios' names and the fields they divide
RATIO_FIELDS = (("activations", "peak_mb"), ("total", "total_mb"),
                ("activations_recompute", "peak_recompute_mb"), ("total_recompute", "total_recompute_mb"))


def key(precision: str, ckpt: bool) -> str:
    return f"{precision}/ckpt_{'on' if ckpt else 'off'}"


def overrides(args: argparse.Namespace, precision: str, ckpt: bool) -> list[str]:
    """The run's overrides: the same for the memory part and the real runs."""
    extra = ["model.vocab_size=50257"] if args.model == "gpt2" else []
    if getattr(args, "layers", None):
        extra.append(f"model.n_layers={args.layers}")
    return [f"model={args.model}", *extra, f"model.seq_len={args.seq_len}", "data=synthetic",
            "sync=allreduce", "cluster.pipelines=1", f"pipeline.stages={args.stages}",
            f"train.batch_size={args.batch}", f"pipeline.microbatches={args.microbatches}",
            f"train.steps={args.steps}", "train.eval_every=0", "cluster.device=cpu",
            f"train.precision={precision}", f"pipeline.activation_checkpointing={str(ckpt).lower()}"]


def prepared(args: argparse.Namespace, precision: str = "fp32", ckpt: bool = False):
    from sdpipe_cli.cli import preparing
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.validation import validate

    cfg = compose(overrides(args, precision, ckpt))
    validate(cfg)
    return preparing.prepare(cfg)[0]


# -- memory ---------------------------------------------------------------------------------------

def low_dtype(precision: str):
    import torch

    return {"fp32": None, "bf16": torch.bfloat16}[precision]


def precision_context(device: str, low):
    import torch

    return nullcontext() if low is None else torch.autocast(device, dtype=low)


def tensors_of(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


def as_received(value, low, device: str):
    """An earlier stage's output as the next stage receives it: floats in the wire dtype, on
    ``device``, differentiable (a received activation)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to(device)
        if t.is_floating_point():
            t = t.to(low or t.dtype).clone().requires_grad_()
        return t
    if isinstance(value, dict):
        return {k: as_received(v, low, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(as_received(v, low, device) for v in value)
    return value


def stage_inputs(modules, x, low, device: str) -> list:
    """Each stage's input for micro-batch ``x``: the earlier stages' forward under no_grad."""
    import torch

    inputs, value = [x.to(device)], x.to(device)
    with torch.no_grad():
        for module in modules[:-1]:
            with precision_context(device, low):
                value = module(value)
            value = as_received(value, low, device)
            inputs.append(value)
    return inputs


def forward(module, x, target, loss_fn, last: bool, low, ckpt: bool, device: str):
    """One forward as ``Executor.forward`` runs it (autocast, checkpoint, the loss inside both)."""
    from torch.utils.checkpoint import checkpoint

    def run(v):
        return module(v)

    with precision_context(device, low):
        y = checkpoint(run, x, use_reentrant=False) if ckpt else run(x)
        if last:
            y = loss_fn(y, target)
    return y


def parameter_copy(t, param_ids: set) -> bool:
    """Whether ``t`` is a parameter reached through casts and views only (autocast's copy)."""
    node, hops = t.grad_fn, 0
    while node is not None and hops < 8:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return id(node.variable) in param_ids
        if name not in VIEW_NODES:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node, hops = nexts[0], hops + 1
    return False


def saved_bytes(module, x, target, loss_fn, last: bool, low, ckpt: bool) -> dict:
    """Bytes per micro-batch of one forward: ``saved``, ``weight_casts`` and ``held``."""
    import torch

    params = list(module.parameters())
    param_ids = {id(p) for p in params}
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[str, int]] = {}
    keep = []  # storages stay alive until the end, so a data_ptr is never reused meanwhile

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen:
            kind = ("param" if ptr in param_storages else
                    "weight_casts" if parameter_copy(t, param_ids) else "saved")
            seen[ptr] = (kind, storage.nbytes())
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(module, x, target, loss_fn, last, low, ckpt, "cpu")
    out = {"saved": 0, "weight_casts": 0, "held": 0}
    for kind, n in seen.values():
        if kind != "param":
            out[kind] += n
    for t in tensors_of(x) + tensors_of(y):  # the input and the output the executor keeps
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in param_storages:
            seen[ptr] = ("held", t.untyped_storage().nbytes())
            out["held"] += t.untyped_storage().nbytes()
    if not last:  # the packed send buffer, kept until the gradient comes back
        out["held"] += sum(t.numel() * (torch.empty((), dtype=low).element_size()
                                        if low is not None and t.is_floating_point() else t.element_size())
                           for t in tensors_of(y))
    return out


def static_bytes(module) -> int:
    """Parameters, gradients and AdamW's two moments, each the parameters' size (fp32)."""
    return 4 * sum(p.numel() * p.element_size() for p in module.parameters())


def microbatch(cfg, mb: int):
    from sdpipe_cli.data.loader import Loader
    from sdpipe_cli.data.sampling import Order
    from sdpipe_cli.data.sources import open_splits

    train = open_splits(cfg).train
    batch = Loader(train, Order(len(train), 0, 1, int(cfg.train.seed)), mb).get(0)
    return batch.inputs, batch.targets


def ratio(a: float, b: float):
    return round(a / b, 3) if b else None


def add_recompute(st: dict) -> None:
    """The peak counting checkpointing's recompute: the micro-batch in its backward rebuilds its
    whole graph (the ckpt-off bytes) while the other ``in_flight - 1`` hold the ckpt-on bytes."""
    k = st["in_flight"]
    for precision in ("fp32", "bf16"):
        off, on = st[key(precision, False)], st[key(precision, True)]
        off["peak_recompute_mb"] = off["peak_mb"]
        on["peak_recompute_mb"] = round((k - 1) * on["per_microbatch_mb"] + off["per_microbatch_mb"], 2)
        for c in (off, on):
            c["total_recompute_mb"] = round(c["peak_recompute_mb"] + st["static_mb"], 2)


def stage_ratios(combos: dict) -> dict:
    """ckpt on/off at each precision and bf16/fp32 at each checkpointing, of peak and total."""
    def both(a: str, b: str) -> dict:
        return {name: ratio(combos[a][field], combos[b][field]) for name, field in RATIO_FIELDS}

    return {"ckpt_on_over_off": {p: both(key(p, True), key(p, False)) for p in ("fp32", "bf16")},
            "bf16_over_fp32": {f"ckpt_{c}": both(key("bf16", c == "on"), key("fp32", c == "on"))
                               for c in ("off", "on")}}


def memory(args: argparse.Namespace) -> dict:
    import torch

    from sdpipe_cli.core.partition import stage_ranges
    from sdpipe_cli.model import models

    cfg = prepared(args)
    S, m = args.stages, args.microbatches
    mb = args.batch // m
    modules = [models.build_stage_module(cfg, s).train() for s in range(S)]
    loss_fn = models.loss_function(cfg.model)
    x, target = microbatch(cfg, mb)
    ranges = stage_ranges(list(cfg.pipeline.partition), models.count_blocks(cfg.model))
    stages = [{"stage": s, "blocks": list(ranges[s]), "in_flight": min(S - s, m),
               "static_mb": mib(static_bytes(modules[s]))} for s in range(S)]
    for precision in ("fp32", "bf16"):
        low = low_dtype(precision)
        inputs = stage_inputs(modules, x, low, "cpu")
        for ckpt in (False, True):
            for s, module in enumerate(modules):
                got = saved_bytes(module, inputs[s], target, loss_fn, s == S - 1, low, ckpt)
                per_mb = sum(got.values())
                peak = per_mb * stages[s]["in_flight"]
                stages[s][key(precision, ckpt)] = {
                    **{f"{k}_mb": mib(v) for k, v in got.items()},
                    "per_microbatch_mb": mib(per_mb), "peak_mb": mib(peak),
                    "total_mb": round(peak / _report.MIB + stages[s]["static_mb"], 2)}
                module.zero_grad(set_to_none=True)
        del inputs
    for st in stages:
        add_recompute(st)
        st["ratios"] = stage_ratios(st)
    worst = {key(p, c): {field: max(st[key(p, c)][field] for st in stages) for _, field in RATIO_FIELDS}
             for p, c in COMBOS}
    out = {"microbatch": mb, "stages": stages, "max_over_stages": worst,
           "ratios_max_over_stages": stage_ratios(worst)}
    if torch.cuda.is_available():
        out["cuda"] = cuda_peaks(modules, x, target, loss_fn)
    return out


def cuda_peaks(modules, x, target, loss_fn) -> dict:
    """Per stage and combination: max_memory_allocated of one real forward and backward on the
    GPU, above the module and its (pre-allocated) gradients, in MB."""
    import torch

    device, S, out = "cuda", len(modules), {}
    target = target.to(device)
    for precision, ckpt in COMBOS:
        low = low_dtype(precision)
        inputs = stage_inputs([mod.to(device) for mod in modules], x, low, device)
        peaks = []
        for s, module in enumerate(modules):
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = forward(module, inputs[s], target, loss_fn, s == S - 1, low, ckpt, device)
            outs = [t for t in tensors_of(y) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            torch.cuda.synchronize()
            peaks.append(mib(torch.cuda.max_memory_allocated() - base))
            del y, outs
            module.zero_grad(set_to_none=True)
        out[key(precision, ckpt)] = peaks
        del inputs
    for mod in modules:
        mod.to("cpu")
    torch.cuda.empty_cache()
    return {"peak_above_static_mb_per_stage": out, "device": torch.cuda.get_device_name()}


# -- samples/s ----------------------------------------------------------------------------------------

def samples_per_s(run_dir: Path, batch: int) -> float:
    """Samples after the first step over the time from the first to the last step's line: the
    (only) pipeline's solo rate (``sdpipe_cli.analysis``); ``batch`` is in its
    ``samples``."""
    from sdpipe_cli import analysis

    rates = analysis.solo_rates(analysis.read_metrics(run_dir / "metrics.jsonl"))
    if 0 not in rates:
        raise SystemExit(f"{run_dir}: fewer than 2 timed steps in metrics.jsonl; use --steps >= 2")
    return rates[0]


def run(args: argparse.Namespace, precision: str, ckpt: bool) -> float:
    run_dir = args.out / f"{args.model}-{precision}-ckpt{int(ckpt)}-{time.monotonic_ns()}"
    done = run_command("train", [f"run.dir={run_dir}", *overrides(args, precision, ckpt)], None,
                       args.timeout)
    done.check(f"run {' '.join(done.command)}", chars=2000)
    return samples_per_s(run_dir, args.batch)


def runs(args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    rates: dict[str, list[float]] = {key(p, c): [] for p, c in COMBOS}
    for r in range(args.pairs):
        for precision, ckpt in COMBOS[r % len(COMBOS):] + COMBOS[:r % len(COMBOS)]:
            rates[key(precision, ckpt)].append(run(args, precision, ckpt))

    def median_ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(rates[a], rates[b])), 3)

    return {"samples_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "median_samples_per_s": {k: round(statistics.median(v), 2) for k, v in rates.items()},
            "median_ratios": {
                "ckpt_on_over_off": {p: median_ratio(key(p, True), key(p, False)) for p in ("fp32", "bf16")},
                "bf16_over_fp32": {f"ckpt_{c}": median_ratio(key("bf16", c == "on"), key("fp32", c == "on"))
                                   for c in ("off", "on")}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "bert_base"), default="gpt2")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="train.batch_size")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline.microbatches")
    parser.add_argument("--steps", type=int, default=6, help="train.steps of each run (>= 2)")
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the four runs")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--no-runs", action="store_true", help="memory only: start no training")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-memory"))
    args = parser.parse_args()
    if args.batch % args.microbatches:
        parser.error("--batch must be a multiple of --microbatches")
    result = {"model": args.model, "stages": args.stages, "seq_len": args.seq_len, "batch": args.batch,
              "microbatches": args.microbatches, "memory": memory(args)}
    if not args.no_runs:
        result["runs"] = {"steps": args.steps, "pairs": args.pairs, **runs(args)}
    print(json.dumps({"measured": _report.stamp(), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
