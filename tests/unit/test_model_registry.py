"""Any model as blocks: the registry, custom callables, losses, tied weights, stage boundaries."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.model import layout, models


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own, outside the package, importable from PYTHONPATH."""
    (tmp_path / "my_models.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class Pair(nn.Module):
            def forward(self, x):
                return x.float(), x.sum(-1)

        class Use(nn.Module):
            def forward(self, pair):
                return pair[0] * 2

        class Tied:
            def __init__(self, width):
                self.emb = nn.Embedding(10, width)
                self.head = nn.Linear(width, 10, bias=False)
                self.head.weight = self.emb.weight
            def pipeline_blocks(self):
                return [self.emb, nn.Linear(8, 8), self.head], ["emb", "mid", "head"]

        def sequential(width=4):
            return nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 3))

        def as_list():
            return [Pair(), Use()]

        def tied(width=8):
            return Tied(width)

        def empty():
            return []

        def not_modules():
            return [1, 2]

        def wrong_kind():
            return "model"

        def bad_fit():
            return [nn.Linear(4, 8), nn.Linear(5, 2)]

        def reads_values():
            class Item(nn.Module):
                def forward(self, x):
                    return x * float(x.abs().max().item() > -1)
            return [nn.Linear(4, 4), Item(), nn.Linear(4, 2)]

        class Ids(nn.Module):
            def forward(self, x):
                return (x * 10).long()

        def int_cut():
            return [Ids(), nn.Embedding(64, 4), nn.Linear(4, 2)]

        class Keyed(nn.Module):
            def forward(self, x):
                return {"h${x}": x.float(), "ids": x}

        class Scaled(nn.Module):
            def __init__(self, emb, width):
                super().__init__()
                self.emb, self.lin = emb, nn.Linear(1, width)
            def forward(self, x):
                x = x["h${x}"] if isinstance(x, dict) else x
                return self.lin(x[..., :1] if x.dim() == 3 else x.unsqueeze(-1)) * self.emb.weight.sum()

        def keyed_tied():
            emb = nn.Embedding(4, 4)
            return [Keyed(), Scaled(emb, 4), Scaled(emb, 256)]

        def my_loss(output, target, weight=1.0):
            return weight * torch.nn.functional.cross_entropy(output, target)
    '''))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def custom(target: str, *more: str):
    cfg = compose(["model=custom", f"model._target_={target}", "cluster.pipelines=1",
                   "pipeline.stages=1", *more])
    validate(cfg)
    return cfg


def test_a_sequential_a_list_and_pipeline_blocks_all_give_named_blocks(user_module):
    blocks, names = models.build(custom(f"{user_module}.sequential", "+model.width=4").model)
    assert [type(b) for b in blocks] == [nn.Linear, nn.ReLU, nn.Linear] and names == ["0", "1", "2"]
    blocks, names = models.build(custom(f"{user_module}.as_list").model)
    assert len(blocks) == 2 and names == ["block0", "block1"]
    blocks, names = models.build(custom(f"{user_module}.tied").model)
    assert names == ["emb", "mid", "head"]


def test_extra_model_keys_become_the_callables_keyword_arguments(user_module):
    cfg = custom(f"{user_module}.sequential", "+model.width=6")
    assert cfg.model.kwargs == {"width": 6} and "width" not in cfg.model
    assert models.build(cfg.model)[0][0].in_features == 6
    with pytest.raises(ConfigError, match="model.kwargs: .*unexpected keyword"):
        models.build(custom(f"{user_module}.as_list", "+model.depth=3").model)


@pytest.mark.parametrize("target, message", [
    ("nowhere.build", "model._target_: cannot import 'nowhere.build'"),
    ("{m}.missing", "model._target_: cannot import"),
    ("{m}.empty", "returned no blocks"),
    ("{m}.not_modules", "returned a block that is not a torch.nn.Module"),
    ("{m}.wrong_kind", "returned a str; return a torch.nn.Sequential"),
])
def test_a_target_that_builds_no_blocks_is_one_line_naming_the_key(user_module, target, message):
    with pytest.raises(ConfigError, match=message) as err:
        models.build(custom(target.format(m=user_module)).model)
    assert "\n" not in str(err.value)


def test_a_custom_model_needs_its_target():
    with pytest.raises(ConfigError, match="model._target_"):
        validate(compose(["model=custom"]))


def test_boundaries_are_inferred_per_block_and_a_misfit_names_the_block(user_module):
    cfg = custom(f"{user_module}.as_list")
    (b,) = models.boundaries(cfg, torch.zeros(2, 5, dtype=torch.int64))
    assert str(b) == "((2, 5) float32, (2,) int64)"
    with pytest.raises(ConfigError, match=r"block 1 \(block1\) fails on block0's output \(2, 8\) float32"):
        models.boundaries(custom(f"{user_module}.bad_fit"), torch.zeros(2, 4))


def test_a_model_that_reads_values_is_traced_for_real(user_module):
    cfg = custom(f"{user_module}.reads_values")  # .item() has no meta version
    torch.manual_seed(5)
    state = torch.get_rng_state()
    assert [str(b) for b in models.boundaries(cfg, torch.zeros(3, 4))] == ["(3, 4) float32"] * 2
    assert torch.equal(state, torch.get_rng_state())  # the real trace leaves the RNG as it was


def test_tied_parameters_are_found_by_identity_and_untied_on_request(user_module):
    cfg = custom(f"{user_module}.tied")
    blocks, _ = models.build(cfg.model)
    assert models.tied_parameters(blocks) == [((0, "weight"), (2, "weight"))]
    cfg.model.tie_embeddings = False
    blocks, _ = models.build(cfg.model)
    assert models.tied_parameters(blocks) == []
    assert torch.equal(blocks[0].weight, blocks[2].weight)  # equal, but two parameters


def test_stage_ties_name_the_copy_in_each_stage(user_module):
    cfg = custom(f"{user_module}.tied")
    cfg.pipeline.partition = [1, 2]
    cfg.pipeline.stages = 3
    assert models.stage_ties(cfg, 0) == [((0, 2), "0.weight")]
    assert models.stage_ties(cfg, 1) == []
    assert models.stage_ties(cfg, 2) == [((0, 2), "0.weight")]
    cfg.pipeline.partition = [2, 2][:0] + [2]
    cfg.pipeline.stages = 2
    assert models.stage_ties(cfg, 0) == [((0, 1), "0.weight")]


def test_losses_by_name_function_or_class(user_module):
    out, target = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    ce = models.loss_function(OmegaConf.create({"loss": "cross_entropy"}))
    torch.testing.assert_close(ce(out, target), nn.functional.cross_entropy(out, target))
    fn = models.loss_function(OmegaConf.create({"loss": {"_target_": f"{user_module}.my_loss",
                                                         "weight": 2.0}}))
    torch.testing.assert_close(fn(out, target), 2 * nn.functional.cross_entropy(out, target))
    cls = models.loss_function(OmegaConf.create({"loss": {"_target_": "torch.nn.MSELoss"}}))
    assert isinstance(cls, nn.MSELoss)
    with pytest.raises(ConfigError, match="model.loss"):
        models.loss_function(OmegaConf.create({"loss": "hinge"}))


def test_cross_entropy_ignores_minus_100_and_works_per_token():
    logits, target = torch.randn(2, 3, 5), torch.tensor([[1, -100, 2], [-100, -100, 4]])
    kept = target != -100
    manual = nn.functional.cross_entropy(logits[kept], target[kept])
    torch.testing.assert_close(models.cross_entropy(logits, target), manual)


@pytest.mark.parametrize("arch, blocks", [("resnet_cifar", 11), ("resnet18", 10), ("resnet50", 18)])
def test_resnet_block_counts_match_the_schema(arch, blocks):
    cfg = compose([f"model={arch}", "data=digits", "model.num_classes=10"])
    assert models.count_blocks(cfg.model) == blocks


def test_a_cut_where_no_gradient_can_flow_back_is_refused(user_module):
    from sdpipe_cli.cli.preparing import prepare

    cfg = custom(f"{user_module}.int_cut", "pipeline.stages=2", "pipeline.partition=[1]",
                 "data=synthetic", "model.seq_len=4")
    with pytest.raises(ConfigError, match=r"pipeline.partition: the stages meet after block 0 \(block0\)"):
        prepare(cfg)
    cfg.pipeline.partition = [2]
    prepare(cfg)  # after the embedding, floats flow


# -- the layout the plan carries (model/layout.py) ------------------------------------------------

def _carried_and_traced(cfg):
    """A prepared run's carried layout (as a worker reads it back) and the one tracing finds."""
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.core.plan import RunPlan
    from sdpipe_cli.data import sources

    prepared = prepare(cfg)[0]
    plan = RunPlan.of(prepared)
    carried = layout.from_plan(plan.layout, plan.microbatch_size, plan.blocks)
    return carried, models.layout(prepared, sources.example(prepared, plan.microbatch_size)[0],
                                  plan.microbatch_size), prepared


@pytest.mark.parametrize("overrides", [
    ["model=mlp", "data=synthetic", "pipeline.stages=2"],
    ["model=gpt_tiny", "data=synthetic", "pipeline.stages=3", "model.tie_embeddings=true"],
    ["model=bert_tiny", "data=synthetic", "pipeline.stages=2"],
    ["model=gpt_tiny", "data=synthetic", "pipeline.stages=2", "pipeline.chunks=2",
     "pipeline.schedule=interleaved_1f1b", "train.precision=bf16"],
])
def test_the_plan_carries_the_layout_every_worker_traced_before(overrides):
    cfg = compose([*overrides, "cluster.pipelines=1"])
    validate(cfg)
    carried, traced, prepared = _carried_and_traced(cfg)
    assert carried == traced and carried.outputs and carried.microbatch_size == 4
    from sdpipe_cli.core.plan import RunPlan
    from sdpipe_cli.data import sources
    from sdpipe_cli.hetero import simulated_run

    assert simulated_run._activation_bytes(prepared, RunPlan.of(prepared)) == models.activation_bytes(
        prepared, sources.example(prepared, 4)[0])  # the simulator's, read from the plan
    bounds = list(prepared.pipeline.partition)
    for piece in range(len(bounds) + 1):  # what each piece receives and sends, as before
        start = ([0, *bounds][piece])
        stop = ([*bounds, carried.blocks][piece])
        assert carried.stage_boundaries(piece, bounds) == (
            traced.outputs[start - 1] if start else None,
            traced.outputs[stop - 1] if stop < carried.blocks else None)


def test_a_carried_layout_of_tuples_ints_and_ties_reads_back_and_gives_the_same_ties(user_module):
    carried, traced, _ = _carried_and_traced(custom(f"{user_module}.as_list", "data=synthetic",
                                                    "model.seq_len=4", "pipeline.stages=2"))
    assert carried == traced and str(carried.outputs[0]) == "((4, 4) float32, (4,) int64)"
    carried, traced, _ = _carried_and_traced(custom(f"{user_module}.int_cut", "data=synthetic",
                                                    "model.seq_len=4", "pipeline.stages=2",
                                                    "pipeline.partition=[2]"))
    assert carried == traced and carried.outputs[0].specs[0].dtype == torch.int64
    cfg = custom(f"{user_module}.tied", "pipeline.stages=3", "pipeline.partition=[1,2]")
    known = models.layout(cfg, torch.zeros(2, 4, dtype=torch.long), 2)
    again = layout.ModelLayout.of_plain(OmegaConf.to_container(OmegaConf.create(known.plain())))
    assert again == known and again.ties == (((0, "weight"), (2, "weight")),)
    for s in range(3):
        assert models.stage_ties(cfg, s, known=again) == models.stage_ties(cfg, s)


def test_the_layout_a_child_reads_from_the_run_file_is_the_launchers(user_module, tmp_path, monkeypatch):
    """The path a worker takes: the prepared config written as the launcher writes it, read back
    as a child reads it (its settings from the file's values); a dict key holding ``${`` (an
    interpolation to OmegaConf, were it written as it is) and a weight tied across stages."""
    from sdpipe_cli.config import derived, run_file
    from sdpipe_cli.core.plan import RunPlan

    cfg = custom(f"{user_module}.tied", "pipeline.stages=3", "pipeline.partition=[1,2]",
                 "data=synthetic", "model.seq_len=4")
    carried, traced, prepared = _carried_and_traced(cfg)
    assert carried == traced and carried.ties == (((0, "weight"), (2, "weight")),)
    for built in (prepared, _carried_and_traced(custom(
            f"{user_module}.keyed_tied", "data=synthetic", "model.seq_len=4", "pipeline.stages=2",
            "pipeline.partition=[2]"))[2]):
        run_file.save_run_config(derived.sealed(derived.with_run(built, dir=str(tmp_path))),
                                 tmp_path / "config.yaml")
        monkeypatch.setenv("SDPIPE_RUN_DIR", str(tmp_path))
        plan = RunPlan.of(run_file.load_child_config()[1])
        read = layout.from_plan(plan.layout, plan.microbatch_size, plan.blocks)
        assert read is not None and read == layout.ModelLayout.of_plain(RunPlan.of(built).layout)
    assert read.outputs[0].keys == ("h${x}", "ids") and read.ties


def test_a_layout_for_other_micro_batches_or_blocks_or_malformed_is_traced_again(caplog):
    known = layout.ModelLayout(4, (models.Boundary.tensor([4, 8]),) * 2)
    plain = known.plain()
    traced = layout.ModelLayout(4, (models.Boundary.tensor([4, 9]),) * 2)
    caplog.set_level("INFO", logger="sdpipe.layout")
    assert layout.carried_or_traced(plain, 4, 3, lambda: traced) == known and not caplog.records
    assert layout.carried_or_traced(None, 4, 3, lambda: traced) == traced
    assert "carries no layout" in caplog.text
    assert layout.from_plan(plain, 4, 3) == known
    assert layout.from_plan(plain, 8, 3) is None  # a resumed leg with larger micro-batches
    assert layout.from_plan(plain, 4, 5) is None
    assert layout.from_plan(None, 4, 3) is None  # a run prepared before plans carried one
    many = layout.ModelLayout(4, (models.Boundary.tensor([4, 8]),) * 10_001)
    assert many.carried() is None and known.carried() == plain  # a list the run file's readers refuse
    for broken in ({**plain, "outputs": ['{"specs":[["float99",[4]]],"keys":null,"single":true}']},
                   {**plain, "ties": "not json"}, {"microbatch_size": 4}):
        assert layout.from_plan(broken, 4, 2) is None


@pytest.mark.parametrize("overrides", [
    ["model=gpt_tiny", "data=synthetic", "pipeline.stages=2"],
    ["model=bert_tiny", "data=synthetic", "pipeline.stages=2", "model.hf={hidden_act: relu}"],
    ["model=resnet_cifar", "data=digits", "pipeline.stages=2"],
    ["model=custom", "model._target_=torch.nn.Sequential", "data=synthetic",
     "model.loss={_target_: torch.nn.CrossEntropyLoss, label_smoothing: 0.1}"],
])
def test_a_worker_builds_the_same_stage_from_its_settings_as_from_the_record(overrides, user_module):
    """A worker builds its stage, layout, ties and loss from its typed settings: the same
    weights bit for bit as from the config record, the same blocks, the same loss."""
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config.settings import settings_of
    from sdpipe_cli.data import sources

    if "model=custom" in overrides:
        overrides = [f"model._target_={user_module}.tied", "+model.kwargs.width=8",
                     *[o for o in overrides if not o.startswith("model._target_")],
                     "model.seq_len=4"]
    cfg = compose([*overrides, "cluster.pipelines=1"])
    validate(cfg)
    record = prepare(cfg)[0]
    settings = settings_of(record)
    for s in range(2):
        a, b = models.build_stage_module(record, s), models.build_stage_module(settings, s)
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
        assert models.chunk_slices(record, s) == models.chunk_slices(settings, s)
        assert models.stage_ties(record, s) == models.stage_ties(settings, s)
    example = sources.example(record, 4)[0]
    assert models.layout(record, example, 4) == models.layout(settings, sources.example(settings, 4)[0], 4)
    output, target = torch.randn(4, 7), torch.randint(0, 7, (4,))
    assert torch.equal(models.loss_function(record.model)(output, target),
                       models.loss_function(settings.model)(output, target))
