"""The experiment trackers beside metrics.jsonl (``metrics.mlflow``, ``metrics.wandb``): what a
MetricsLog writes through them, read back with each tracker's own client or record format, and
the config checks that refuse them."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.config.validation import validate
from sdpipe_cli.runtime.metrics import MetricsLog, RunTracker, scalars
from sdpipe_cli.runtime.trackers import QUIET, MLflow, WandB, flat_params, open_sinks
from tests.helpers import one_error_line
from tests.trackers_read import mlflow_run, series, wandb_run
from tests.unit.test_metrics import evaluate, step


def feed(log: MetricsLog) -> list[dict]:
    """Two pipelines of two stages, three iterations each (their lines interleaved, pipeline 1
    a step behind), an evaluation, a decision and a global sync's consensus, as RunTracker
    makes them; the lines written."""
    tracker = RunTracker(pipelines=2, stages=2, target_iterations=6)
    events = []
    for n in (1, 2, 3):
        events += [step(1, 0, 1, n, loss=5.0 - n, time=0.5 * n),
                   {**step(0, 0, 0, n, time=0.5 * n), "group_size": 2, "round": n,
                    "group_kind": "group", "wait_s": 0.01 * n, "comm_s": 0.002}]
        if n > 1:
            events.append(step(3, 1, 1, n - 1, loss=5.5 - n, time=0.5 * n))
    events.append(evaluate(1, 0, 1, 3, 1.75))
    lines = [line for line in map(tracker.update, events) if line is not None]
    lines += [{"kind": "group", "stage": 0, "round": 1, "size": 2, "max_wait_s": 0.05,
               "time": 0.6, "members": [0, 1]},
              {"kind": "consensus", "stage": 1, "round": 2, "iteration": 2, "consensus": 0.125,
               "time": 1.1}]
    for line in lines:
        log.write(line)
    return lines


def expected(lines: list[dict], tag: str) -> dict[int, float]:
    return {step: value for line in lines for t, value, step, _ in scalars(line) if t == tag}


def wandb_core_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "wandb-core" in " ".join(p.cmdline())]


def test_mlflow_run_holds_the_scalars_and_the_config(tmp_path):
    run_dir = tmp_path / "run-7"
    config = {"train": {"steps": 3, "lr": 0.001, "seed": None}, "sync": {"name": "sdpipe"},
              "cluster": {"nodes": [{"host": "a", "gpus": 2}]}, "data": {"path": "x" * 7000},
              "model": {"kwargs": {}}}
    log = MetricsLog(run_dir / "metrics.jsonl", [MLflow(run_dir / "mlruns", run_dir.name, config)])
    lines = feed(log)
    log.close()

    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "run-7" and run.info.status == "FINISHED"
    for tag in ("pipeline0/loss", "pipeline1/loss", "pipeline0/stage0/wait_s", "pipeline0/lr",
                "pipeline0/val_loss", "stage0/group_size", "stage1/consensus"):
        assert expected(lines, tag), tag
        history = client.get_metric_history(run.info.run_id, tag)
        assert {m.step: m.value for m in history} == pytest.approx(expected(lines, tag)), tag
        assert len(history) == len(expected(lines, tag))
    assert client.get_metric_history(run.info.run_id, "pipeline1/loss")[-1].step == 2
    params = run.data.params
    assert params["train.steps"] == "3" and params["train.lr"] == "0.001"
    assert params["train.seed"] == "null" and params["sync.name"] == "sdpipe"
    assert params["cluster.nodes"] == '[{"host": "a", "gpus": 2}]' and params["model.kwargs"] == "{}"
    assert len(params["data.path"]) == 6000 and params["data.path"].endswith("...")


def test_a_later_leg_goes_on_in_the_same_mlflow_run_and_a_failure_is_marked(tmp_path):
    run_dir = tmp_path / "run"
    first = MLflow(run_dir / "mlruns", "run", {"train": {"steps": 3}})
    first.log([("pipeline0/loss", 2.0, 1, 0.5)])
    first.close()
    second = MLflow(run_dir / "mlruns", "run", {"train": {"steps": 6}, "sync": {"every": 2}})
    second.log([("pipeline0/loss", 1.5, 2, 1.0)])
    second.close(failed=True)
    client, run = mlflow_run(run_dir)  # one run
    assert run.info.status == "FAILED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                 "pipeline0/loss")] == [(1, 2.0), (2, 1.5)]
    assert run.data.params == {"train.steps": "3", "sync.every": "2"}  # the first leg's, and new keys


def test_flat_params_cut_and_clean_keys():
    assert flat_params({"a": {"b c": 1, "d:e": "x" * 20}, "f": [1, 2], "g/h": True},
                       limit=10) == {"a.b c": "1", "a.d_e": "xxxxxxx...", "f": "[1, 2]", "g_h": "true"}


def test_wandb_offline_run_holds_the_scalars_on_their_steps_and_ends(tmp_path):
    import wandb

    run_dir = tmp_path / "run-8"
    config = {"train": {"steps": 3, "lr": 0.001}, "sync": {"name": "sdpipe"}}
    log = MetricsLog(run_dir / "metrics.jsonl", [WandB(run_dir, run_dir.name, config)])
    lines = feed(log)
    log.close()
    assert not wandb_core_processes()  # its service ended with the run
    assert set(QUIET) <= set(wandb.Settings.model_fields)  # every quiet setting still exists

    run = wandb_run(run_dir)
    assert run["run"].display_name == "run-8" and run["run"].project == "sdpipe"
    assert run["config"]["train"] == {"steps": 3, "lr": 0.001}
    assert run["config"]["sync"] == {"name": "sdpipe"}
    assert run["exit"] == 0
    axes = {"pipeline0/loss": "pipeline0/iteration", "pipeline1/loss": "pipeline1/iteration",
            "pipeline0/stage0/wait_s": "pipeline0/iteration",
            "pipeline0/val_loss": "pipeline0/iteration", "stage0/group_size": "stage0/round",
            "stage1/consensus": "stage1/round"}
    for tag, axis in axes.items():
        assert run["metrics"][tag] == axis and expected(lines, tag)
        assert series(run["history"], tag, axis) == pytest.approx(expected(lines, tag)), tag
    assert list(series(run["history"], "pipeline1/loss", "pipeline1/iteration")) == [1, 2]
    assert (run_dir / "metrics.jsonl").exists()


def test_open_sinks_opens_what_the_config_asks_for(tmp_path):
    def opened(overrides):
        cfg = compose(overrides)
        return open_sinks(settings_of(cfg).metrics, tmp_path, cfg)

    assert opened([]) == []
    sinks = opened(["metrics.mlflow=true"])
    assert [type(s).__name__ for s in sinks] == ["MLflow"]
    sinks[0].close()
    _, run = mlflow_run(tmp_path)
    assert run.info.run_name == tmp_path.name
    assert run.data.params["metrics.mlflow"] == "true" and run.data.params["metrics.wandb"] == "off"


def test_importing_sdpipe_imports_no_tracker():
    code = ("import sys, sdpipe_cli.runtime.metrics, sdpipe_cli.runtime.trackers, "
            "sdpipe_cli.config.validation; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'wandb'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("package, override", [("mlflow", "metrics.mlflow=true"),
                                               ("wandb", "metrics.wandb=offline")])
def test_a_tracker_without_its_package_is_refused_in_one_line(package, override, monkeypatch,
                                                              capsys):
    monkeypatch.setitem(sys.modules, package, None)  # what a missing package looks like to import
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        validate(compose([override]))
    assert err.value.key == key
    assert f"needs the {package} package: pip install -e '.[{package}]'" in str(err.value)
    assert main(["train", override]) == 2
    assert f"pip install -e '.[{package}]'" in one_error_line(capsys.readouterr().err, key)


def test_metrics_wandb_is_off_or_offline(capsys):
    assert main(["train", "metrics.wandb=online"]) == 2
    assert "is 'online'; choose off or offline" in one_error_line(capsys.readouterr().err,
                                                                  "metrics.wandb")
    with pytest.raises(ConfigError, match="is 'True'; choose off or offline"):
        validate(compose(["metrics.wandb=true"]))
    for fine in ("false", "OFF"):  # off is the default
        validate(compose([f"metrics.wandb={fine}"]))
