"""Config schema, composition and validation: the single source of truth for every setting.

The dataclasses below are registered with Hydra's ConfigStore as the schema of the primary config;
the YAML files under ``configs/`` only set values. Composition therefore rejects unknown keys and
wrong types, and :func:`validate` adds the cross-field checks (world size, stages <= blocks, ...),
so that a bad run stops before any process starts, with one line naming the key.

Every subcommand composes once (:func:`compose`), the launcher writes the resolved YAML into the
run folder, and child processes read that file (:func:`load_run_config`), never the YAML tree.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from sdpipe_cli.core import grouping, schedule as _schedule
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.core.modes import mode, names_with
from sdpipe_cli.core.plan import microbatch_size

SCHEDULES = (*_schedule.SCHEDULES, *_schedule.ASYNC_SCHEDULES)  # the registry is core.schedule
ASYNC_SCHEDULES = _schedule.ASYNC_SCHEDULES
AVERAGES = ("weights_grads", "weights")  # sync.average (sdpipe)
POLICIES = grouping.POLICIES  # sync.policy (sdpipe)
OPTIMIZERS = ("adamw", "sgd")  # train.optimizer
DEVICES = ("cpu", "cuda", "auto")
# model.arch: byte-level models of the project, ResNets written in the project, transformers'
# GPT-2 and BERT (the hf extra), or any importable callable (model._target_)
ARCHS = ("gpt", "mlp", "resnet18", "resnet50", "resnet_cifar", "gpt2", "bert", "custom")
HF_ARCHS = ("gpt2", "bert")
RESNET_BLOCKS = {"resnet18": 10, "resnet50": 18, "resnet_cifar": 11}  # stem, residual blocks, head
OBJECTIVES = ("auto", "clm", "mlm", "classify")
DATASETS = ("stdlib", "text", "synthetic", "tokens", "digits", "imagefolder", "cifar10", "custom")
IMAGE_DATASETS = ("digits", "imagefolder", "cifar10")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("cosine", "linear", "step", "constant")
PARTITIONS = ("uniform", "params", "auto")
EMULATIONS = ("auto", "measured", "modelled")


class ConfigError(BadInput):
    """A bad setting: ``key`` names it, ``reason`` says what is wrong and how to fix it."""


@dataclass
class ModelConfig:
    name: str = "custom"  # config option name, e.g. gpt_tiny
    # gpt | mlp (byte-level, the project's own) | resnet18 | resnet50 | resnet_cifar | gpt2 | bert
    # (transformers, the hf extra) | custom (model._target_); see docs/MODELS.md
    arch: str = "gpt"
    # custom: the importable callable (pkg.module.fn or a class) that returns the model's blocks;
    # the model node's other keys (+model.width=64) are its keyword arguments, kept in kwargs
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)  # custom: keyword arguments of _target_
    # cross_entropy (over the last dimension; targets of -100 are ignored), or a node with
    # _target_ naming a callable (output, target) -> scalar loss, or a loss class
    loss: Any = "cross_entropy"
    # What the targets are: clm (next token), mlm (masked tokens, 15 %), classify (one label per
    # sample); auto: classify on image data, else clm
    objective: str = "auto"
    vocab_size: int = 256  # token vocabulary (bytes: 256; mlm adds a mask token: at least 257)
    seq_len: int = 64  # tokens per sample (context length)
    d_model: int = 64  # width of the residual stream (gpt, mlp, gpt2, bert)
    n_layers: int = 4  # transformer / MLP layers; the model has n_layers + 2 blocks
    n_heads: int = 4  # attention heads (gpt, gpt2, bert)
    d_hidden: int = 256  # hidden width of each MLP
    dropout: float = 0.0  # dropout probability; 0 keeps pipelines bit-comparable
    num_classes: Optional[int] = None  # classifiers; null: the data set's
    hf: Dict[str, Any] = field(default_factory=dict)  # gpt2, bert: more transformers config keys
    pretrained: Optional[str] = None  # gpt2, bert: a local folder of save_pretrained weights
    # Input and output embeddings share one weight (gpt2, bert, custom models that share a
    # parameter between blocks); across stages each holds a copy, kept equal (docs/MODELS.md).
    # false: two independent weights.
    tie_embeddings: bool = True


@dataclass
class DataConfig:
    # stdlib | text | synthetic (bytes) | tokens (sdpipe prepare text) | digits | imagefolder |
    # cifar10 | custom (data._target_); see docs/TRAINING.md
    name: str = "stdlib"
    path: Optional[str] = None  # text: file or folder; tokens: prepared folder; images: the data set's folder
    max_bytes: int = 8_000_000  # byte corpora: read at most this many bytes (keeps start-up fast)
    # held out for validation where the data has no split of its own (corpora: the tail; image
    # folders without train/ and val/, and custom sets without a validation set: a seeded draw)
    val_fraction: float = 0.05
    eval_batches: Optional[int] = 4  # validation batches per evaluation; null: every full batch
    # custom: the callable returning the Dataset (or (train, val)); +data.KEY=VALUE are its kwargs
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    image_size: Optional[int] = None  # images: side of the training crop (null: the data set's own)
    mean: Optional[List[float]] = None  # images: per-channel normalisation (null: the data set's)
    std: Optional[List[float]] = None
    # background processes preparing batches per reading stage; null: 0 for data in memory,
    # 2 for data decoded from files (image folders, CIFAR's augmentation, custom sets)
    num_workers: Optional[int] = None
    prefetch: int = 2  # batches each background process prepares ahead
    verify: bool = True  # tokens: check every shard's SHA-256 against the manifest at start
    # written by the launcher, never set by hand: what was read (paths, sizes, checksums), the
    # split sizes, a sample's shapes; config.yaml keeps it as the run's record of its data
    resolved: Optional[Dict[str, Any]] = None


@dataclass
class DeviceConfig:
    speed: float = 1.0  # relative compute speed: 1.0 = as measured, 0.5 = twice the wall time
    memory: Optional[float] = None  # GiB this worker may use (CPU: RSS; CUDA: allocator cap)


@dataclass
class NodeConfig:
    name: str = "node"  # devices are named "<node>:<index>"; with real nodes, what run.node picks
    devices: List[DeviceConfig] = field(default_factory=list)
    # Address of a real machine (one `sdpipe train ... run.node=NAME` runs on each; the first
    # node hosts the store at this address and run.port). null: a node emulated on this machine.
    host: Optional[str] = None


@dataclass
class StragglerConfig:
    # Each micro-batch (or iteration) a worker is slowed by ``factor`` with this probability.
    probability: float = 0.0
    factor: float = 3.0  # a slowed action takes this many times as long
    per: str = "microbatch"  # microbatch | iteration
    devices: List[str] = field(default_factory=list)  # device names ("node:index"); empty: all


@dataclass
class SpeedChangeConfig:
    device: str = "?"  # device name, "node:index"
    speed: float = 1.0  # the device's speed while the change lasts (replaces its own)
    start: float = 0.0  # seconds of the run clock
    end: Optional[float] = None  # null: until the end of the run


@dataclass
class LinkConfig:
    latency_ms: float = 0.0  # one-way latency added to every message
    bandwidth_gbps: Optional[float] = None  # Gbit/s; null: as fast as the real transport


@dataclass
class LinksConfig:
    same_node: LinkConfig = field(default_factory=LinkConfig)
    cross_node: LinkConfig = field(default_factory=LinkConfig)


@dataclass
class ClusterConfig:
    name: str = "local"  # config option name, e.g. hetero_mixed
    pipelines: int = 2  # P: data-parallel pipelines
    device: str = "auto"  # cpu | cuda | auto (cuda when available, one GPU per worker)
    host: str = "127.0.0.1"  # address the TCPStore binds to; keep it private (see docs/SECURITY.md)
    # Nodes and their devices; empty: one node "local" with one device of speed 1.0 per worker.
    nodes: List[NodeConfig] = field(default_factory=list)
    # Device name per (pipeline, stage): P lists of S "node:index"; empty: each pipeline on the
    # node with the most free devices that can hold it (see sdpipe_cli/core/cluster.py).
    placement: List[List[str]] = field(default_factory=list)
    # Per-pipeline compute slowdown factors (3.0 = three times slower); empty: all equal.
    slowdown: List[float] = field(default_factory=list)
    # measured: scale each action's measured time; modelled: each action costs a modelled time
    # (compute_ms, or the profile's block times) and the real compute runs inside it;
    # auto: modelled when compute_ms is set.
    emulation: str = "auto"
    # Modelled time of one micro-batch forward of a stage in ms (backward: twice).
    compute_ms: Optional[float] = None
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    changes: List[SpeedChangeConfig] = field(default_factory=list)  # scheduled speed changes
    links: LinksConfig = field(default_factory=LinksConfig)  # emulated network per link class


@dataclass
class PipelineConfig:
    stages: int = 2  # S: stages per pipeline
    microbatches: int = 4  # m: micro-batches per iteration
    # 1f1b (PipeDream-Flush) | gpipe | async_1f1b (PipeDream: an update per micro-batch, weight
    # stashing, no flush between iterations; drains only for evaluation, checkpoints, global syncs)
    schedule: str = "1f1b"
    # async_1f1b only. null: PipeDream, an update per micro-batch, each forward's weights kept
    # until its backward (at most S - s versions on stage s). 2: PipeDream-2BW, gradients
    # accumulated over an iteration and one update at its end (two versions; needs m >= S).
    weight_versions: Optional[int] = None
    # uniform | params (balance parameter counts) | auto (balance the measured block times of
    # profile=PATH on this cluster's devices) | explicit list of S-1 block boundaries, e.g. [3]
    partition: Any = "uniform"
    # Recompute each micro-batch's activations inside the stage's blocks during its backward,
    # keeping only the blocks' inputs: less memory for more compute (torch.utils.checkpoint)
    activation_checkpointing: bool = False


@dataclass
class SyncConfig:
    """What every sync mode has: its name. Each mode's settings are a subclass below, registered
    as that option of the ``sync`` config group, so a key of another mode is an error."""

    name: str = MISSING  # the mode, set by sync=MODE: sdpipe, allreduce, adpsgd, ps, diloco or none


@dataclass
class SdpipeSyncConfig(SyncConfig):
    """``sync=sdpipe``: the group scheduler's settings (see sdpipe_cli/core/grouping/)."""

    name: str = "sdpipe"
    min_group: int = 2  # a replica whose group is smaller than this widens its window
    window_ms: float = 5.0  # initial waiting window of each replica
    window_min_ms: float = 0.5  # the window shrinks (x0.9) down to this
    window_max_ms: float = 20.0  # and grows (x2) up to this (keep it well below an iteration)
    # Who waits for whom. cost_aware: a round waits only for predicted replicas about as fast as
    # its opener (a straggler waits for the fast ones, never the reverse), and a stage due to
    # connect holds only replicas outside the fastest replica's component; connect_every counts
    # updates (x P). classic: a round waits for every predicted replica and a due round holds
    # everyone until it connects, one stage at a time; connect_every counts rounds.
    policy: str = "cost_aware"
    # Most replicas in one round (0: no cap; global syncs always include everyone). A round closes
    # as soon as this many are ready: it bounds a round's all-reduce (a ring pays 2(n-1)
    # latencies), the communicators a replica needs, the scheduler's work per event and the wait
    # for the last of many (docs/SIMULATOR.md#many-pipelines). No effect up to 32 pipelines.
    max_group: int = 32
    # A round also waits for the replicas predicted (from their pace) to be ready within this
    # fraction of the opener's iteration time, so equal replicas meet in full groups. 0: the
    # reference's adaptive window alone.
    patience: float = 0.5
    # What a group averages. weights_grads: weights and gradients, before the local step (exact
    # all-reduce with full groups; global syncs also average the optimizer state). weights:
    # weights, after the local step (the paper's rule). See docs/SYNC.md.
    average: str = "weights_grads"
    # within how many rounds (classic), or updates of an average replica (cost_aware), a stage's
    # groups must connect all replicas
    connect_every: int = 8
    global_every: int = 50  # all replicas average every this many iterations (0: only at the end)
    # Seconds a group may take to form and average before its members go on alone (only a
    # member that died makes it wait; the scheduler then drops its pipeline); also how long past
    # its forecast a silent replica may hold cost_aware's rounds due to connect
    group_timeout: float = 30.0
    # A recorded sdpipe run's folder: take its group decisions instead of deciding, to repeat it
    # step for step (the same P, S, schedule and micro-batches; docs/SYNC.md#replay)
    replay: Optional[str] = None


