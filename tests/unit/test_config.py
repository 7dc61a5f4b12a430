"""Config schema, composition, validation and the CLI's handling of bad input (exit 2, one line)."""

from __future__ import annotations

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config.composition import compose, config_dir, group_options
from sdpipe_cli.config.schema import ConfigError, n_blocks
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.cluster import Cluster
from tests.helpers import one_error_line

REQUIRED_KEYS = [
    "cluster.pipelines",
    "cluster.device",
    "pipeline.stages",
    "pipeline.microbatches",
    "pipeline.schedule",
    "pipeline.partition",
    "sync.name",
    "train.steps",
    "train.batch_size",
    "train.lr",
    "train.seed",
    "train.eval_every",
    "train.time_limit",
    "run.dir",
]

# A config that would train as little as possible, should a "bad input" ever get past the checks.
CHEAP = [
    "model=mlp", "data=synthetic", "train=quick", "cluster.pipelines=1", "pipeline.stages=1",
    "train.batch_size=4", "cluster.device=cpu",
]

MISSING = object()

# ---------------------------------------------------------------------------- defaults


@pytest.fixture(scope="module")
def defaults():
    cfg = compose([])
    validate(cfg)
    return cfg


def test_defaults_compose_and_validate(defaults):
    assert defaults.cluster.name == "local"
    assert defaults.cluster.pipelines == 2
    assert defaults.pipeline.stages == 2
    assert defaults.model.name == "gpt_tiny"
    assert defaults.data.name == "stdlib"
    assert defaults.sync.name == "sdpipe"
    assert defaults.pipeline.stages <= n_blocks(defaults.model)


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_required_key_exists(defaults, key):
    assert OmegaConf.select(defaults, key, default=MISSING) is not MISSING


def test_optional_defaults_are_null(defaults):
    assert defaults.train.time_limit is None
    assert defaults.run.dir is None


def test_group_options_match_yaml_tree():
    root = config_dir()
    opts = group_options()
    assert set(opts) == {"cluster", "data", "model", "pipeline", "sync", "train"}
    for group, names in opts.items():
        assert names == sorted(p.stem for p in (root / group).glob("*.yaml"))
        assert names, group
    assert "local" in opts["cluster"]
    assert {"gpt_tiny", "mlp"} <= set(opts["model"])
    assert {"stdlib", "synthetic", "text"} <= set(opts["data"])
    assert {"sdpipe", "allreduce", "none"} <= set(opts["sync"])


@pytest.mark.parametrize(
    "override",
    [f"{g}={o}" for g, opts in group_options().items() for o in opts if (g, o) != ("data", "text")],
)
def test_every_group_option_composes_and_validates(override):
    group, option = override.split("=")
    # a cluster of real machines needs to know which node this is, and a fixed port
    real = ["run.node=node0", "run.port=29500"] if override == "cluster=gpu_2node" else []
    # what some options need beside them: images for a classifier, a callable for a custom model
    needs = {"model=resnet18": ["data=digits"], "model=resnet50": ["data=digits"],
             "model=resnet_cifar": ["data=digits"], "data=digits": ["model=resnet_cifar"],
             "model=custom": ["model._target_=torch.nn.Sequential"],
             "train=digits": ["model=resnet_cifar", "data=digits"],
             "data=cifar10": ["model=resnet_cifar", "data.path=/cifar"],
             "data=imagefolder": ["model=resnet_cifar", "data.path=/images"],
             "data=tokens": ["data.path=/tokens"], "data=custom": ["data._target_=pkg.make"]}
    cfg = compose([override, *real, *needs.get(override, [])])
    validate(cfg)
    if group in ("model", "data", "cluster", "sync"):
        assert cfg[group].name == option


@pytest.mark.parametrize("sync", ["sdpipe", "diloco"])
def test_int8_changes_are_a_precision_of_their_own(sync):
    """``sync.precision=int8``: chosen only when asked for (``auto`` never picks it)."""
    cfg = compose([f"sync={sync}", "sync.precision=int8"])
    validate(cfg)
    assert cfg.sync.precision == "int8"


