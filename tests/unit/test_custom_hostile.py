"""A user's own model or data set that misbehaves: one line naming the key, exit 2, nothing left.

``data=custom`` whose ``__len__`` lies or fails, a ``model._target_`` or ``data._target_`` that
raises or calls ``sys.exit()``, and a model whose blocks pass a floating dtype the next block's
weights cannot take (the meta device does not check dtypes, so the launcher's pre-check tries that
block for real). Each is refused in the launcher, before any process starts; what works (a
float64 activation into float64 weights, across a stage too; a block that casts what it gets;
float64 cast to bf16 on the wire under ``train.precision=bf16``) passes the pre-check (and trains
across a stage: tests/integration/test_custom_dtypes.py).
"""

from __future__ import annotations

import sys

import pytest

from sdpipe_cli.cli.parsing import main
from tests.helpers import one_error_line, user_module

NAME = "hostile_user_code"
SOURCE = '''
    import sys

    import torch
    from torch import nn
    from torch.utils.data import Dataset


    class Sized(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            if self.n == "raise":
                raise RuntimeError("the index is not there")
            return self.n

        def __getitem__(self, i):
            return torch.randint(0, 32, (16,)), torch.randint(0, 32, (16,))


    def negative():
        return Sized(-5)

    def huge():
        return Sized(10**18)

    def raising():
        return Sized("raise")

    def huge_val():
        return Sized(100), Sized(10**18)

    def data_exits():
        sys.exit(7)

    def data_interrupted():
        raise KeyboardInterrupt


    def build_raises(width=16):
        raise RuntimeError("weights file\\n missing")

    def build_type_error():
        return nn.Linear("sixteen", 3)

    def build_exits():
        sys.exit(7)

    def build_interrupted():
        raise KeyboardInterrupt


    class Double(nn.Module):
        def forward(self, x):
            return x.double()


    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x.float())


    def _emb():
        return nn.Embedding(256, 16)

    def float64_into_float32():
        return nn.Sequential(_emb(), nn.Linear(16, 16), Double(), nn.Linear(16, 256))

    def float64_through_relu():
        return nn.Sequential(_emb(), Double(), nn.ReLU(), nn.Linear(16, 256))

    def float32_into_float64():
        return nn.Sequential(_emb(), nn.Linear(16, 16, dtype=torch.float64), nn.Linear(16, 256))

    def float64_weights_after_double():
        return nn.Sequential(_emb(), Double(), nn.Linear(16, 16, dtype=torch.float64),
                             nn.Linear(16, 256, dtype=torch.float64))

    def float64_cast_back():
        return nn.Sequential(_emb(), Double(), Cast(), nn.Linear(16, 256))

    def float64_out():
        return nn.Sequential(_emb(), nn.Linear(16, 16), nn.Linear(16, 256), Double())
'''

SMALL = ("train.steps=2", "train.batch_size=8", "cluster.pipelines=1")
MODEL = ("data=synthetic", "model=custom", *SMALL)
DATA = ("model=mlp", "data=custom", *SMALL)


@pytest.fixture
def code(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, NAME, raising=False)  # this test's file, not an earlier one's
    user_module(tmp_path, monkeypatch, NAME, SOURCE)
    return NAME


