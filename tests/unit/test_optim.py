"""The optimizer and its schedule: eager state changes nothing, positions drive the learning rate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sdpipe_cli.config.composition import compose
from sdpipe_cli.core.meetings import Meetings
from sdpipe_cli.model import optim
from sdpipe_cli.sync.strategies import GroupSync


def _cfg(*overrides: str):
    return compose(["model=mlp", "data=synthetic", *overrides])


def test_schedule_warms_up_then_decays_to_a_tenth():
    cfg = _cfg("train.lr=1.0", "train.warmup=10", "train.steps=110")
    assert optim.lr_at(0, cfg.train) == pytest.approx(0.1)
    assert optim.lr_at(9, cfg.train) == pytest.approx(1.0)
    assert optim.lr_at(10, cfg.train) == pytest.approx(1.0)
    assert optim.lr_at(60, cfg.train) == pytest.approx(0.55)
    assert optim.lr_at(110, cfg.train) == pytest.approx(0.1)
    assert optim.lr_at(500, cfg.train) == pytest.approx(0.1)  # a fast pipeline past the end
    assert optim.lr_at(-0.5, cfg.train) == optim.lr_at(0, cfg.train)


def test_step_linear_and_constant_schedules():
    step = _cfg("train.lr=1.0", "train.warmup=5", "train.schedule=step", "train.decay_every=30",
                "train.decay_factor=0.2")
    assert optim.lr_at(4, step.train) == pytest.approx(1.0)
    assert [optim.lr_at(5 + k, step.train) for k in (0, 29, 30, 59, 60)] == pytest.approx(
        [1.0, 1.0, 0.2, 0.2, 0.04])
    linear = _cfg("train.lr=1.0", "train.warmup=0", "train.steps=100", "train.schedule=linear",
                  "train.final_lr=0")
    assert [optim.lr_at(k, linear.train) for k in (0, 50, 100, 200)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    constant = _cfg("train.lr=0.3", "train.warmup=2", "train.schedule=constant")
    assert [optim.lr_at(k, constant.train) for k in (0, 1, 2, 10_000)] == pytest.approx([0.15, 0.3, 0.3, 0.3])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "step"])
@settings(deadline=None, max_examples=30)
@given(a=st.floats(0, 1000), b=st.floats(0, 1000))
def test_no_schedule_rises_after_warm_up(schedule, a, b):
    cfg = SCHEDULES[schedule]
    lo, hi = sorted((a + 10, b + 10))
    assert optim.lr_at(hi, cfg.train) <= optim.lr_at(lo, cfg.train) + 1e-12


SCHEDULES = {s: _cfg("train.lr=1.0", "train.warmup=10", "train.steps=400", f"train.schedule={s}")
             for s in ("cosine", "linear", "step")}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_eager_state_takes_the_same_steps_as_torchs_lazy_state(kind):
    """The state is created up front (so replicas can average it from the first round); the
    steps must be bit for bit those of an optimizer that creates it at its first step."""
    cfg = _cfg(f"train.optimizer={kind}", "train.lr=0.05", "train.weight_decay=0.01")
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    ours = optim.build_optimizer(a.parameters(), cfg.train)
    if kind == "sgd":
        lazy = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01,
                               foreach=True)
    else:
        lazy = torch.optim.AdamW(b.parameters(), lr=0.05, betas=optim.ADAMW_BETAS,
                                 weight_decay=0.01, foreach=True)
    for k in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(k))
        for model, opt in ((a, ours), (b, lazy)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_state_tensors_are_the_moments_and_the_step():
    params = list(torch.nn.Linear(4, 3).parameters())
    adamw = optim.build_optimizer(params, _cfg().train)
    tensors = optim.state_tensors(adamw, params)
    assert len(tensors) == 3 * len(params)  # exp_avg, exp_avg_sq, step per parameter
    sgd = optim.build_optimizer(params, _cfg("train.optimizer=sgd").train)
    assert [t.shape for t in optim.state_tensors(sgd, params)] == [p.shape for p in params]
    plain = optim.build_optimizer(params, _cfg("train.optimizer=sgd", "train.momentum=0").train)
    assert optim.state_tensors(plain, params) == []


@pytest.mark.parametrize("average, offset", [("weights_grads", 1.0), ("weights", 0.0)])
def test_group_sync_follows_the_runs_global_progress(average, offset):
    """Before any decision a replica is at its own step; after one, at the scheduler's count of
    pipeline-iterations begun over P (before the step that count includes the current one)."""
    sync = GroupSync(events=None, rank=0, pipeline=0, stage=0, stages=2, pipelines=4,
                     groups=None, average=average)
    assert sync.position(7) == 7.0
    sync._done = 40
    assert sync.position(3) == 10.0 - offset


def test_between_meetings_a_replica_moves_on_from_the_last_decisions_progress():
    """sync.every=4: the scheduler counts meetings (4 iterations each); between two, the
    replica's position goes on step by step from the progress the last decision carried."""
    sync = GroupSync(events=None, rank=0, pipeline=0, stage=0, stages=2, pipelines=4,
                     groups=None, average="weights", meetings=Meetings(4))
    sync._done, sync._decided_at = 10, 11  # 10 meetings begun, decided after local step 11
    assert [sync.position(k) for k in (12, 13, 14, 15)] == [10.0, 11.0, 12.0, 13.0]
