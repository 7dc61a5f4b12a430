"""The run plan: resolved once from a checked config, carried through config.yaml, read back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from sdpipe_cli.cli.preparing import prepare
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.derived import with_values
from sdpipe_cli.config.run_file import load_run_config, save_run_config
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.core.plan import RunPlan


def test_prepare_writes_the_plan_and_a_child_reads_it_back_from_config_yaml(tmp_path):
    cfg, _, _ = prepare(compose(["model=mlp", "data=synthetic", "cluster.pipelines=3",
                              "pipeline.stages=2", "train.steps=7", "train.batch_size=24",
                              "pipeline.microbatches=4", "sync=ps"]))
    save_run_config(cfg, tmp_path / "config.yaml")
    plan = RunPlan.of(load_run_config(tmp_path / "config.yaml"))  # what every child does
    assert (plan.pipelines, plan.stages, plan.steps) == (3, 2, 7)
    assert plan.budget == 21 and plan.microbatch_size == 6
    assert plan.servers == 2 and plan.world_size == 8  # one server per stage, after the workers
    assert [plan.server_stage(r) for r in (6, 7)] == [0, 1]
    with pytest.raises(ValueError):
        plan.server_stage(5)  # a worker
    assert plan.placement == tuple(tuple(row) for row in plan.cluster.placement)
    assert plan.ranks_on(None) == list(range(6))
    assert plan.blocks == 6 and not plan.in_place  # the mlp's blocks; no re-plan in place
    assert plan == RunPlan.resolve(cfg, blocks=6)
    # the derived figures are written for the reader of config.yaml
    written = OmegaConf.load(tmp_path / "config.yaml").plan
    assert (written.workers, written.world_size, written.budget) == (6, 8, 21)


def test_a_config_that_was_not_prepared_has_no_plan():
    with pytest.raises(BadInput) as info:
        RunPlan.of(compose(["model=mlp", "data=synthetic"]))
    assert info.value.key == "plan"


def test_a_plan_that_disagrees_with_its_cluster_is_refused():
    cfg, _, _ = prepare(compose(["model=mlp", "data=synthetic"]))
    cfg = with_values(cfg, {"plan.placement": [["local:1", "local:0"], ["local:2", "local:3"]]})
    with pytest.raises(BadInput) as info:
        RunPlan.of(cfg)
    assert info.value.key == "plan.placement"
    cfg = with_values(cfg, {"plan": {"pipelines": 2}})
    with pytest.raises(BadInput) as info:
        RunPlan.of(cfg)
    assert info.value.key == "plan"


def test_the_simulators_other_modes_change_only_the_servers():
    plan = RunPlan.resolve(compose(["model=mlp", "data=synthetic", "pipeline.stages=3"]))
    ps = plan.for_sync("ps")
    assert (plan.servers, ps.servers, ps.world_size) == (0, 3, plan.workers + 3)
    assert ps.for_sync("sdpipe") == plan


BASE = compose(["model=gpt_tiny"])  # composed once: the examples change three numbers of it


@settings(max_examples=25, deadline=None)
@given(P=st.integers(1, 6), S=st.integers(1, 4), steps=st.integers(1, 50))
def test_every_rank_has_one_place(P, S, steps):
    cfg = BASE.copy()
    cfg.cluster.pipelines, cfg.pipeline.stages, cfg.train.steps = P, S, steps
    plan = RunPlan.resolve(cfg)
    grid = plan.grid
    places = {(grid.pipeline_of(r), grid.stage_of(r)) for r in range(plan.workers)}
    assert len(places) == plan.workers == P * S and plan.budget == P * steps
    assert sorted(r for p in range(P) for r in grid.pipeline_ranks(p)) == list(range(P * S))
    assert len(grid.neighbour_pairs()) == P * (S - 1)
    assert all(b == a + 1 and grid.pipeline_of(a) == grid.pipeline_of(b)
               for a, b in grid.neighbour_pairs())
    devices = [d for row in plan.placement for d in row]
    assert len(set(devices)) == len(devices) == P * S