def test_data_text_with_existing_path_validates(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 100)
    cfg = compose(["data=text", f"data.path={corpus}"])
    validate(cfg)
    assert cfg.data.name == "text"


def test_overrides_are_applied_and_typed():
    cfg = compose(["train.steps=7", "model=mlp", "pipeline.partition=[3]", "train.time_limit=2.5"])
    validate(cfg)
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.model.name == "mlp"
    assert list(cfg.pipeline.partition) == [3]
    assert cfg.train.time_limit == 2.5


def test_config_error_str_is_key_colon_reason():
    err = ConfigError("train.steps", "must be at least 1")
    assert err.key == "train.steps"
    assert err.reason == "must be at least 1"
    assert str(err) == "train.steps: must be at least 1"
    assert isinstance(err, ValueError)


# ---------------------------------------------------------------------------- resolve_device


def resolve_device(cfg):
    from sdpipe_cli.cli.preparing import resolve_device

    return resolve_device(cfg, Cluster.from_config(cfg.cluster, cfg.pipeline.stages))


def test_resolve_device_cpu(defaults):
    cfg = compose(["cluster.device=cpu"])
    assert resolve_device(cfg) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_resolve_device_without_cuda():
    assert resolve_device(compose(["cluster.device=auto"])) == "cpu"
    with pytest.raises(ConfigError) as info:
        resolve_device(compose(["cluster.device=cuda"]))
    assert info.value.key == "cluster.device"


# ---------------------------------------------------------------------------- bad inputs

