"""Users' code named in a config (``model._target_``, ``data._target_``, ``model.loss``) that does
not import: exactly one ``sdpipe: error: KEY: ...`` line, nothing of Hydra's, no run folder."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from sdpipe_cli.cli import parsing
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.targets import import_callable
from sdpipe_cli.model import models


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Error getting object" not in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: "), captured.err
    return lines[0]


@pytest.fixture
def logged(caplog):
    """What is logged at all (Hydra's get_object logs its failure, which reaches stderr)."""
    caplog.set_level(logging.DEBUG)
    return caplog


CASES = {
    "model": (["model=custom", "model._target_=no.such.module.build"],
              "sdpipe: error: model._target_: cannot import 'no.such.module.build': "
              "No module named 'no'"),
    "data": (["model=mlp", "data=custom", "data._target_=no.such.thing"],
             "sdpipe: error: data._target_: cannot import 'no.such.thing': No module named 'no'"),
}


@pytest.mark.parametrize("overrides, expected", CASES.values(), ids=CASES.keys())
def test_a_target_that_does_not_import_is_one_line_and_no_run_folder(tmp_path, capsys, logged,
                                                                     overrides, expected):
    run_dir = tmp_path / "run"
    code = parsing.main(["train", *overrides, "train.steps=2", f"run.dir={run_dir}"])
    assert code == 2
    assert one_error_line(capsys) == expected
    assert not [r for r in logged.records if r.levelno >= logging.WARNING], logged.text
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_loss_target_that_does_not_import_is_one_error_naming_model_loss(logged):
    """``model.loss`` is resolved where the loss is first needed (a worker): the same one line."""
    cfg = OmegaConf.create({"loss": {"_target_": "no.such.loss"}})
    with pytest.raises(ConfigError) as refused:
        models.loss_function(cfg)
    assert str(refused.value) == "model.loss._target_: cannot import 'no.such.loss': No module named 'no'"
    assert not logged.records, logged.text


@pytest.mark.parametrize("target, reason", [
    ("os.path.no_such_name", "cannot import 'os.path.no_such_name': 'os.path' has no attribute "
                             "'no_such_name'"),
    ("json.no_such_module.x", "cannot import 'json.no_such_module.x': 'json' has no attribute "
                              "'no_such_module'"),
    (".relative", "cannot import '.relative': not a dotted path"),
    ("a..b", "cannot import 'a..b': not a dotted path"),
    ("os.sep", "'os.sep' is not callable"),
])
def test_names_that_are_not_callables_are_refused_naming_the_key(logged, target, reason):
    with pytest.raises(ConfigError, match="^model._target_: " + reason.replace(".", r"\.")):
        import_callable(target, "model._target_")
    assert not logged.records, logged.text


def test_a_module_that_fails_importing_another_names_the_missing_one(tmp_path, monkeypatch, logged):
    (tmp_path / "broken_nets_x1.py").write_text("import no_such_dependency_x1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="No module named 'no_such_dependency_x1'"):
        import_callable("broken_nets_x1.build", "model._target_")


def test_a_module_that_calls_sys_exit_as_it_is_imported_is_one_error(tmp_path, monkeypatch, logged):
    """Not sdpipe's exit: the import of the user's module failed (Ctrl-C below stays an interrupt)."""
    (tmp_path / "exiting_nets_x1.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        import_callable("exiting_nets_x1.build", "data._target_")
    assert str(refused.value) == ("data._target_: cannot import 'exiting_nets_x1.build': importing "
                                  "it called sys.exit(3)")
    assert not logged.records, logged.text


def test_ctrl_c_while_a_module_is_imported_stays_an_interrupt(tmp_path, monkeypatch):
    (tmp_path / "interrupted_nets_x1.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        import_callable("interrupted_nets_x1.build", "model._target_")


@pytest.mark.parametrize("target, expected", [
    ("json.dumps", "dumps"), ("os.path.join", "join"), ("collections.OrderedDict", "OrderedDict"),
    ("xml.dom.minidom.parseString", "parseString"),  # a submodule not imported by its package
])
def test_importable_callables_are_found(target, expected):
    assert import_callable(target, "model._target_").__name__ == expected