@dataclass
class AllReduceSyncConfig(SyncConfig):
    """``sync=allreduce``: synchronous data parallelism; nothing to set."""

    name: str = "allreduce"


@dataclass
class AdpsgdSyncConfig(SyncConfig):
    """``sync=adpsgd``: gossip with one peer per round; nothing to set."""

    name: str = "adpsgd"


@dataclass
class PsSyncConfig(SyncConfig):
    """``sync=ps``: one parameter server per stage, stale-synchronous."""

    name: str = "ps"
    staleness: int = 3  # how many iterations a worker may run ahead of the slowest (0: bulk-synchronous)


@dataclass
class DilocoSyncConfig(SyncConfig):
    """``sync=diloco``: local SGD with an outer optimizer (DiLoCo): every replica takes
    ``local_steps`` steps alone, then the stage's replicas average their change and apply it with
    Nesterov momentum; lock-step at each outer step (sdpipe_cli/sync/diloco.py)."""

    name: str = "diloco"
    local_steps: int = 8  # inner steps of each replica between two outer steps
    outer_lr: float = 0.7  # the outer step's learning rate (1.0 with momentum 0: plain averaging)
    outer_momentum: float = 0.9  # the outer step's Nesterov momentum


@dataclass
class NoSyncConfig(SyncConfig):
    """``sync=none``: every pipeline trains its own replica; nothing to set."""

    name: str = "none"