BAD = [
    # unknown keys
    pytest.param(["model.foo=1"], "model.foo", id="unknown-model-key"),
    pytest.param(["+foo=1"], "foo", id="unknown-top-level-key"),
    pytest.param(["+train.bogus=3"], "train.bogus", id="unknown-added-train-key"),
    pytest.param(["++train.bogus=3"], "train.bogus", id="unknown-forced-train-key"),
    # wrong types
    pytest.param(["train.steps=abc"], "train.steps", id="steps-not-int"),
    pytest.param(["pipeline.microbatches=1.5"], "pipeline.microbatches", id="microbatches-float"),
    pytest.param(["train.lr=abc"], "train.lr", id="lr-not-float"),
    # unknown group options
    pytest.param(["model=nope"], "model", id="unknown-model-option"),
    pytest.param(["sync=ring"], "sync", id="unknown-sync-option"),
    # cross-field checks
    pytest.param(["pipeline.stages=7"], "pipeline.stages", id="stages-gt-blocks"),
    pytest.param(["pipeline.stages=0"], "pipeline.stages", id="stages-zero"),
    pytest.param(["pipeline.microbatches=0"], "pipeline.microbatches", id="microbatches-zero"),
    pytest.param(["train.batch_size=10"], "train.batch_size", id="batch-not-divisible"),
    pytest.param(["pipeline.schedule=zigzag"], "pipeline.schedule", id="bad-schedule"),
    pytest.param(["sync.name=ring"], "sync.name", id="bad-sync-name"),
    pytest.param(["cluster.device=tpu"], "cluster.device", id="bad-device"),
    pytest.param(["pipeline.partition=[1,2]"], "pipeline.partition", id="partition-wrong-length"),
    pytest.param(["pipeline.partition=[6]"], "pipeline.partition", id="partition-empty-last-stage"),
    pytest.param(["pipeline.partition=[0]"], "pipeline.partition", id="partition-empty-first-stage"),
    pytest.param(["pipeline.stages=3", "pipeline.partition=[2,2]"], "pipeline.partition",
                 id="partition-empty-middle-stage"),
    pytest.param(["pipeline.stages=3", "pipeline.partition=[4,2]"], "pipeline.partition",
                 id="partition-not-increasing"),
    pytest.param(["pipeline.partition=bogus"], "pipeline.partition", id="partition-bad-name"),
    pytest.param(["pipeline.partition=[1.5]"], "pipeline.partition", id="partition-not-int"),
    pytest.param(["model.n_heads=3"], "model.n_heads", id="heads-not-dividing-d-model"),
    pytest.param(["train.lr=-0.1"], "train.lr", id="negative-lr"),
    pytest.param(["data=text"], "data.path", id="text-without-path"),
    pytest.param(["data=text", "data.path=/nonexistent/sdpipe/corpus.txt"], "data.path",
                 id="text-nonexistent-path"),
    pytest.param(["train.steps"], "train.steps", id="bad-override-syntax"),
    pytest.param(["train.time_limit=0"], "train.time_limit", id="time-limit-zero"),
    pytest.param(["train.time_limit=-5"], "train.time_limit", id="time-limit-negative"),
    pytest.param(["run.port=70000"], "run.port", id="port-too-large"),
    pytest.param(["run.port=-1"], "run.port", id="port-negative"),
    pytest.param(["cluster.pipelines=0"], "cluster.pipelines", id="pipelines-zero"),
    pytest.param(["train.steps=0"], "train.steps", id="steps-zero"),
    pytest.param(["sync.average=gradients"], "sync.average", id="bad-average"),
    pytest.param(["sync.stale=maybe"], "sync.stale", id="bad-stale-rule"),
    pytest.param(["sync.precision=int4"], "sync.precision", id="bad-precision"),
    pytest.param(["sync.every=-1"], "sync.every", id="every-negative"),
    pytest.param(["sync.every=two"], "sync.every", id="every-not-int"),
    pytest.param(["sync.wire_share=0"], "sync.wire_share", id="wire-share-zero"),
    pytest.param(["sync.wire_share=1.5"], "sync.wire_share", id="wire-share-over-one"),
    pytest.param(["pipeline.schedule=async_1f1b", "sync.every=4"], "sync.every",
                 id="meetings-on-an-async-schedule"),
    pytest.param(["pipeline.schedule=async_1f1b", "sync.precision=bf16"], "sync.precision",
                 id="bf16-on-an-async-schedule"),
    pytest.param(["cluster.links.between_racks.latency_ms=1"], "cluster.links.between_racks",
                 id="unknown-link-class"),
    pytest.param(["sync.precision=bf16", "fault.on_pipeline_loss=restart", "cluster.pipelines=2"],
                 "sync.precision", id="bf16-with-healing"),
    pytest.param(["sync.precision=int8", "fault.on_pipeline_loss=restart", "cluster.pipelines=2"],
                 "sync.precision", id="int8-with-healing"),
    pytest.param(["pipeline.schedule=async_1f1b", "sync.precision=int8"], "sync.precision",
                 id="int8-on-an-async-schedule"),
    pytest.param(["sync=diloco", "sync.precision=int4"], "sync.precision", id="diloco-bad-precision"),
    pytest.param(["train.optimizer=adam"], "train.optimizer", id="bad-optimizer"),
    pytest.param(["train.momentum=1.0"], "train.momentum", id="momentum-one"),
    pytest.param(["train.lr=inf"], "train.lr", id="lr-infinite"),
    pytest.param(["train.lr=nan"], "train.lr", id="lr-nan"),
    pytest.param(["train.grad_clip=inf"], "train.grad_clip", id="clip-infinite"),
    pytest.param(["train.weight_decay=-1"], "train.weight_decay", id="weight-decay-negative"),
    pytest.param(["train.weight_decay=1e300"], "train.weight_decay", id="weight-decay-past-the-weights"),
    pytest.param(["train.loss_scale=1e300"], "train.loss_scale", id="loss-scale-that-skips-every-step"),
    pytest.param(["data.num_workers=1", "data.prefetch=1000000000"], "data.prefetch", id="prefetch-unbounded"),
    pytest.param([f"train.loss_scale={2.0 ** 32 + 1}"], "train.loss_scale", id="loss-scale-past-2-32"),
    pytest.param(["train.optimizer=sgd", "train.lr=0.5", "train.weight_decay=2"], "train.weight_decay",
                 id="sgd-decay-past-the-weights"),
    pytest.param(["train.momentum=nan"], "train.momentum", id="momentum-nan"),
    pytest.param(["train.on_nonfinite=ignore"], "train.on_nonfinite", id="bad-on-nonfinite"),
    pytest.param(["train.max_skipped=0"], "train.max_skipped", id="max-skipped-zero"),
    pytest.param(["data=tokens"], "data.path", id="tokens-without-path"),
    pytest.param(["data=custom"], "data._target_", id="custom-data-without-target"),
    pytest.param(["data.std=[0]"], "data.std", id="std-zero"),
    pytest.param(["data.mean=[0.1,0.2]"], "data.mean", id="mean-two-channels"),
    pytest.param(["data.num_workers=-1"], "data.num_workers", id="workers-negative"),
    pytest.param(["sync=diloco", "sync.local_steps=0"], "sync.local_steps", id="diloco-no-local-steps"),
    pytest.param(["sync=diloco", "sync.precision=auto"], "sync.precision", id="diloco-auto-precision"),
    pytest.param(["sync=diloco", "sync.outer_lr=inf"], "sync.outer_lr", id="diloco-outer-lr-inf"),
    pytest.param(["sync=diloco", "sync.outer_momentum=1"], "sync.outer_momentum",
                 id="diloco-momentum-one"),
    pytest.param(["sync=diloco", "pipeline.schedule=async_1f1b"], "pipeline.schedule",
                 id="diloco-async"),
    pytest.param(["fault.on_slowdown=sometimes"], "fault.on_slowdown", id="bad-on-slowdown"),
    pytest.param(["sync=sdpipe", "pipeline.partitions={2:[3]}"], "pipeline.partitions.2",
                 id="own-partition-of-no-pipeline"),
    pytest.param(["sync=sdpipe", "pipeline.partitions={1:[2,4]}"], "pipeline.partitions.1",
                 id="own-partition-wrong-length"),
    pytest.param(["sync=sdpipe", "pipeline.partitions={1:[6]}"], "pipeline.partitions.1",
                 id="own-partition-empty-stage"),
    pytest.param(["sync=sdpipe", "pipeline.partitions={one:[3]}"], "pipeline.partitions.one",
                 id="own-partition-not-a-pipeline-index"),
    pytest.param(["sync=allreduce", "pipeline.partitions={1:[2]}"], "pipeline.partitions",
                 id="own-partition-under-allreduce"),
    pytest.param(["fault.on_slowdown=replan"], "fault.on_slowdown", id="replan-without-profile"),
    pytest.param(["fault.on_slowdown=replan", "sync=ps"], "fault.on_slowdown", id="replan-ps"),
    pytest.param(["fault.on_slowdown=replan", "sync=none"], "fault.on_slowdown", id="replan-none"),
    pytest.param(["fault.slowdown_threshold=1"], "fault.slowdown_threshold", id="threshold-one"),
]


