"""Validating a composed config: the cross-field checks that types alone cannot express.

Composition (:mod:`sdpipe_cli.config.composition`) has checked every key and type; what is left is
what depends on several settings (stages against the model's blocks, a batch against its
micro-batches, a sync mode against the schedule and the fault options, a cluster's nodes against
its placement) and on the machine's files (a data path, a profile). :func:`validate` runs them
section by section, so that a bad run stops before anything is written, with one
:class:`~sdpipe_cli.config.schema.ConfigError` naming the key. Each check is a :func:`need`:
the condition, the key and what to do instead. A sync mode's own settings are checked by its entry
in :data:`_SETTINGS_CHECKS`.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config import schema
from sdpipe_cli.config.checks import need
from sdpipe_cli.config.local_files import refuse_special
from sdpipe_cli.config.pipeline_checks import validate_pipeline
from sdpipe_cli.config.schema import ConfigError, emulation, n_blocks, num_classes, objective
from sdpipe_cli.config.yaml_bounds import MAX_ENTRIES
from sdpipe_cli.core.cluster import MAX_SLOWDOWN
from sdpipe_cli.core.meetings import SYNC_PRECISIONS
from sdpipe_cli.core.modes import mode, names_with
from sdpipe_cli.core.plan import microbatch_size

MIN_TIMEOUT_S = 1.0  # run.timeout, run.heartbeat_timeout
# run.timeout, run.heartbeat_timeout, sync.group_timeout: the store and the collectives take their
# timeouts as 32-bit milliseconds (24.8 days); 1e300 s failed in the workers or named the store
MAX_TIMEOUT_S = 1_000_000.0
MAX_DATA_WORKERS = 64  # data.num_workers per training worker: a billion filled the machine's memory
MAX_PREFETCH = 64  # data.prefetch: 10**9 queued batches kept every worker from its first step
# fp16's initial loss scale: torch's GradScaler and sdpipe start at 2**16; each halving from above
# is a skipped step (2**32: at most 16 more than the default's), and a gradient that needs more
# than 2**32 to leave fp16's subnormals is under 2e-17. 1e300 skipped every step of a run.
MAX_LOSS_SCALE = 2.0 ** 32
FLOAT32_MAX = 3.4028234663852886e38  # train.lr, sync.outer_lr: applied to float32 weights
SEED_RANGE = (-(2**63), 2**64 - 1)  # train.seed: what torch's generators take
MAX_SIMULATED = 1e6  # simulate.*: milliseconds, or jitter as a share of compute
MAX_BATCH = 2**40  # train.batch_size: beyond it, a batch's element count overflows int64 tensors
MAX_COMPUTE_MS = 60_000.0  # cluster.compute_ms: a minute; with MAX_SLOWDOWN, sleeps the clock can count
MAX_OVERLAP = 1000  # sync.overlap: a round merged later than its next meeting is merged there
# cluster.pipelines x pipeline.stages: one scheduler process takes every worker's ready signal each
# iteration (p99 2 ms at 256 workers, scripts/bench_scheduler.py), so a run 64x that is past what it
# serves; and the plan of a million workers took minutes and gigabytes to prepare before the
# memory check could refuse it (100,000 pipelines: 40 s and 0.7 GB)
MAX_WORKERS = 16_384
# model.n_layers: every worker builds and traces every block; 1,000 layers of the mlp took 30 s to
# start one step, 100,000 held 2 GB for minutes before any check could run
MAX_LAYERS = 1_024


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that types alone cannot express, section by section (the first bad
    setting found is the one reported). Raises :class:`ConfigError`."""
    m, d = cfg.model, cfg.data
    _validate_finite(OmegaConf.to_container(cfg, resolve=False), "")
    need(m.arch in schema.ARCHS, "model.arch", f"is '{m.arch}'; choose one of {', '.join(schema.ARCHS)}")
    need(d.name in schema.DATASETS, "data.name", f"is '{d.name}'; choose one of {', '.join(schema.DATASETS)}")
    _validate_model(cfg)
    _validate_data(cfg)
    _validate_cluster_settings(cfg)
    validate_pipeline(cfg)
    _validate_sync(cfg)
    _validate_train(cfg)
    _validate_checkpoint(cfg)
    _validate_fault(cfg)
    _validate_run(cfg)
    _validate_cluster(cfg)