# Each sync mode's settings, by name (what each mode needs and supports: core/modes.py).
# configs/sync/<name>.yaml sets the values.
SYNC_CONFIGS: dict[str, type] = {c.name: c for c in (
    SdpipeSyncConfig, AllReduceSyncConfig, PsSyncConfig, AdpsgdSyncConfig, DilocoSyncConfig,
    NoSyncConfig)}
SYNC_MODES = tuple(SYNC_CONFIGS)


@dataclass
class TrainConfig:
    steps: int = 400  # iterations of an average pipeline; P x steps pipeline-iterations in total
    batch_size: int = 16  # samples per pipeline per iteration, split into m micro-batches
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 3e-3  # peak learning rate
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0  # decoupled weight decay (AdamW) or L2 (SGD)
    warmup: int = 10  # linear warm-up iterations, then train.schedule
    # After the warm-up: cosine or linear decay to lr x final_lr at train.steps, step (x
    # decay_factor every decay_every iterations), or constant
    schedule: str = "cosine"
    final_lr: float = 0.1  # cosine, linear: the last learning rate as a fraction of the peak
    decay_every: int = 30  # step: iterations between decays
    decay_factor: float = 0.2  # step: the learning rate is multiplied by this at each decay
    # fp32 | bf16 | fp16: autocast of each stage's compute, fp32 weights and optimizer state;
    # fp16 scales the loss (dynamic, one skip-or-step decision per pipeline and sync group)
    precision: str = "fp32"
    loss_scale: float = 65536.0  # fp16: the initial loss scale (halved on overflow, doubled after 2000 good steps)
    # Max norm of the whole model's gradient, summed over a pipeline's stages (per stage under
    # async_1f1b, whose stages update at different times); 0 disables
    grad_clip: float = 1.0
    # A loss or gradient norm that is not finite (divergence): stop the run (no checkpoint of
    # the bad state is written; the error names the last good one), or skip the step and stop
    # after max_skipped in a row. fp16's loss scaler skips its own overflows either way.
    on_nonfinite: str = "stop"  # stop | skip
    max_skipped: int = 10  # skip: consecutive skipped steps that end the run
    # model initialization, data order and stragglers; equal seeds give equal runs in the
    # lock-step modes (allreduce, none), while sdpipe's groups follow arrival times (repeat a
    # run step for step with sync.replay=RUN)
    seed: int = 0
    eval_every: int = 100  # evaluate every this many iterations (0: only at the end)
    log_every: int = 1  # push a metrics line every this many iterations
    time_limit: Optional[float] = None  # seconds; stop all pipelines at the same iteration after it