@pytest.mark.parametrize("overrides, key", BAD)
def test_bad_input_raises_config_error_naming_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        validate(compose(overrides))
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    assert "\n" not in str(info.value)


# What the command line adds to a ConfigError (exit 2, one line on stderr, nothing on stdout) is
# the same for every row; one row of each way a ConfigError arises (Hydra's override parser, its
# composition, the schema's types, the cross-field checks, a path on disk, a mode's own keys) goes
# through main(), the rest are checked above at the level of the error.
CLI_ROWS = ("unknown-model-key", "unknown-added-train-key", "steps-not-int", "unknown-model-option",
            "stages-gt-blocks", "partition-bad-name", "text-nonexistent-path", "bad-override-syntax",
            "lr-nan", "custom-data-without-target", "bad-stale-rule", "diloco-async")


@pytest.mark.parametrize("overrides, key", [p for p in BAD if p.id in CLI_ROWS])
def test_cli_bad_input_exits_2_with_one_line(capsys, overrides, key):
    code = main(["train", *overrides])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    one_error_line(err, key)


# ---------------------------------------------------------------------------- --cfg, --help, ...


def test_cfg_prints_yaml_and_exits_0(capsys):
    assert main(["train", "--cfg"]) == 0
    out, err = capsys.readouterr()
    assert "pipelines: 2" in out
    assert err == ""
    data = yaml.safe_load(out)
    assert data["cluster"]["pipelines"] == 2
    assert data["pipeline"]["stages"] == 2
    assert data["model"]["name"] == "gpt_tiny"