# what the launcher writes (data.resolved, plan) and the arguments of a user's own code
_NOT_SETTINGS = {"data.resolved", "plan", "model.kwargs", "data.kwargs", "model.loss", "hydra"}


def _validate_finite(node: Any, path: str) -> None:
    """Every number a setting holds is finite: no setting means anything at inf or nan, and
    downstream each would fail far from its key (a timeout overflowing in a worker, a link cost
    of inf blamed on the host, a slow-down factor in the simulator)."""
    if path in _NOT_SETTINGS:
        return
    if isinstance(node, dict):
        for key, value in node.items():
            _validate_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _validate_finite(value, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(path, f"must be a finite number, got {node}")


def validate_data(cfg: DictConfig) -> None:
    """The ``data`` section alone (``sdpipe eval`` changes only it)."""
    _validate_data(cfg)


def _validate_data(cfg: DictConfig) -> None:
    """``data``: the data set, its path, split, evaluation, normalization and loader."""
    d = cfg.data
    if d.name == "text":
        need(bool(d.path), "data.path", "is required with data=text (a file or a folder of text)")
        need(Path(str(d.path)).expanduser().exists(), "data.path", f"'{d.path}' does not exist")
    if d.path:
        refuse_special(Path(str(d.path)).expanduser(), "data.path", "a file or a folder")
    need(d.name not in ("tokens", "imagefolder", "cifar10") or bool(d.path), "data.path",
         f"is required with data={d.name} (the data set's folder)")
    need(d.name != "custom" or bool(d.get("_target_")), "data._target_",
         "data=custom needs the callable that returns the Dataset: data._target_=PKG.MODULE.FN")
    need(d.max_bytes > 0, "data.max_bytes", "must be positive")
    need(0.0 < d.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
    need(d.eval_batches is None or d.eval_batches >= 1, "data.eval_batches", "must be at least 1 (or null)")
    need(d.image_size is None or d.image_size >= 1, "data.image_size", "must be at least 1 pixel")
    for key in ("mean", "std"):
        need(d[key] is None or len(d[key]) in (1, 3), f"data.{key}", "needs 1 or 3 values (per channel)")
    need(d.mean is None or d.std is None or len(d.mean) == len(d.std), "data.std",
         "needs as many values as data.mean")
    need(d.std is None or all(v > 0 for v in d.std), "data.std", "must be positive")
    need(d.num_workers is None or 0 <= d.num_workers <= MAX_DATA_WORKERS, "data.num_workers",
         f"is {d.num_workers}; must be in 0..{MAX_DATA_WORKERS} (loader processes per worker)")
    need(1 <= d.prefetch <= MAX_PREFETCH, "data.prefetch",
         f"is {d.prefetch}; must be in 1..{MAX_PREFETCH} (batches each loader process prepares ahead)")


def _validate_cluster_settings(cfg: DictConfig) -> None:
    """``cluster``'s own numbers (pipelines, slow-downs, modelled compute, device) and ``simulate``'s."""
    c = cfg.cluster
    need(c.pipelines >= 1, "cluster.pipelines", "must be at least 1")
    stages = max(1, cfg.pipeline.stages)
    need(c.pipelines * stages <= MAX_WORKERS, "pipeline.stages" if stages > c.pipelines else
         "cluster.pipelines", f"{c.pipelines:,} pipelines of {stages:,} stages are "
         f"{c.pipelines * stages:,} workers; sdpipe runs at most {MAX_WORKERS:,} (one scheduler "
         "process serves them all)")
    if len(c.slowdown) > 0:
        need(len(c.slowdown) == c.pipelines, "cluster.slowdown",
             f"has {len(c.slowdown)} factors for {c.pipelines} pipelines; give one per pipeline")
        need(all(1.0 <= f <= MAX_SLOWDOWN for f in c.slowdown), "cluster.slowdown",
             f"factors must be in [1, {MAX_SLOWDOWN:g}] (3.0 = three times slower), got "
             f"{list(c.slowdown)}")
    need(c.compute_ms is None or c.compute_ms > 0, "cluster.compute_ms", "must be positive ms")
    need(c.compute_ms is None or c.compute_ms <= MAX_COMPUTE_MS, "cluster.compute_ms",
         f"is {c.compute_ms} ms; a modelled micro-batch forward takes at most "
         f"{MAX_COMPUTE_MS:g} ms")
    need(c.device in schema.DEVICES, "cluster.device", f"is '{c.device}'; choose one of {', '.join(schema.DEVICES)}")
    need(len(c.changes) <= MAX_ENTRIES, "cluster.changes", f"has {len(c.changes):,} entries; a "
         f"schedule has at most {MAX_ENTRIES:,}")
    for key in ("rtt_ms", "event_ms", "collective_ms", "p2p_ms", "jitter"):
        need(0 <= cfg.simulate[key] <= MAX_SIMULATED, f"simulate.{key}",
             f"is {cfg.simulate[key]:g}; must be in [0, {MAX_SIMULATED:g}]")


def _validate_sync(cfg: DictConfig) -> None:
    """``sync``: the mode, its own settings, and the schedules it can run."""
    p = cfg.pipeline
    y = cfg.sync
    need(y.name in schema.SYNC_MODES, "sync.name", f"is '{y.name}'; choose one of {', '.join(schema.SYNC_MODES)}")
    _SETTINGS_CHECKS.get(schema.SYNC_CONFIGS[y.name], lambda _: None)(y)
    if mode(y.name).meets:
        # the budget counts meetings of sync.every steps, rounded up: a period past a pipeline's
        # share of it would train that whole period before the run could end
        need(cfg.train.steps < 1 or y.every <= cfg.train.steps, "sync.every",
             f"is {y.every}, more than train.steps={cfg.train.steps}: a replica would train "
             f"{y.every} iterations before its first meeting; use at most {cfg.train.steps}")
    if mode(y.name).meets and p.schedule in schema.ASYNC_SCHEDULES:
        need(y.every in (0, 1), "sync.every", f"meetings every {y.every} iterations need a "
             f"flushed schedule (1f1b, gpipe), not {p.schedule}")
        need(y.precision in ("auto", "fp32"), "sync.precision",
             f"'{y.precision}' needs a flushed schedule (1f1b, gpipe), not {p.schedule}")
    need(not p.partitions or mode(y.name).segments, "pipeline.partitions",
         f"pipelines split their own way need sync={' or '.join(names_with('segments'))} "
         f"(replicas average per segment of blocks), not {y.name}; use one pipeline.partition")
    need(not (mode(y.name).flushed_only and p.schedule in schema.ASYNC_SCHEDULES), "pipeline.schedule",
         f"sync={y.name} counts an iteration's updates: use a flushed schedule (1f1b, gpipe), "
         f"not {p.schedule}")


def _validate_train(cfg: DictConfig) -> None:
    """``train``: steps, batch, optimizer, learning-rate schedule, precision, logging."""
    p, t = cfg.pipeline, cfg.train
    need(t.steps >= 1, "train.steps", "must be at least 1")
    need(t.batch_size >= 1, "train.batch_size", "must be at least 1")
    need(t.batch_size <= MAX_BATCH, "train.batch_size", f"is {t.batch_size}; at most {MAX_BATCH:,} "
         "samples an iteration (2**40) fit any machine's tensors")
    need(t.batch_size % p.microbatches == 0, "train.batch_size",
         f"{t.batch_size} is not divisible by pipeline.microbatches={p.microbatches}")
    for key in ("lr", "momentum", "weight_decay", "grad_clip", "loss_scale", "final_lr", "decay_factor"):
        need(math.isfinite(t[key]), f"train.{key}", f"must be a finite number, got {t[key]}")
    need(0 <= t.lr <= FLOAT32_MAX, "train.lr", f"is {t.lr:g}; must be in [0, {FLOAT32_MAX:.3g}] (float32)")
    need(SEED_RANGE[0] <= t.seed <= SEED_RANGE[1], "train.seed", f"is {t.seed}; must fit 64 bits")
    need(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    # Both optimizers shrink every weight by the factor 1 - lr x weight_decay a step (AdamW's
    # decoupled decay, SGD's L2 term); at 1 or more it zeroes or flips every weight each step, and
    # the run diverges a few steps in. The schedules never go above train.lr.
    need(t.lr * t.weight_decay < 1, "train.weight_decay",
         f"is {t.weight_decay:g}: with train.lr={t.lr:g} each step would scale every weight by "
         f"1 - lr x weight_decay = {1 - t.lr * t.weight_decay:.3g}; keep lr x weight_decay below 1")
    need(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite",
         f"is '{t.on_nonfinite}'; choose stop or skip")
    need(t.max_skipped >= 1, "train.max_skipped", "must be at least 1")
    need(t.optimizer in schema.OPTIMIZERS, "train.optimizer",
         f"is '{t.optimizer}'; choose one of {', '.join(schema.OPTIMIZERS)}")
    need(0.0 <= t.momentum < 1.0, "train.momentum", "must be in [0, 1)")
    need(t.warmup >= 0, "train.warmup", "must be >= 0")
    need(t.schedule in schema.LR_SCHEDULES, "train.schedule",
         f"is '{t.schedule}'; choose one of {', '.join(schema.LR_SCHEDULES)}")
    need(0.0 <= t.final_lr <= 1.0, "train.final_lr", "must be in [0, 1] (a fraction of train.lr)")
    need(t.decay_every >= 1, "train.decay_every", "must be at least 1 iteration")
    need(0.0 < t.decay_factor <= 1.0, "train.decay_factor", "must be in (0, 1]")
    need(1 <= t.loss_scale <= MAX_LOSS_SCALE, "train.loss_scale",
         f"is {t.loss_scale:g}; must be in [1, 2**32]: fp16 halves a scale that overflows and skips "
         "that step, so a larger start is steps skipped, not a better one")
    need(t.precision in schema.PRECISIONS, "train.precision",
         f"is '{t.precision}'; choose one of {', '.join(schema.PRECISIONS)}")
    need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    need(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: evaluate only at the end)")
    need(t.log_every >= 1, "train.log_every", "must be at least 1")
    need(t.time_limit is None or t.time_limit > 0, "train.time_limit", "must be positive seconds")


def _validate_checkpoint(cfg: DictConfig) -> None:
    """``checkpoint``: its cadence, and whether the sync mode can save or stop together."""
    y = cfg.sync
    need(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: no checkpoints)")
    need(cfg.checkpoint.keep >= 0, "checkpoint.keep", "must be >= 0 (0: keep all)")
    sync_mode = mode(y.name)
    need(not (cfg.checkpoint.every and not sync_mode.checkpoints), "checkpoint.every",
         f"checkpoints are not supported with sync={y.name} (the servers' state is not saved)")
    need(not (cfg.checkpoint.on_exit and not sync_mode.stop_together), "checkpoint.on_exit",
         f"needs replicas that stop together; sync={y.name} has none (use checkpoint.every)")
    minutes = cfg.checkpoint.every_minutes
    need(minutes is None or minutes > 0, "checkpoint.every_minutes", "must be positive minutes")
    need(minutes is None or sync_mode.stop_together, "checkpoint.every_minutes",
         f"needs replicas that agree on when; sync={y.name} has none (use checkpoint.every)")


def _validate_run(cfg: DictConfig) -> None:
    """``run`` and ``metrics``: port, timeouts, tracing, the trackers."""
    need(0 <= cfg.run.port <= 65535, "run.port", "must be in 0..65535 (0 picks a free port)")
    need(cfg.run.timeout >= MIN_TIMEOUT_S, "run.timeout", f"is {cfg.run.timeout:g} s; give every "
         f"rendezvous and collective at least {MIN_TIMEOUT_S:g} s (the store's first answer alone "
         "can take that long on a loaded machine)")
    need(cfg.run.heartbeat_timeout >= MIN_TIMEOUT_S, "run.heartbeat_timeout",
         f"must be at least {MIN_TIMEOUT_S:g} s")
    for key in ("timeout", "heartbeat_timeout"):
        need(cfg.run[key] <= MAX_TIMEOUT_S, f"run.{key}", f"is {cfg.run[key]:g} s; at most {MAX_TIMEOUT_S:g}")
    need(cfg.run.trace_events > 0, "run.trace_events", "must be at least 1")
    need(not cfg.metrics.tensorboard or importlib.util.find_spec("tensorboard") is not None,
         "metrics.tensorboard", "needs the tensorboard package: pip install tensorboard")
    need(not cfg.metrics.mlflow or importlib.util.find_spec("mlflow") is not None,
         "metrics.mlflow", "needs the mlflow package: pip install -e '.[mlflow]'")
    wandb = str(cfg.metrics.wandb).lower()
    need(wandb in (*schema.WANDB_MODES, "false"), "metrics.wandb",
         f"is '{cfg.metrics.wandb}'; choose off or offline (W&B runs offline only; "
         "wandb sync uploads them)")
    need(wandb != "offline" or importlib.util.find_spec("wandb") is not None,
         "metrics.wandb", "needs the wandb package: pip install -e '.[wandb]'")


def _check_sdpipe(y: DictConfig) -> None:
    need(y.min_group >= 1, "sync.min_group", "must be at least 1")
    need(0 < y.window_min_ms <= y.window_ms <= y.window_max_ms, "sync.window_ms",
         "need 0 < sync.window_min_ms <= sync.window_ms <= sync.window_max_ms")
    need(y.connect_every >= 1, "sync.connect_every", "must be at least 1 (1 = all-reduce)")
    need(y.global_every >= 0, "sync.global_every", "must be >= 0 (0: only at the end)")
    need(0 < y.group_timeout <= MAX_TIMEOUT_S, "sync.group_timeout",
         f"is {y.group_timeout:g}; must be positive seconds, at most {MAX_TIMEOUT_S:g}")
    need(y.patience >= 0, "sync.patience", "must be >= 0 (0: the adaptive window alone)")
    need(y.max_group == 0 or y.max_group >= 2, "sync.max_group", "must be 0 (no cap) or at least 2")
    need(y.policy in schema.POLICIES, "sync.policy", f"is '{y.policy}'; choose one of {', '.join(schema.POLICIES)}")
    need(y.average in schema.AVERAGES, "sync.average",
         f"is '{y.average}'; choose one of {', '.join(schema.AVERAGES)}")
    need(y.stale in schema.STALE_RULES, "sync.stale",
         f"is '{y.stale}'; choose one of {', '.join(schema.STALE_RULES)}")
    need(y.every >= 0, "sync.every", "must be >= 0 (0: chosen from cluster.links; 1: every "
         "iteration)")
    need(y.precision in SYNC_PRECISIONS, "sync.precision",
         f"is '{y.precision}'; choose one of {', '.join(SYNC_PRECISIONS)}")
    need(math.isfinite(y.wire_share) and 0 < y.wire_share <= 1, "sync.wire_share",
         f"must be in (0, 1], got {y.wire_share}")
    need(0 <= y.overlap <= MAX_OVERLAP, "sync.overlap",
         f"must be in [0, {MAX_OVERLAP}] local steps, got {y.overlap}")


def _check_ps(y: DictConfig) -> None:
    need(y.staleness >= 0, "sync.staleness", "must be >= 0 (0: bulk-synchronous)")


def _check_diloco(y: DictConfig) -> None:
    need(y.local_steps >= 1, "sync.local_steps", "must be at least 1")
    need(math.isfinite(y.outer_lr) and 0 < y.outer_lr <= FLOAT32_MAX, "sync.outer_lr",
         f"must be a positive finite number, got {y.outer_lr}")
    need(math.isfinite(y.outer_momentum) and 0 <= y.outer_momentum < 1, "sync.outer_momentum",
         f"must be in [0, 1), got {y.outer_momentum}")
    need(y.precision in ("fp32", "bf16", "int8"), "sync.precision",
         f"is '{y.precision}'; choose fp32, bf16 or int8")


# each mode's own settings, by its config class (the rest of validation asks core.modes)
_SETTINGS_CHECKS = {schema.SdpipeSyncConfig: _check_sdpipe, schema.PsSyncConfig: _check_ps,
                    schema.DilocoSyncConfig: _check_diloco}


def _validate_model(cfg: DictConfig) -> None:
    """The model, its objective and the data it needs; the extras it imports."""
    m, d = cfg.model, cfg.data
    goal = objective(cfg)
    need(m.objective in schema.OBJECTIVES, "model.objective",
         f"is '{m.objective}'; choose one of {', '.join(schema.OBJECTIVES)}")
    image = d.name in schema.IMAGE_DATASETS
    need(goal == "classify" or not image, "model.objective",
         f"{goal} needs token data, but data={d.name} is images; use a classifier (e.g. model=resnet_cifar)")
    need(goal != "classify" or image or "custom" in (m.arch, d.name), "data.name",
         f"{m.arch} classifies images, but data={d.name} is text; use data=digits")
    need(m.arch not in schema.RESNET_BLOCKS or goal == "classify", "model.objective",
         f"{m.arch} is a classifier; its objective is classify")
    need(m.arch != "custom" or bool(m.get("_target_")), "model._target_",
         "model=custom needs the callable that builds it: model._target_=PKG.MODULE.FN")
    need(m.n_layers >= 1, "model.n_layers", "must be at least 1")
    need(m.n_layers <= MAX_LAYERS, "model.n_layers", f"is {m.n_layers:,}; at most {MAX_LAYERS:,}")
    need(m.seq_len >= 1, "model.seq_len", "must be at least 1")
    need(m.d_model >= 1 and m.d_hidden >= 1, "model.d_model", "widths must be at least 1")
    if not image:
        need(m.vocab_size >= 256, "model.vocab_size", "must be at least 256 (byte-level data)")
        need(goal != "mlm" or m.vocab_size >= 257, "model.vocab_size",
             "must be at least 257 with objective mlm (bytes and a mask token)")
    if m.arch in ("gpt", "gpt2", "bert"):
        need(m.n_heads >= 1 and m.d_model % m.n_heads == 0, "model.n_heads",
             f"d_model={m.d_model} must be divisible by n_heads={m.n_heads}")
    need(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)")
    if goal == "classify":
        classes = num_classes(cfg)  # image folders and custom sets: their own, found at launch
        need(classes is not None or d.name in ("imagefolder", "custom"), "model.num_classes",
             "a classifier needs its number of classes (set model.num_classes)")
        need(classes is None or classes >= 2, "model.num_classes", "a classifier needs at least 2 classes")
    need(m.pretrained is None or m.arch in schema.HF_ARCHS, "model.pretrained",
         f"loads transformers weights (model=gpt2 or bert), not model.arch={m.arch}")
    if m.pretrained is not None:
        need(Path(str(m.pretrained)).expanduser().is_dir(), "model.pretrained",
             f"'{m.pretrained}' is not a folder (one written by save_pretrained)")
    extras = {"transformers": (m.arch in schema.HF_ARCHS, "model.arch", f"{m.arch} needs Hugging Face "
                               "transformers: pip install -e '.[hf]'"),
              "sklearn": (d.name == "digits", "data.name", "digits needs scikit-learn: "
                          "pip install -e '.[digits]'"),
              "PIL": (d.name == "imagefolder", "data.name", "imagefolder reads images with pillow: "
                      "pip install -e '.[images]'"),
              "numpy": (d.name == "cifar10", "data.name", "cifar10's files hold numpy arrays: "
                        "pip install numpy")}
    for module, (needed, key, reason) in extras.items():
        need(not needed or importlib.util.find_spec(module) is not None, key, reason)


def _validate_fault(cfg: DictConfig) -> None:
    """What a run does about a failure: each mode of recovery needs what it rebuilds from."""
    f, y = cfg.fault, cfg.sync
    loss, failure = f.on_pipeline_loss, f.on_failure
    need(loss in ("stop", "continue", "restart"), "fault.on_pipeline_loss",
         f"is '{loss}'; choose stop, continue or restart")
    survivors = " or ".join(f"sync={n}" for n in names_with("survives_loss"))
    need(loss == "stop" or (mode(y.name).survives_loss and cfg.cluster.pipelines >= 2),
         "fault.on_pipeline_loss", f"{loss} needs {survivors} and at least 2 pipelines (a lost "
         f"pipeline is healed from a live replica; sync={y.name} has no way around a missing one)")
    need(loss == "stop" or cfg.run.heartbeat_timeout > y.get("group_timeout", 0),
         "run.heartbeat_timeout", f"must exceed sync.group_timeout ({y.get('group_timeout')} s) "
         f"with fault.on_pipeline_loss={loss}: a replica waiting that long for a lost member "
         "would be taken for hung")
    need(not (loss == "restart" and y.get("precision") in ("bf16", "int8")),
         "sync.precision", f"{y.get('precision')} changes are taken from an anchor every replica "
         "shares, which a replica healed before a global sync would miss: use "
         "sync.precision=fp32 (or auto) with fault.on_pipeline_loss=restart")
    need(failure in ("stop", "restart"), "fault.on_failure", f"is '{failure}'; choose stop or restart")
    need(failure == "stop" or mode(y.name).restart_run, "fault.on_failure",
         f"restart is for lock-step sync ({', '.join(names_with('restart_run'))}), not "
         f"sync={y.name}" + ("; use fault.on_pipeline_loss=restart" if mode(y.name).survives_loss
                             else " (no consistent checkpoint to restart from)"))
    need(failure == "stop" or cfg.checkpoint.every > 0 or cfg.checkpoint.every_minutes,
         "fault.on_failure", "restart needs checkpoints to restart from: set checkpoint.every "
         "or checkpoint.every_minutes")
    need(f.max_restarts >= 0, "fault.max_restarts", f"is {f.max_restarts}; must be >= 0")
    need(f.restart_backoff >= 0, "fault.restart_backoff", "must be >= 0 seconds")
    need(f.on_slowdown in ("warn", "replan", "off"), "fault.on_slowdown",
         f"is '{f.on_slowdown}'; choose warn, replan or off")
    need(f.slowdown_threshold > 1, "fault.slowdown_threshold",
         f"is {f.slowdown_threshold}; must be above 1 (a slowdown factor)")
    need(f.slowdown_window >= 1, "fault.slowdown_window", f"is {f.slowdown_window}; must be >= 1")
    if f.on_slowdown == "replan":
        _validate_replan(cfg)


def _validate_replan(cfg: DictConfig) -> None:
    """``fault.on_slowdown=replan``: the run stops at a consistent point, checkpoints, and goes
    on resharded to the new split (the block times come from a profile)."""
    y, key = cfg.sync, "fault.on_slowdown"
    able = [n for n in names_with("checkpoints") if mode(n).stop_together]
    need(mode(y.name).checkpoints and mode(y.name).stop_together, key,
         f"replan goes on from a checkpoint where every replica stopped together: use "
         f"sync={' or '.join(able)}, not {y.name}")
    need(bool(cfg.profile), key, "replan re-splits by each block's measured time: give a "
         "profile (profile=PATH, from `sdpipe profile`)")
    need(cfg.pipeline.stages >= 2, key, "replan moves blocks between stages: needs "
         "pipeline.stages >= 2")
    need(not any(n.host for n in cfg.cluster.nodes), key, "replan across real nodes is not "
         "supported yet; use warn")


def _validate_cluster(cfg: DictConfig) -> None:
    """Nodes, placement, emulation, stragglers and the profile they may need."""
    from sdpipe_cli.config import measurements
    from sdpipe_cli.config.measurements import ProfileError, check_model, load
    from sdpipe_cli.core.cluster import ClusterError
    from sdpipe_cli.core.plan import cluster_of

    c = cfg.cluster
    try:
        cluster = cluster_of(cfg)
    except ClusterError as err:
        raise ConfigError(err.key, err.reason) from None
    hosts = [n.host for n in c.nodes]
    if any(hosts):
        if not all(hosts):
            missing = hosts.index(None)
            raise ConfigError(f"cluster.nodes[{missing}].host", "give every node its address, or "
                              "none (nodes emulated on this machine)")
        if cfg.run.node not in cluster.nodes:
            raise ConfigError("run.node", f"name the node this launcher runs on (one of: "
                              f"{', '.join(cluster.nodes)}); start one launcher per node")
        if not cfg.run.port:
            raise ConfigError("run.port", f"set a fixed port: the other nodes reach the store at "
                              f"{hosts[0]}:run.port")
        split = cluster.split_pipelines()
        if cfg.fault.on_pipeline_loss != "stop" and split:
            raise ConfigError("fault.on_pipeline_loss", f"{cfg.fault.on_pipeline_loss} across real "
                              f"nodes needs every pipeline on one node (pipeline {split[0]} spans "
                              "nodes: see cluster.placement); its launcher then handles its loss")
        if cfg.fault.on_failure != "stop":
            raise ConfigError("fault.on_failure", f"{cfg.fault.on_failure} is not supported "
                              "across real nodes yet; use stop")
    elif cfg.run.node is not None:
        raise ConfigError("run.node", "is only for clusters of real nodes (cluster.nodes[*].host)")
    if c.emulation not in schema.EMULATIONS:
        raise ConfigError("cluster.emulation", f"is '{c.emulation}'; choose one of {', '.join(schema.EMULATIONS)}")
    modelled = emulation(cfg.cluster) == "modelled"
    if modelled and c.compute_ms is None and not cfg.profile:
        raise ConfigError("cluster.emulation", "modelled needs cluster.compute_ms or profile=PATH "
                          "(block times from `sdpipe profile`)")
    if not modelled and cluster.max_speed > 1.0:
        raise ConfigError("cluster.nodes", f"a device speed of {cluster.max_speed:g} > 1.0 needs "
                          "cluster.emulation=modelled (measured compute cannot be made faster)")
    st = c.stragglers
    if not 0.0 <= st.probability <= 1.0:
        raise ConfigError("cluster.stragglers.probability", "must be in [0, 1]")
    if not 1.0 <= st.factor <= MAX_SLOWDOWN:
        raise ConfigError("cluster.stragglers.factor", f"is {st.factor:g}; must be >= 1.0 and at "
                          f"most {MAX_SLOWDOWN:g} (3.0 = three times slower)")
    if st.per not in ("microbatch", "iteration"):
        raise ConfigError("cluster.stragglers.per", f"is '{st.per}'; choose microbatch or iteration")
    seen: set[str] = set()
    for name in st.devices:
        if name in seen:
            raise ConfigError("cluster.stragglers.devices", f"names {name} twice; name each device once")
        seen.add(name)
        if name not in cluster.devices:
            raise ConfigError("cluster.stragglers.devices", f"no device '{name}' (devices: "
                              f"{', '.join(cluster.devices)})")
    if cfg.pipeline.partition == "auto" and not cfg.profile:
        raise ConfigError("pipeline.partition", "auto needs profile=PATH (a profile.json from "
                          "`sdpipe profile`)")
    if cfg.profile:
        refuse_special(measurements.path_of(cfg.profile), "profile", "a profile.json")
        try:
            check_model(load(cfg.profile), cfg.model.name, n_blocks(cfg.model),
                        microbatch_size(cfg))
        except ProfileError as err:
            raise ConfigError("profile", str(err)) from None