@dataclass
class RunConfig:
    dir: Optional[str] = None  # run folder; default runs/<timestamp>
    port: int = 0  # TCPStore port; 0 picks a free one (real nodes under srun or torchrun: the job's)
    timeout: float = 120.0  # seconds any rendezvous or collective may wait before failing
    heartbeat_timeout: float = 300.0  # seconds of silence after which a worker is declared hung
    save_final: bool = False  # write each replica's final weights to <run>/final/p<P>-s<S>.pt
    # Record every worker's timeline to <run>/trace.json (Chrome trace: Perfetto, chrome://tracing)
    trace: bool = False
    trace_events: int = 50000  # per worker: the newest this many events are kept
    node: Optional[str] = None  # clusters of real nodes: the node this launcher runs on (srun, torchrun: found)
    # refuse a run whose estimated memory does not fit this machine (RAM on CPU, each GPU's memory)
    memory_check: bool = True
    # the --config-dir folders the config was composed from (set by the CLI); the run folder keeps
    # a copy of their YAML files in config-dirs/
    config_dirs: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    # Iterations between checkpoints (0: none). With sync=sdpipe a checkpoint is taken at the first
    # global sync at or after each multiple (the only points where replicas are consistent).
    every: int = 0
    every_minutes: Optional[float] = None  # also checkpoint when this long passed since the last
    keep: int = 3  # keep the newest K complete checkpoints (0: all)
    on_exit: bool = False  # also checkpoint where the run ends (end of training, Ctrl-C, SIGTERM)


@dataclass
class FaultConfig:
    # stop: any failure stops the run. continue (sync=sdpipe only): when a pipeline loses a worker,
    # its other workers are stopped, the scheduler drops it from every group, and the rest go on.
    # restart (sync=sdpipe only): as continue, then the pipeline's workers are started again and
    # copy each stage's weights and optimizer state from a live replica (up to max_restarts).
    on_pipeline_loss: str = "stop"
    # stop: a failure ends the run. restart (sync=allreduce, adpsgd or diloco, with checkpoints):
    # the whole run starts again from its latest checkpoint, up to max_restarts times (torchrun's
    # --max-restarts)
    on_failure: str = "stop"
    max_restarts: int = 3  # restarts in total over the run (of pipelines, or of the whole run)
    # seconds before a restart; doubled for a pipeline (or run) failing again within 60 s of its last
    restart_backoff: float = 1.0


@dataclass
class MetricsConfig:
    # Also write metrics.jsonl's numbers as TensorBoard scalars under <run>/tb (needs tensorboard)
    tensorboard: bool = False


@dataclass
class SimulateConfig:
    """What ``sdpipe simulate`` assumes beyond the cluster's devices and links. The defaults are
    fitted to real runs of the small models on a 2-core CPU machine with gloo (docs/SIMULATOR.md);
    on GPUs with NCCL the fixed costs are lower."""

    rtt_ms: float = 2.0  # worker -> scheduler -> worker round trip through the store
    event_ms: float = 0.2  # the scheduler's handling of one event
    collective_ms: float = 5.0  # fixed cost of one collective call (all-reduce, barrier)
    p2p_ms: float = 1.0  # fixed cost of one message between stages, on top of its link
    jitter: float = 0.1  # spread of a worker's iteration time (sigma of a log-normal factor; 0: none)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sync: SyncConfig = MISSING  # chosen with sync=MODE; each mode's own keys are listed below
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # A profile.json from `sdpipe profile`: block costs for pipeline.partition=auto and for
    # modelled emulation without cluster.compute_ms.
    profile: Optional[str] = None
    # Written by sdpipe when it prepares a run, not a setting: the topology, placement, budget
    # and micro-batch size every process of the run reads (core/plan.py); a value given is replaced.
    plan: Optional[Dict[str, Any]] = None


def n_blocks(model: ModelConfig | DictConfig) -> Optional[int]:
    """Blocks of a built-in model (embedding, layers, head; a ResNet's stem, residual blocks and
    head); None for a custom one, whose blocks are known only once it is built."""
    if model.arch == "custom":
        return None
    if model.arch in RESNET_BLOCKS:
        return RESNET_BLOCKS[model.arch]
    return int(model.n_layers) + 2


def objective(cfg: DictConfig) -> str:
    """What the targets are: ``model.objective``, or for ``auto`` what the data implies."""
    if cfg.model.objective != "auto":
        return cfg.model.objective
    if cfg.data.name == "custom":  # the model says what it is, or the data set's classes
        resolved = cfg.data.get("resolved") or {}
        classifier = cfg.model.arch in RESNET_BLOCKS or cfg.model.num_classes or resolved.get("classes")
        return "classify" if classifier else "clm"
    return "classify" if cfg.data.name in IMAGE_DATASETS else "clm"