def test_cfg_shows_overrides(capsys):
    assert main(["train", "--cfg", "train.steps=7", "model=mlp", "cluster.pipelines=3",
                 "sync=none"]) == 0
    out, _ = capsys.readouterr()
    data = yaml.safe_load(out)
    assert data["train"]["steps"] == 7
    assert data["model"]["name"] == "mlp"
    assert data["model"]["arch"] == "mlp"
    assert data["cluster"]["pipelines"] == 3
    assert data["sync"]["name"] == "none"
    assert "pipelines: 3" in out


def test_cfg_with_bad_override_still_exits_2(capsys):
    assert main(["train", "--cfg", "train.steps=abc"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, "train.steps")


def test_train_help_lists_every_group_and_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out, _ = capsys.readouterr()
    rows = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0] in group_options():
            rows[parts[0]] = [o.strip() for o in parts[1].split(",")]
    assert rows == group_options()


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    out, _ = capsys.readouterr()
    assert "usage: sdpipe" in out
    assert "train" in out


# ---------------------------------------------------------------------------- corpus, async schedule


@pytest.mark.parametrize("content, reason", [(b"", "empty"), (b"tiny", "too small")])
def test_empty_or_too_small_text_corpus_is_one_line_exit_2(tmp_path, capsys, content, reason):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    rc = main(["train", "data=text", f"data.path={corpus}", "model=mlp",
               f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sdpipe: error: "), err
    assert not (tmp_path / "run").exists()


def test_async_schedule_is_a_valid_choice():
    validate(compose(["pipeline.schedule=async_1f1b"]))
    validate(compose(["pipeline.schedule=async_1f1b", "pipeline.weight_versions=2"]))
    validate(compose(["pipeline.schedule=zb_h1"]))
    with pytest.raises(ConfigError, match="1f1b, gpipe, zb_h1, interleaved_1f1b, interleaved_zb, async_1f1b"):
        validate(compose(["pipeline.schedule=zigzag"]))


def test_zero_bubble_with_recomputed_activations_is_one_line(tmp_path, capsys):
    overrides = ["pipeline.schedule=zb_h1", "pipeline.activation_checkpointing=true",
                 f"run.dir={tmp_path / 'run'}"]
    assert main(["train", *overrides]) == 2
    line = one_error_line(capsys.readouterr().err, "pipeline.schedule")
    assert "use pipeline.activation_checkpointing=false" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, reason", [
    (["pipeline.weight_versions=2"], "only applies to pipeline.schedule=async_1f1b"),
    (["pipeline.schedule=async_1f1b", "pipeline.weight_versions=3"], "use 2"),
    (["pipeline.schedule=async_1f1b", "pipeline.weight_versions=2", "pipeline=deep",
      "pipeline.microbatches=2", "train.batch_size=8"], "microbatches >= pipeline.stages"),
])
def test_weight_versions_errors(overrides, reason, capsys):
    with pytest.raises(ConfigError, match=reason) as info:
        validate(compose(overrides))
    assert info.value.key == "pipeline.weight_versions"
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err, "pipeline.weight_versions")


def test_tensorboard_without_its_package_is_named(monkeypatch):
    import importlib.util

    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.schema import ConfigError
    from sdpipe_cli.config.validation import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        validate(compose(["metrics.tensorboard=true"]))
    assert err.value.key == "metrics.tensorboard" and "pip install tensorboard" in str(err.value)