def refused(capsys, tmp_path, key: str, *argv: str) -> str:
    """``sdpipe train ARGV``: exit 2, one line naming ``key``, no traceback, no run folder."""
    run = tmp_path / "run"
    rc = main(["train", f"run.dir={run}", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not run.exists() or not any(run.iterdir())
    return one_error_line(err, key)


# -- 1. a data set's length ---------------------------------------------------------------------

@pytest.mark.parametrize("maker, says", [
    ("negative", "the training set's __len__ returned -5; it must return the number of samples"),
    ("huge", "the training set's __len__ returned 1000000000000000000, more than the 2147483648"),
    ("raising", "the training set's __len__ failed: RuntimeError: the index is not there"),
    ("huge_val", "the validation set's __len__ returned 1000000000000000000, more than"),
])
def test_a_data_set_whose_len_lies_or_fails_is_one_line(code, capsys, tmp_path, maker, says):
    line = refused(capsys, tmp_path, "data._target_", *DATA, f"data._target_={code}.{maker}")
    assert says in line


# -- 2. the user's builder fails ---------------------------------------------------------------

def test_a_model_builder_that_raises_is_one_line_naming_model_target(code, capsys, tmp_path):
    line = refused(capsys, tmp_path, "model._target_", *MODEL, f"model._target_={code}.build_raises")
    assert line.endswith(f"{code}.build_raises() failed: RuntimeError: weights file missing")


def test_a_type_error_inside_the_builder_is_not_blamed_on_its_arguments(code, capsys, tmp_path):
    line = refused(capsys, tmp_path, "model._target_", *MODEL, f"model._target_={code}.build_type_error")
    assert "build_type_error() failed: TypeError: " in line
    line = refused(capsys, tmp_path, "model.kwargs", *MODEL, f"model._target_={code}.build_raises",
                   "+model.depth=3")
    assert "unexpected keyword argument 'depth'" in line


def test_a_model_builder_calling_sys_exit_is_one_line_and_exit_2(code, capsys, tmp_path):
    line = refused(capsys, tmp_path, "model._target_", *MODEL, f"model._target_={code}.build_exits")
    assert line.endswith(f"{code}.build_exits called sys.exit(7) while building the model")


def test_a_data_maker_calling_sys_exit_is_one_line_and_exit_2(code, capsys, tmp_path):
    line = refused(capsys, tmp_path, "data._target_", *DATA, f"data._target_={code}.data_exits")
    assert line.endswith(f"{code}.data_exits called sys.exit(7) while making the data set")


@pytest.mark.parametrize("key, argv", [("model._target_", MODEL), ("data._target_", DATA)],
                         ids=["model", "data"])
def test_a_module_calling_sys_exit_as_it_is_imported_is_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                             capsys, key, argv):
    user_module(tmp_path, monkeypatch, "exits_when_imported", "import sys\nsys.exit(3)\n")
    line = refused(capsys, tmp_path, key, *argv, f"{key}=exits_when_imported.build")
    assert line.endswith("cannot import 'exits_when_imported.build': importing it called sys.exit(3)")


@pytest.mark.parametrize("argv", [(*MODEL, f"model._target_={NAME}.build_interrupted"),
                                  (*DATA, f"data._target_={NAME}.data_interrupted")])
def test_ctrl_c_in_the_users_code_stays_an_interrupt(code, tmp_path, argv):
    with pytest.raises(KeyboardInterrupt):
        main(["train", f"run.dir={tmp_path / 'run'}", *argv])
    assert not (tmp_path / "run").exists()


# -- 3. floating dtypes between blocks -----------------------------------------------------------

@pytest.mark.parametrize("model, extra, says", [
    ("float64_into_float32", "pipeline.partition=[2]",
     "block 2 (2) returns torch.float64, but block 3 (3)'s weights are torch.float32 and it fails"),
    ("float64_into_float32", "pipeline.partition=[3]", "block 2 (2) returns torch.float64"),
    ("float64_through_relu", "pipeline.partition=[2]",
     "block 2 (2) returns torch.float64, but block 3 (3)'s weights are torch.float32"),
    ("float32_into_float64", "pipeline.partition=[1]",
     "block 0 (0) returns torch.float32, but block 1 (1)'s weights are torch.float64"),
    ("float64_weights_after_double", "train.precision=bf16",
     "block 1 (1) ends a stage and its output crosses to the next as torch.bfloat16 "
     "(train.precision=bf16), but block 2 (2)'s weights are torch.float64"),
])
def test_a_dtype_the_next_block_cannot_take_is_refused_before_any_process(code, capsys, tmp_path,
                                                                           model, extra, says):
    line = refused(capsys, tmp_path, "model._target_", *MODEL, "pipeline.stages=2", extra,
                   f"model._target_={code}.{model}")
    assert says in line and "mat1 and mat2 must have the same dtype" in line


@pytest.mark.parametrize("model, extra", [
    ("float64_weights_after_double", "pipeline.partition=[2]"),  # float64 crosses into float64
    ("float64_cast_back", "pipeline.partition=[2]"),  # the block casts what it gets
    ("float64_out", "pipeline.partition=[2]"),  # the loss takes float64 outputs
    ("float64_into_float32", "train.precision=bf16 pipeline.partition=[3]"),  # bf16 on the wire
])
def test_dtypes_that_work_pass_the_pre_check(code, tmp_path, model, extra):
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config.composition import compose

    cfg = compose([*MODEL, "pipeline.stages=2", *extra.split(), f"model._target_={code}.{model}",
                   f"run.dir={tmp_path / 'run'}"])
    prepare(cfg)  # models.check among the rest; raises if refused