def num_classes(cfg: DictConfig) -> Optional[int]:
    """Classes of a classifier: ``model.num_classes``, else the data set's."""
    if cfg.model.num_classes is not None:
        return int(cfg.model.num_classes)
    resolved = cfg.data.get("resolved") or {}
    return resolved.get("classes") or {"digits": 10, "cifar10": 10}.get(cfg.data.name)


def config_dir() -> Path:
    """The YAML tree: packaged beside the code when installed, ``configs/`` in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "configs"
    if packaged.is_dir():
        return packaged
    return package.parent / "configs"


def group_options() -> dict[str, list[str]]:
    """Config groups and their options, read from the YAML tree (for ``--help``)."""
    root = config_dir()
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(root.iterdir())
        if group.is_dir() and not group.name.startswith("_")
    }


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore, where ``configs/config.yaml`` finds it
    (``base_config``; ``configs/sync/<name>.yaml`` extends ``sync/schema_<name>``)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name, node in SYNC_CONFIGS.items():
        store.store(group="sync", name=f"schema_{name}", node=node)


def compose(overrides: list[str]) -> DictConfig:
    """Compose the config tree with Hydra overrides (``key=value``, ``group=option``, ``+key=value``).

    Raises :class:`ConfigError` with one line naming the offending key for every Hydra or
    OmegaConf error (unknown key, wrong type, unknown group option, bad override syntax).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except Exception as err:  # Hydra raises many types; all become one line
        raise _as_config_error(err) from None
    finally:
        GlobalHydra.instance().clear()
    _gather_kwargs(cfg)
    # Hydra lets ``+key=value`` add keys the schema does not have; the schema is the contract.
    _reject_unknown_keys(cfg, schema_for(cfg.sync.name))
    searched = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.searchpath=")]
    if searched:
        cfg.run.config_dirs = [d.removeprefix("file://") for d in searched[-1].strip("[]").split(",")
                               if d.startswith("file://")]
    return cfg


def _gather_kwargs(cfg: DictConfig) -> None:
    """``model=custom``, ``data=custom``: keys of the node that the schema does not know
    (``+model.width=64``) are the callable's keyword arguments: move them into ``kwargs``."""
    from omegaconf import open_dict

    for key, schema in (("model", ModelConfig), ("data", DataConfig)):
        node_cfg = cfg[key]
        if node_cfg.get("arch" if key == "model" else "name") != "custom":
            continue
        known = set(OmegaConf.structured(schema).keys())
        node = OmegaConf.to_container(node_cfg)
        extra = {k: node.pop(k) for k in list(node) if k not in known}
        if extra:
            node["kwargs"] = {**node.get("kwargs", {}), **extra}
            with open_dict(cfg):
                # a structured node cannot drop keys; it can be replaced
                cfg[key] = OmegaConf.merge(OmegaConf.structured(schema), node)


def schema_for(sync: str) -> DictConfig:
    """The typed schema of a run whose ``sync.name`` is ``sync`` (an unknown one keeps the base
    :class:`SyncConfig`, and validation names the key)."""
    schema = OmegaConf.structured(Config)
    schema.sync = OmegaConf.structured(SYNC_CONFIGS.get(sync, SyncConfig))
    return schema


def _reject_unknown_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> None:
    for key in cfg.keys():
        if key in schema and OmegaConf.is_missing(schema, key):
            continue
        name = f"{prefix}{key}"
        if key not in schema:
            close = _closest(str(key), schema.keys())
            hint = f"did you mean '{prefix}{close}'? " if close else ""
            raise ConfigError(name, f"is not a setting of sdpipe ({hint}known here: "
                                    f"{', '.join(schema.keys())})")
        free_form = OmegaConf.get_type(schema, key) is dict  # Dict[str, Any]: model.hf, model.kwargs
        if isinstance(schema[key], DictConfig) and isinstance(cfg[key], DictConfig) and not free_form:
            _reject_unknown_keys(cfg[key], schema[key], f"{name}.")


