"""The memory estimate made before a run starts: what the schedules hold in flight, what the
meta-device forward measures against the same forward on real tensors, and how the estimate
follows the settings a user turns to make a run fit."""

from __future__ import annotations

import pytest
import torch

from sdpipe_cli.cli.preparing import check_memory, prepare
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.derived import with_values
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core.cluster import Device
from sdpipe_cli.core.schedule import async_one_f_one_b, gpipe, in_flight, one_f_one_b
from sdpipe_cli.data import sources
from sdpipe_cli.model import memory, models


@pytest.mark.parametrize("S,m", [(1, 1), (2, 4), (4, 8), (4, 2)])
def test_micro_batches_in_flight_per_schedule(S, m):
    assert [in_flight(one_f_one_b(S, m, s)) for s in range(S)] == [min(S - s, m) for s in range(S)]
    assert [in_flight(gpipe(S, m, s)) for s in range(S)] == [m] * S
    assert [in_flight(async_one_f_one_b(S, m, s)) for s in range(S)] == [min(S - s, m) for s in range(S)]


def prepared(*overrides: str):
    cfg = prepare(compose(["run.memory_check=false", *overrides]))[0]
    return cfg, sources.example(cfg, cfg.train.batch_size // cfg.pipeline.microbatches)[0]


@pytest.mark.parametrize("model", ["gpt_tiny", "mlp"])
def test_the_meta_forward_saves_what_the_real_forward_saves(model):
    """The estimate runs no compute: its per-block figures bound those of real tensors from
    above, and not by much (attention on meta tensors takes a kernel that saves more than the
    CPU's: 1.4x for those blocks)."""
    cfg, example = prepared(f"model={model}", *(["data=synthetic"] if model == "mlp" else []))
    meta = memory._saved_per_block(models.meta_blocks(cfg.model)[0], example)
    torch.default_generator.manual_seed(0)
    real_blocks, _ = models.build(cfg.model)
    real = memory._saved_per_block(real_blocks, example)
    assert meta[1] == real[1]  # the blocks' inputs
    assert all(m >= r for m, r in zip(meta[0], real[0])), (meta, real)
    assert sum(meta[0]) <= 1.5 * sum(real[0]), (meta, real)
    assert all(n > 0 for n in meta[0])


def test_the_estimate_follows_batch_schedule_and_checkpointing():
    cfg, example = prepared("model=gpt_tiny")
    base = memory.estimate(cfg, example)
    double = memory.estimate(*prepared("model=gpt_tiny", f"train.batch_size={2 * cfg.train.batch_size}"))
    gpipe_ = memory.estimate(*prepared("model=gpt_tiny", "pipeline.schedule=gpipe"))
    ckpt = memory.estimate(*prepared("model=gpt_tiny", "pipeline.activation_checkpointing=true"))
    sgd = memory.estimate(*prepared("model=gpt_tiny", "train.optimizer=sgd", "train.momentum=0"))
    for s, e in enumerate(base):
        assert double[s].activations == pytest.approx(2 * e.activations, rel=0.01)
        assert gpipe_[s].in_flight >= e.in_flight
        assert ckpt[s].activations < e.activations
        assert sgd[s].training < e.training
        assert e.total > e.process


def test_a_run_that_cannot_fit_is_refused_with_the_estimate():
    with pytest.raises(ConfigError, match=r"train\.batch_size: the 4 workers on this machine need "
                                          r"about [\d.]+ GiB \(stage \d: .*activations .* GiB x \d "
                                          r"micro-batch\(es\) in flight\), but [\d.]+ GiB is "
                                          r"available; lower train.batch_size"):
        check_memory(prepare(compose(["model=gpt_tiny", "train.batch_size=1048576"]))[0])
    check_memory(prepare(compose(["model=gpt_tiny", "train.batch_size=1048576",
                                  "run.memory_check=false"]))[0])


def test_asynchronous_schedules_hold_their_stashed_weight_versions():
    """PipeDream keeps a weight version per micro-batch in flight (S - s on stage s, the current
    one included); 2BW keeps two. Flushed schedules keep none."""
    def stashed(*overrides):
        return [e.stashed for e in memory.estimate(*prepared("model=gpt_tiny", "pipeline.stages=3",
                                                                 "pipeline.microbatches=4",
                                                                 *overrides))]
    assert stashed() == [0, 0, 0]
    assert stashed("pipeline.schedule=async_1f1b") == [2, 1, 0]
    assert stashed("pipeline.schedule=async_1f1b", "pipeline.weight_versions=2") == [1, 1, 1]


def test_a_pipeline_split_its_own_way_is_estimated_by_its_own_split(monkeypatch):
    """Pipeline 1 holds 5 of gpt_tiny's 6 blocks on its first stage: that worker is the largest,
    and the check refuses a machine that fits the shared split's workers but not it."""
    cfg, example = prepared("model=gpt_tiny", "sync=sdpipe", "cluster.pipelines=2",
                            "pipeline.partitions={1: [5]}")
    shared, own = memory.estimate(cfg, example), memory.estimate(cfg, example, [5])
    assert own[0].weights > shared[0].weights > shared[1].weights > own[1].weights
    cfg = with_values(cfg, {"run.memory_check": True})
    need_shared = 2 * sum(e.total for e in shared)
    need_own = sum(e.total for e in shared) + sum(e.total for e in own)
    assert need_own > need_shared
    available = type("Memory", (), {"available": (need_shared + need_own) // 2})
    monkeypatch.setattr("psutil.virtual_memory", lambda: available)
    with pytest.raises(ConfigError, match="the 4 workers on this machine need"):
        check_memory(cfg)


def test_a_worker_over_its_devices_declared_memory_is_refused_naming_it():
    """Device n:1 declares less than stage 1 needs (on CPU the process alone is 0.29 GiB): the
    run is refused before anything starts, naming the worker and the device; the others'
    limits and a device without one are not in the way."""
    nodes = "cluster.nodes=[{name: n, devices: [{memory: 64}, {memory: 0.1}, {}, {}]}]"
    cfg = prepare(compose(["model=gpt_tiny", nodes]))[0]
    with pytest.raises(ConfigError, match=r"cluster\.nodes: stage 1 of pipeline 0 needs about "
                                          r"[\d.]+ GiB \(weights .*\), but its device n:1 has 0\.1 "
                                          r"GiB; give it fewer blocks \(pipeline\.partition\)"):
        check_memory(cfg)
    check_memory(prepare(compose(["model=gpt_tiny", nodes.replace("0.1", "8")]))[0])
    cfg, example = prepared("model=gpt_tiny")
    unlimited = Device("n:0", "n", 0)
    assert memory.over_device(cfg, example, [[3], [3]], lambda p, s: unlimited) is None


def test_an_evaluation_too_large_to_fit_is_refused_before_its_batch_is_made():
    """sdpipe eval's one process: the batch and one micro-batch's forward against what this
    machine has, before the first batch is read (a batch of 3e8 once grew for minutes into a
    MemoryError); an ordinary one passes, and run.memory_check=false lets any through."""
    from sdpipe_cli.export.evaluation import check_memory as check_eval

    cfg, _ = prepared("model=gpt_tiny", "data=synthetic")
    cfg = with_values(cfg, {"run.memory_check": True})  # as the run's own config has it
    cpu = torch.device("cpu")
    check_eval(cfg, cpu)
    size = cfg.train.batch_size
    one = memory.evaluation(cfg, sources.example(cfg, size, device="meta"),
                            sources.example(cfg, size // cfg.pipeline.microbatches, device="meta")[0])
    cfg = with_values(cfg, {"train.batch_size": size * 1000})
    more = memory.evaluation(cfg, sources.example(cfg, size * 1000, device="meta"),
                             sources.example(cfg, size * 1000 // cfg.pipeline.microbatches,
                                             device="meta")[0])
    assert more.batch == 1000 * one.batch and more.activations > 900 * one.activations
    assert more.weights == one.weights > 0
    cfg = with_values(cfg, {"train.batch_size": 300_000_000})
    with pytest.raises(ConfigError, match="the evaluation needs about") as err:
        check_eval(cfg, cpu)
    assert err.value.key == "train.batch_size"
    check_eval(with_values(cfg, {"run.memory_check": False}), cpu)
