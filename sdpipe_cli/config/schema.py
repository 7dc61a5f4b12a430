"""The config schema: the single source of truth for every setting.

The dataclasses below are registered with Hydra's ConfigStore as the schema of the primary config
(:mod:`~sdpipe_cli.config.composition`); the YAML files under ``configs/`` only set values. Each
field's comment is its documentation (docs/CONFIG.md is generated from it). Also here: the names
each setting may take, :class:`ConfigError`, what a few mean once resolved (:func:`objective`,
:func:`num_classes`, :func:`emulation`, :func:`n_blocks`).

Composed (:mod:`~.composition`), checked (:mod:`~.validation`), prepared by the launcher, written
into the run folder and read back by every child (:mod:`~.run_file`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from sdpipe_cli.core import grouping
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, SCHEDULES as _FLUSHED

SCHEDULES = (*_FLUSHED, *CHUNKED_SCHEDULES, *ASYNC_SCHEDULES)  # the registries are core's
AVERAGES = ("weights_grads", "weights")  # sync.average (sdpipe)
POLICIES = grouping.POLICIES  # sync.policy (sdpipe)
STALE_RULES = grouping.STALE_RULES  # sync.stale (sdpipe)
OPTIMIZERS = ("adamw", "sgd")  # train.optimizer
DEVICES = ("cpu", "cuda", "auto")
# model.arch: the project's byte-level models and ResNets, transformers' GPT-2 and BERT, or custom
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
WANDB_MODES = ("off", "offline")  # metrics.wandb (false reads as off)


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
    kwargs: dict[str, Any] = field(default_factory=dict)  # custom: keyword arguments of _target_
    # cross_entropy (over the last dimension; targets of -100 are ignored), or a node with
    # _target_ naming a callable (output, target) -> scalar loss, or a loss class
    loss: Any = "cross_entropy"
    # What the targets are: clm (next token), mlm (masked tokens, 15 %), classify (one label per
    # sample); auto: classify on image data, else clm
    objective: str = "auto"
    vocab_size: int = 256  # token vocabulary (bytes: 256; mlm adds a mask token: at least 257)
    seq_len: int = 64  # tokens per sample (context length)
    d_model: int = 64  # width of the residual stream (gpt, mlp, gpt2, bert)
    n_layers: int = 4  # transformer / MLP layers (at most 1,024); the model has n_layers + 2 blocks
    n_heads: int = 4  # attention heads (gpt, gpt2, bert)
    d_hidden: int = 256  # hidden width of each MLP
    dropout: float = 0.0  # dropout probability; 0 keeps pipelines bit-comparable
    num_classes: Optional[int] = None  # classifiers; null: the data set's
    hf: dict[str, Any] = field(default_factory=dict)  # gpt2, bert: more transformers config keys
    pretrained: Optional[str] = None  # gpt2, bert: a local folder of save_pretrained weights
    # Input and output embeddings share one weight (gpt2, bert, custom models sharing a parameter
    # between blocks); across stages each holds a copy, kept equal (docs/MODELS.md); false: two.
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
    kwargs: dict[str, Any] = field(default_factory=dict)
    image_size: Optional[int] = None  # images: side of the training crop (null: the data set's own)
    mean: Optional[list[float]] = None  # images: per-channel normalisation (null: the data set's)
    std: Optional[list[float]] = None
    # background processes preparing batches per reading stage; null: 0 for data in memory,
    # 2 for data decoded from files (image folders, CIFAR's augmentation, custom sets); at most 64
    num_workers: Optional[int] = None
    prefetch: int = 2  # batches each background process prepares ahead (at most 64)
    verify: bool = True  # tokens: check every shard's SHA-256 against the manifest at start
    # written by the launcher, never set by hand: what was read (paths, sizes, checksums), the
    # split sizes, a sample's shapes; config.yaml keeps it as the run's record of its data
    resolved: Optional[dict[str, Any]] = None


@dataclass
class DeviceConfig:
    speed: float = 1.0  # relative compute speed: 1.0 = as measured, 0.5 = twice the wall time
    memory: Optional[float] = None  # GiB this worker may use (CPU: RSS; CUDA: allocator cap)


@dataclass
class NodeConfig:
    name: str = "node"  # devices are named "<node>:<index>"; with real nodes, what run.node picks
    devices: list[DeviceConfig] = field(default_factory=list)
    # Address of a real machine (one `sdpipe train ... run.node=NAME` runs on each; the first
    # node hosts the store at this address and run.port). null: a node emulated on this machine.
    host: Optional[str] = None


@dataclass
class StragglerConfig:
    # Each micro-batch (or iteration) a worker is slowed by ``factor`` with this probability.
    probability: float = 0.0
    factor: float = 3.0  # a slowed action takes this many times as long
    per: str = "microbatch"  # microbatch | iteration
    devices: list[str] = field(default_factory=list)  # device names ("node:index"); empty: all


@dataclass
class SpeedChangeConfig:
    device: str = "?"  # device name, "node:index"
    speed: float = 1.0  # the device's speed while the change lasts (replaces its own)
    start: float = 0.0  # seconds of the run clock
    end: Optional[float] = None  # null: until the end of the run
    start_step: Optional[int] = None  # instead of start: the pipeline's iteration it starts at
    end_step: Optional[int] = None  # and ends at (null: the end): the same point of training


@dataclass
class LinkConfig:
    latency_ms: float = 0.0  # one-way latency added to every message (at most an hour)
    bandwidth_gbps: Optional[float] = None  # Gbit/s, at least 1e-6; null: as fast as the real transport


@dataclass
class LinksConfig:
    same_node: LinkConfig = field(default_factory=LinkConfig)
    cross_node: LinkConfig = field(default_factory=LinkConfig)


@dataclass
class ClusterConfig:
    name: str = "local"  # config option name, e.g. hetero_mixed
    pipelines: int = 2  # P: data-parallel pipelines (P x pipeline.stages: at most 16,384 workers)
    device: str = "auto"  # cpu | cuda | auto (cuda when available, one GPU per worker)
    host: str = "127.0.0.1"  # address the TCPStore binds to; keep it private (see docs/SECURITY.md)
    # Nodes and their devices; empty: one node "local" with one device of speed 1.0 per worker.
    nodes: list[NodeConfig] = field(default_factory=list)
    # Device name per (pipeline, stage): P lists of S "node:index"; empty: each pipeline on the
    # node with the most free devices that can hold it (see sdpipe_cli/core/cluster.py).
    placement: list[list[str]] = field(default_factory=list)
    # Per-pipeline compute slowdown factors (3.0 = three times slower); empty: all equal.
    slowdown: list[float] = field(default_factory=list)
    # measured: scale each action's measured time; modelled: each action costs a modelled time
    # (compute_ms, or the profile's block times), the real compute inside it; auto: modelled when compute_ms is set.
    emulation: str = "auto"
    compute_ms: Optional[float] = None  # modelled ms of one micro-batch forward of a stage (backward: 2x)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    changes: list[SpeedChangeConfig] = field(default_factory=list)  # scheduled speed changes
    links: LinksConfig = field(default_factory=LinksConfig)  # emulated network per link class


@dataclass
class PipelineConfig:
    stages: int = 2  # S: stages per pipeline
    microbatches: int = 4  # m: micro-batches per iteration (at most 65,536)
    # equal | speed: a pipeline up to ~2x slower takes fewer micro-batches, to keep the others' pace
    # (from the leg's start speeds; its gradient counted by its samples; allreduce, sdpipe)
    balance: str = "equal"
    # 1f1b (PipeDream-Flush) | gpipe | zb_h1 (zero bubble: each backward as B, then W) | async_1f1b (PipeDream:
    # an update per micro-batch, weight stashing, no flush) | interleaved_1f1b | interleaved_zb (its B, then W)
    schedule: str = "1f1b"
    chunks: int = 1  # interleaved_1f1b, interleaved_zb (Megatron's virtual pipeline): model chunks per stage
    # async_1f1b only. null: PipeDream, an update per micro-batch, each forward's weights kept
    # until its backward (at most S - s versions on stage s). 2: PipeDream-2BW, gradients
    # accumulated over an iteration and one update at its end (two versions; needs m >= S).
    weight_versions: Optional[int] = None
    # uniform | params (balance parameter counts) | auto (balance the measured block times of
    # profile=PATH on this cluster's devices) | explicit list of S-1 (chunks x S - 1) block boundaries
    partition: Any = "uniform"
    # sdpipe: pipelines split their own way, {pipeline: boundaries}, e.g. {2: [5, 9, 12]}
    partitions: dict[int, list[int]] = field(default_factory=dict)
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
    # updates (x P). classic: a round waits for every predicted replica, a due round holds all
    # until it connects, connect_every counts rounds: all-reduce's drift, fewer samples/s (notebook)
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
    # What a stale member of a round (one whose last round is more than an iteration of every
    # pipeline older than the freshest member's: a straggler) counts in the averages. pull: it
    # takes the group's weights and step, and counts in neither average; pull_weights: its
    # weights do not count, its gradient does; average: every member counts the same (the
    # paper's mean). See docs/SYNC.md#stale-members-pull-the-groups-state.
    stale: str = "pull"
    # within how many rounds (classic), or updates of an average replica (cost_aware), all replicas connect
    connect_every: int = 8
    global_every: int = 50  # all replicas average every this many iterations (0: only at the end)
    # Slow links (docs/SYNC.md#slow-links): meet after every this many local steps (<= train.steps),
    # averaging weights after the step. 0: from the emulated cluster.links, or, replicas on
    # several nodes and no link described, measured by the run and followed during it; 1 on one node
    every: int = 0
    # What a group round sends: each member's change since the last global sync, with error
    # feedback, in fp32, bf16 or int8 (a float32 scale per chunk); auto: int8 where a float32
    # meeting every iteration would not fit sync.wire_share. Global syncs are exact (float32)
    precision: str = "auto"
    wire_share: float = 0.1  # the share of a replica's time the chosen sync.every lets meetings take
    # Local steps a group round's average runs behind, merged late (0: in step; docs/SYNC.md)
    overlap: int = 0
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
    # what the outer gradient is averaged in: fp32, or bf16 or int8 with error feedback (the
    # same payload as sdpipe's sync.precision, for a fair comparison on slow links)
    precision: str = "fp32"


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
    weight_decay: float = 0.0  # decoupled weight decay (AdamW) or L2 (SGD); lr x weight_decay below 1
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
    loss_scale: float = 65536.0  # fp16: the initial loss scale, <= 2**32 (halved on overflow, x2 after 2000 good steps)
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
    timeout: float = 120.0  # seconds any rendezvous or collective may wait before failing (1 to 1e6)
    heartbeat_timeout: float = 300.0  # seconds of silence after which a worker is declared hung
    save_final: bool = False  # write each replica's final weights to <run>/final/p<P>-s<S>.pt
    trace: bool = False  # record every worker's timeline to <run>/trace.json (Chrome trace: Perfetto)
    trace_events: int = 50000  # per worker: the newest this many events are kept
    node: Optional[str] = None  # clusters of real nodes: the node this launcher runs on (srun, torchrun: found)
    # refuse a run whose estimated memory does not fit this machine (RAM on CPU, each GPU's memory)
    memory_check: bool = True
    # the --config-dir folders the config was composed from (set by the CLI); the run folder keeps
    # a copy of their YAML files in config-dirs/
    config_dirs: list[str] = field(default_factory=list)
    # written by the launcher, never set by hand: the run's identity (a checkpoint resumes in the
    # run folder whose config.yaml carries its id)
    id: Optional[str] = None
    # written by the launcher, never set by hand: the seal of the code the config names (model,
    # loss and data _target_s), which a resume checks (docs/SECURITY.md)
    code_seal: Optional[str] = None


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
    restart_backoff: float = 1.0  # seconds before a restart; doubled for one failing again within 60 s
    # warn: time each worker's compute and name a device that slows down during the run (a
    # straggler line in metrics.jsonl and on the console, one when it recovers); replan: also
    # re-split by the measured speeds when that pays (needs profile=); off: do not time them
    on_slowdown: str = "warn"
    # replan with sync=sdpipe: the re-split pipelines restart on their new split and heal from the
    # others, which go on (replicas then average per block); false, or other modes: the whole run
    # stops at a consistent point and goes on from its checkpoint resharded
    replan_in_place: bool = True
    # a device is a straggler once its compute time over its own start, relative to its peers'
    # (the same stage in the other pipelines), stays at this or above (docs/CLUSTERS.md)
    slowdown_threshold: float = 1.5
    slowdown_window: int = 5  # iterations whose median compute time a device is judged by
    # written by sdpipe when it re-plans: devices earlier legs measured slower ("p2s1": 4.0)
    slowed: dict[str, float] = field(default_factory=dict)


@dataclass
class MetricsConfig:
    # Also write metrics.jsonl's numbers as TensorBoard scalars under <run>/tb (needs tensorboard)
    tensorboard: bool = False
    # Also log the same scalars, and the config as params, to an MLflow store in <run>/mlruns (needs mlflow)
    mlflow: bool = False
    # off, or offline: also log the same scalars, and the config, to an offline Weights & Biases
    # run under <run>/wandb (uploaded only by wandb sync, later; needs wandb)
    wandb: str = "off"


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
    # A profile.json from `sdpipe profile`: block costs for partition=auto, emulation without compute_ms.
    profile: Optional[str] = None
    # Written by sdpipe when it prepares a run, not a setting: the topology, placement, budget
    # and micro-batch size every process of the run reads (core/plan.py); a value given is replaced.
    plan: Optional[dict[str, Any]] = None


def n_blocks(model: ModelConfig | DictConfig) -> Optional[int]:
    """Blocks of a built-in model (embedding, layers, head; a ResNet's stem, residual blocks and
    head); None for a custom one, whose blocks are known only once it is built."""
    if model.arch == "custom":
        return None
    if model.arch in RESNET_BLOCKS:
        return RESNET_BLOCKS[model.arch]
    return int(model.n_layers) + 2


def objective(cfg: Any) -> str:
    """What the targets are: ``model.objective``, or for ``auto`` what the data implies."""
    if cfg.model.objective != "auto":
        return cfg.model.objective
    if cfg.data.name == "custom":  # the model says what it is, or the data set's classes
        resolved = getattr(cfg.data, "resolved", None) or {}
        classifier = cfg.model.arch in RESNET_BLOCKS or cfg.model.num_classes or resolved.get("classes")
        return "classify" if classifier else "clm"
    return "classify" if cfg.data.name in IMAGE_DATASETS else "clm"


def num_classes(cfg: DictConfig) -> Optional[int]:
    """Classes of a classifier: ``model.num_classes``, else the data set's."""
    if cfg.model.num_classes is not None:
        return int(cfg.model.num_classes)
    resolved = getattr(cfg.data, "resolved", None) or {}
    return resolved.get("classes") or {"digits": 10, "cifar10": 10}.get(cfg.data.name)


def schema_for(sync: str) -> DictConfig:
    """The typed schema of a run of ``sync.name`` ``sync`` (unknown: the base SyncConfig)."""
    schema = OmegaConf.structured(Config)
    schema.sync = OmegaConf.structured(SYNC_CONFIGS.get(sync, SyncConfig))
    return schema


def emulation(cluster: ClusterConfig | DictConfig) -> str:
    """``measured`` or ``modelled``: what ``cluster.emulation=auto`` means for a ``cluster``."""
    if cluster.emulation == "auto":
        return "modelled" if cluster.compute_ms is not None else "measured"
    return str(cluster.emulation)