def _as_config_error(err: Exception) -> ConfigError:
    """Turn a Hydra/OmegaConf exception into a one-line :class:`ConfigError` that points at the
    place: ``FILE:LINE:COLUMN`` for a YAML syntax error, else the key's full path with the whole
    reason (the config file it came from, the nearest valid key for a misspelled one, the fix
    for two common override mistakes)."""
    import yaml
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    chain = _causes(err)
    text = " ".join(str(err).split("\n")[0].split())
    syntax = next((e for e in chain if isinstance(e, yaml.MarkedYAMLError)), None)
    if syntax is not None:
        mark = syntax.problem_mark or syntax.context_mark
        where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a config file"
        what = " ".join(p for p in (syntax.context, syntax.problem) if p)
        return ConfigError(where, f"YAML syntax: {what}")
    source = re.search(r"In '([\w./-]+)'", str(err))
    within = f" (in config file {source.group(1)}.yaml)" if source else ""
    keyed = next((e for e in chain if isinstance(e, OmegaConfBaseException)
                  and getattr(e, "full_key", None)), None)
    if keyed is not None:
        key = keyed.full_key
        reason = " ".join(str(getattr(keyed, "msg", None) or keyed).split("\n")[0].split())
        if isinstance(keyed, (ConfigKeyError, AttributeError)) or "not in" in reason:
            reason = f"is not a setting of sdpipe{_nearest(key)}"
        return ConfigError(key, reason + within)
    if "Ambiguous value for argument" in text:
        arg = re.search(r"argument '([^']*)'", text)
        key = arg.group(1).split("=", 1)[0] if arg else "overrides"
        return ConfigError(key, "a comma-separated value is a sweep: run it with -m (sdpipe train "
                                f"-m {arg.group(1) if arg else '...'}), or quote a list: "
                                f"'{key}=[a,b]'")
    if "Error parsing override" in text or "LexerNoViableAlt" in text:
        arg = re.search(r"override '([^']*)'", text) or re.search(r"Exception: (\S+)", text)
        key = (arg.group(1).split("=", 1)[0] if arg else "overrides").strip()
        return ConfigError(key, f"an override is KEY=VALUE in one word: write {key}=VALUE "
                                f"(not '{key} VALUE'), and quote a value with spaces")
    missing = re.search(r"Could not find '(\w+)/([^']*)'", str(err))
    if missing:
        group, option = missing.groups()
        choices = ", ".join(group_options().get(group, []))
        return ConfigError(group, f"no option '{option}' in config group '{group}' (choices: {choices})")
    match = re.search(r"'([A-Za-z_][\w.]*)'", str(err))
    return ConfigError(match.group(1) if match else "overrides", text)


def _causes(err: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _nearest(key: str) -> str:
    """``; did you mean 'train.steps'?`` for a misspelled ``train.stepz``, else ``''``."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.structured(Config)
    try:
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001 - a parent that is not a node: no suggestion
        return ""
    if not isinstance(node, DictConfig):
        return ""
    close = _closest(leaf, node.keys())
    return f"; did you mean '{parent + '.' if parent else ''}{close}'?" if close else ""


def _closest(word: str, known) -> Optional[str]:
    """The known key nearest to a misspelled ``word`` (difflib's ratio 0.6 or more), if any."""
    import difflib

    close = difflib.get_close_matches(word, [str(k) for k in known], n=1, cutoff=0.6)
    return close[0] if close else None


def need(ok: bool, key: str, reason: str) -> None:
    """Raise :class:`ConfigError` for ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, reason)


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that types alone cannot express. Raises :class:`ConfigError`."""
    m, p, c, t, d = cfg.model, cfg.pipeline, cfg.cluster, cfg.train, cfg.data

    need(m.arch in ARCHS, "model.arch", f"is '{m.arch}'; choose one of {', '.join(ARCHS)}")
    need(d.name in DATASETS, "data.name", f"is '{d.name}'; choose one of {', '.join(DATASETS)}")
    _validate_model(cfg)

    if d.name == "text":
        need(bool(d.path), "data.path", "is required with data=text (a file or a folder of text)")
        need(Path(str(d.path)).expanduser().exists(), "data.path", f"'{d.path}' does not exist")
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
    need(d.num_workers is None or d.num_workers >= 0, "data.num_workers", "must be 0 or more")
    need(d.prefetch >= 1, "data.prefetch", "must be at least 1")

    need(c.pipelines >= 1, "cluster.pipelines", "must be at least 1")
    if len(c.slowdown) > 0:
        need(len(c.slowdown) == c.pipelines, "cluster.slowdown",
             f"has {len(c.slowdown)} factors for {c.pipelines} pipelines; give one per pipeline")
        need(all(f >= 1.0 for f in c.slowdown), "cluster.slowdown",
             "factors must be >= 1.0 (3.0 = three times slower)")
    need(c.compute_ms is None or c.compute_ms > 0, "cluster.compute_ms", "must be positive ms")
    need(c.device in DEVICES, "cluster.device", f"is '{c.device}'; choose one of {', '.join(DEVICES)}")
    for key in ("rtt_ms", "event_ms", "collective_ms", "p2p_ms", "jitter"):
        need(cfg.simulate[key] >= 0, f"simulate.{key}", "must be >= 0")

    blocks = n_blocks(m)  # custom models: checked once built (models.check)
    need(p.stages >= 1, "pipeline.stages", "must be at least 1")
    need(blocks is None or p.stages <= blocks, "pipeline.stages",
         f"is {p.stages} but model {m.name} has only {blocks} blocks; use at most {blocks} stages")
    need(p.microbatches >= 1, "pipeline.microbatches", "must be at least 1")
    need(p.schedule in SCHEDULES, "pipeline.schedule",
         f"is '{p.schedule}'; choose one of {', '.join(SCHEDULES)}")
    if blocks is not None:
        validate_partition(p.partition, p.stages, blocks)
    if p.weight_versions is not None:
        need(p.schedule == "async_1f1b", "pipeline.weight_versions",
             f"only applies to pipeline.schedule=async_1f1b (schedule is {p.schedule})")
        need(p.weight_versions == 2, "pipeline.weight_versions",
             f"is {p.weight_versions}; use 2 (PipeDream-2BW) or null (PipeDream: up to S - s)")
        need(p.microbatches >= p.stages, "pipeline.weight_versions",
             f"2 needs pipeline.microbatches >= pipeline.stages (m={p.microbatches}, "
             f"S={p.stages}): micro-batches in flight must span at most two updates")

    y = cfg.sync
    need(y.name in SYNC_MODES, "sync.name", f"is '{y.name}'; choose one of {', '.join(SYNC_MODES)}")
    _SETTINGS_CHECKS.get(y.name, lambda _: None)(y)
    need(not (mode(y.name).flushed_only and p.schedule in ASYNC_SCHEDULES), "pipeline.schedule",
         f"sync={y.name} counts an iteration's updates: use a flushed schedule (1f1b, gpipe), "
         f"not {p.schedule}")

    need(t.steps >= 1, "train.steps", "must be at least 1")
    need(t.batch_size >= 1, "train.batch_size", "must be at least 1")
    need(t.batch_size % p.microbatches == 0, "train.batch_size",
         f"{t.batch_size} is not divisible by pipeline.microbatches={p.microbatches}")
    for key in ("lr", "momentum", "weight_decay", "grad_clip", "loss_scale", "final_lr", "decay_factor"):
        need(math.isfinite(t[key]), f"train.{key}", f"must be a finite number, got {t[key]}")
    need(t.lr >= 0, "train.lr", "must be >= 0")
    need(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    need(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite",
         f"is '{t.on_nonfinite}'; choose stop or skip")
    need(t.max_skipped >= 1, "train.max_skipped", "must be at least 1")
    need(t.optimizer in OPTIMIZERS, "train.optimizer",
         f"is '{t.optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
    need(0.0 <= t.momentum < 1.0, "train.momentum", "must be in [0, 1)")
    need(t.warmup >= 0, "train.warmup", "must be >= 0")
    need(t.schedule in LR_SCHEDULES, "train.schedule",
         f"is '{t.schedule}'; choose one of {', '.join(LR_SCHEDULES)}")
    need(0.0 <= t.final_lr <= 1.0, "train.final_lr", "must be in [0, 1] (a fraction of train.lr)")
    need(t.decay_every >= 1, "train.decay_every", "must be at least 1 iteration")
    need(0.0 < t.decay_factor <= 1.0, "train.decay_factor", "must be in (0, 1]")
    need(t.loss_scale >= 1, "train.loss_scale", "must be at least 1")
    need(t.precision in PRECISIONS, "train.precision",
         f"is '{t.precision}'; choose one of {', '.join(PRECISIONS)}")
    need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    need(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: evaluate only at the end)")
    need(t.log_every >= 1, "train.log_every", "must be at least 1")
    need(t.time_limit is None or t.time_limit > 0, "train.time_limit", "must be positive seconds")

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
    _validate_fault(cfg)
    need(0 <= cfg.run.port <= 65535, "run.port", "must be in 0..65535 (0 picks a free port)")
    need(cfg.run.timeout > 0, "run.timeout", "must be positive seconds")
    need(cfg.run.heartbeat_timeout > 0, "run.heartbeat_timeout", "must be positive seconds")
    need(cfg.run.trace_events > 0, "run.trace_events", "must be at least 1")
    need(not cfg.metrics.tensorboard or importlib.util.find_spec("tensorboard") is not None,
         "metrics.tensorboard", "needs the tensorboard package: pip install tensorboard")
    _validate_cluster(cfg)


def _check_sdpipe(y: DictConfig) -> None:
    need(y.min_group >= 1, "sync.min_group", "must be at least 1")
    need(0 < y.window_min_ms <= y.window_ms <= y.window_max_ms, "sync.window_ms",
         "need 0 < sync.window_min_ms <= sync.window_ms <= sync.window_max_ms")
    need(y.connect_every >= 1, "sync.connect_every", "must be at least 1 (1 = all-reduce)")
    need(y.global_every >= 0, "sync.global_every", "must be >= 0 (0: only at the end)")
    need(y.group_timeout > 0, "sync.group_timeout", "must be positive seconds")
    need(y.patience >= 0, "sync.patience", "must be >= 0 (0: the adaptive window alone)")
    need(y.max_group == 0 or y.max_group >= 2, "sync.max_group", "must be 0 (no cap) or at least 2")
    need(y.policy in POLICIES, "sync.policy", f"is '{y.policy}'; choose one of {', '.join(POLICIES)}")
    need(y.average in AVERAGES, "sync.average",
         f"is '{y.average}'; choose one of {', '.join(AVERAGES)}")


def _check_ps(y: DictConfig) -> None:
    need(y.staleness >= 0, "sync.staleness", "must be >= 0 (0: bulk-synchronous)")


def _check_diloco(y: DictConfig) -> None:
    need(y.local_steps >= 1, "sync.local_steps", "must be at least 1")
    need(math.isfinite(y.outer_lr) and y.outer_lr > 0, "sync.outer_lr",
         f"must be a positive finite number, got {y.outer_lr}")
    need(math.isfinite(y.outer_momentum) and 0 <= y.outer_momentum < 1, "sync.outer_momentum",
         f"must be in [0, 1), got {y.outer_momentum}")


# each mode's own settings, beside its config class (the rest of validation asks core.modes)
_SETTINGS_CHECKS = {"sdpipe": _check_sdpipe, "ps": _check_ps, "diloco": _check_diloco}


def _validate_model(cfg: DictConfig) -> None:
    """The model, its objective and the data it needs; the extras it imports."""
    m, d = cfg.model, cfg.data
    goal = objective(cfg)
    need(m.objective in OBJECTIVES, "model.objective",
         f"is '{m.objective}'; choose one of {', '.join(OBJECTIVES)}")
    image = d.name in IMAGE_DATASETS
    need(goal == "classify" or not image, "model.objective",
         f"{goal} needs token data, but data={d.name} is images; use a classifier (e.g. model=resnet_cifar)")
    need(goal != "classify" or image or "custom" in (m.arch, d.name), "data.name",
         f"{m.arch} classifies images, but data={d.name} is text; use data=digits")
    need(m.arch not in RESNET_BLOCKS or goal == "classify", "model.objective",
         f"{m.arch} is a classifier; its objective is classify")
    need(m.arch != "custom" or bool(m.get("_target_")), "model._target_",
         "model=custom needs the callable that builds it: model._target_=PKG.MODULE.FN")
    need(m.n_layers >= 1, "model.n_layers", "must be at least 1")
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
    need(m.pretrained is None or m.arch in HF_ARCHS, "model.pretrained",
         f"loads transformers weights (model=gpt2 or bert), not model.arch={m.arch}")
    if m.pretrained is not None:
        need(Path(str(m.pretrained)).expanduser().is_dir(), "model.pretrained",
             f"'{m.pretrained}' is not a folder (one written by save_pretrained)")
    extras = {"transformers": (m.arch in HF_ARCHS, "model.arch", f"{m.arch} needs Hugging Face "
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


def _validate_cluster(cfg: DictConfig) -> None:
    """Nodes, placement, emulation, stragglers and the profile they may need."""
    from sdpipe_cli.core.cluster import Cluster, ClusterError
    from sdpipe_cli.config.measurements import ProfileError, check_model, load

    c = cfg.cluster
    try:
        cluster = Cluster.from_config(c, cfg.pipeline.stages)
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
    if c.emulation not in EMULATIONS:
        raise ConfigError("cluster.emulation", f"is '{c.emulation}'; choose one of {', '.join(EMULATIONS)}")
    modelled = emulation(cfg) == "modelled"
    if modelled and c.compute_ms is None and not cfg.profile:
        raise ConfigError("cluster.emulation", "modelled needs cluster.compute_ms or profile=PATH "
                          "(block times from `sdpipe profile`)")
    if not modelled and cluster.max_speed > 1.0:
        raise ConfigError("cluster.nodes", f"a device speed of {cluster.max_speed:g} > 1.0 needs "
                          "cluster.emulation=modelled (measured compute cannot be made faster)")
    st = c.stragglers
    if not 0.0 <= st.probability <= 1.0:
        raise ConfigError("cluster.stragglers.probability", "must be in [0, 1]")
    if st.factor < 1.0:
        raise ConfigError("cluster.stragglers.factor", "must be >= 1.0 (3.0 = three times slower)")
    if st.per not in ("microbatch", "iteration"):
        raise ConfigError("cluster.stragglers.per", f"is '{st.per}'; choose microbatch or iteration")
    for name in st.devices:
        if name not in cluster.devices:
            raise ConfigError("cluster.stragglers.devices", f"no device '{name}' (devices: "
                              f"{', '.join(cluster.devices)})")
    if cfg.pipeline.partition == "auto" and not cfg.profile:
        raise ConfigError("pipeline.partition", "auto needs profile=PATH (a profile.json from "
                          "`sdpipe profile`)")
    if cfg.profile:
        try:
            check_model(load(cfg.profile), cfg.model.name, n_blocks(cfg.model),
                        microbatch_size(cfg))
        except ProfileError as err:
            raise ConfigError("profile", str(err)) from None


def emulation(cfg: DictConfig) -> str:
    """``measured`` or ``modelled``: what ``cluster.emulation=auto`` means for this config."""
    mode = cfg.cluster.emulation
    if mode == "auto":
        return "modelled" if cfg.cluster.compute_ms is not None else "measured"
    return mode


def validate_partition(partition: Any, stages: int, blocks: int) -> None:
    """``pipeline.partition`` is a known name or S - 1 increasing block boundaries."""
    key = "pipeline.partition"
    if isinstance(partition, str):
        if partition not in PARTITIONS:
            raise ConfigError(key, f"is '{partition}'; choose {', '.join(PARTITIONS)} "
                              f"or a list of {stages - 1} block boundaries")
        return
    if not isinstance(partition, (list, ListConfig)) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in partition
    ):
        raise ConfigError(key, "must be uniform, params, auto or a list of integer block boundaries")
    bounds = list(partition)
    if len(bounds) != stages - 1:
        raise ConfigError(key, f"has {len(bounds)} boundaries; {stages} stages need {stages - 1}")
    edges = [0, *bounds, blocks]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        raise ConfigError(key, f"boundaries {bounds} must increase strictly within 1..{blocks - 1} "
                          "so that no stage is empty")


def save_run_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config; child processes read this file, never the YAML tree."""
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


def load_child_config() -> tuple[Path, DictConfig]:
    """For a child process: its run folder and the resolved config the launcher wrote for it."""
    run_dir = Path(os.environ["SDPIPE_RUN_DIR"])
    return run_dir, load_run_config(Path(os.environ.get("SDPIPE_CONFIG", run_dir / "config.yaml")))


def load_run_config(path: Path) -> DictConfig:
    """Read a run's resolved config back, typed by the schema."""
    saved = OmegaConf.load(path)
    return OmegaConf.merge(schema_for(OmegaConf.select(saved, "sync.name", default="")), saved)
