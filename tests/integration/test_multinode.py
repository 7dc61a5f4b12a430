"""Clusters of real nodes: one launcher per node, the first hosting the store and the scheduler.

Both "nodes" run on this machine (host 127.0.0.1), each launcher started as a user would start
it on its own machine; the run folder is shared, as it would be on a shared filesystem.
"""

from __future__ import annotations

import signal
import time

import pytest

from sdpipe_cli.config import job_env
from tests.helpers import finish, free_port, metrics, sdpipe_beside, sdpipe_popen, worker_process

pytestmark = pytest.mark.multiprocess

NODES = ("cluster.pipelines=2", "pipeline.stages=2", "cluster.device=cpu",
         "cluster.nodes=[{name: a, host: 127.0.0.1, devices: [{}, {}]},"
         " {name: b, host: 127.0.0.1, devices: [{}, {}]}]",
         "model=mlp", "data=synthetic", "train.eval_every=0", "data.eval_batches=1",
         # pinned: these tests place launchers and handle failures; left to choose, the run
         # measures its (loopback) links, and on a loaded machine may meet every few steps,
         # which rounds the budget up to whole meetings
         "sync.every=1", "sync.precision=fp32")



def _job(node: int, port: int) -> dict[str, str]:
    """The environment srun (one task per node) gives the launcher on node ``node``, for a job
    whose store port is ``port``. (torchrun's environment is read by the same code into the same
    overrides: tests/unit/test_job_env.py.)"""
    return {"SLURM_JOB_ID": str(port - job_env.PORT_BASE), "SLURM_NODEID": str(node),
            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURMD_NODENAME": f"gpu0{7 + node}",
            "SLURM_JOB_NUM_NODES": "2"}


def test_srun_places_each_launcher_without_run_node_or_port(run_dir, monkeypatch):
    """Two launchers given only what srun sets: each finds its node and the job's port, and
    they train together (the second node's launcher may start first: it waits for the store).
    The failure and restart tests below place their launchers with run.node. The first node's
    launcher runs in the test's process, its environment srun's."""
    port = free_port(range(job_env.PORT_BASE, job_env.PORT_BASE + job_env.PORT_SPAN))
    common = (*NODES, f"run.dir={run_dir}", "train.steps=4")
    second = sdpipe_popen("train", *common, env=_job(1, port))
    time.sleep(1.0)
    for key, value in _job(0, port).items():
        monkeypatch.setenv(key, value)
    first, (rc_b, err_b, _) = sdpipe_beside(lambda command: finish(second), run_dir, "train", *common)
    rc_a, err_a = first.returncode, first.stderr
    assert (rc_a, rc_b) == (0, 0), (err_a, err_b)
    source = "SLURM"
    assert f"sdpipe: {source} node 0" in err_a and f"run.node=a run.port={port}" in err_a
    assert f"sdpipe: {source} node 1" in err_b and f"run.node=b run.port={port}" in err_b
    done = metrics(run_dir, "done")
    assert sorted(d["rank"] for d in done) == [0, 1, 2, 3]
    assert {d["device"] for d in done if d["pipeline"] == 1} == {"b:0", "b:1"}
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 2 * 4
    # the final global sync made the replicas of each stage identical across the nodes
    for s in (0, 1):
        assert len({d["param_digest"] for d in done if d["stage"] == s}) == 1
    assert (run_dir / "config.b.yaml").read_text() == (run_dir / "config.yaml").read_text()
    assert all((run_dir / "logs" / f"{r}.log").exists() for r in range(4))


def kill_on_node_b(run_dir, common: tuple, rank: int, after: int) -> list[tuple[int, str]]:
    """Start both nodes' launchers, SIGKILL worker ``rank`` (on node b) once ``after`` train
    lines are in, and wait for both: [(exit code, stderr) of node a, of node b]. Node a's
    launcher runs in the test's process (nothing here acts on it), node b's as its own."""

    def node_b(command) -> tuple[int, str]:
        second = sdpipe_popen("train", *common, "run.node=b")
        try:
            victim = None

            def training() -> bool:
                nonlocal victim
                if (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir, "train")) >= after:
                    victim = worker_process(run_dir, rank)
                return victim is not None

            command.wait_for(training, timeout=60, what="node b's worker training")
            victim.send_signal(signal.SIGKILL)
            rc_b, err_b, _ = finish(second, 120)
        finally:
            if second.poll() is None:
                second.kill()
        return rc_b, err_b

    first, (rc_b, err_b) = sdpipe_beside(node_b, run_dir, "train", *common, "run.node=a",
                                         timeout=180)
    return [(first.returncode, first.stderr), (rc_b, err_b)]


def test_a_failure_on_one_node_stops_both(run_dir):
    port = free_port()
    common = (*NODES, f"run.port={port}", f"run.dir={run_dir}", "train.steps=100000",
              "cluster.compute_ms=20")
    (rc_a, err_a), (rc_b, err_b) = kill_on_node_b(run_dir, common, rank=3, after=1)
    assert rc_b == 1 and "rank 3" in err_b and "SIGKILL" in err_b, err_b
    assert rc_a == 1, err_a
    assert "another node failed" in err_a or "rank" in err_a


def test_a_lost_pipeline_is_restarted_by_its_own_nodes_launcher(run_dir):
    """fault.on_pipeline_loss=restart on two nodes, a pipeline each: node b's worker is killed;
    node b's launcher restarts its pipeline, which heals from node a's replicas over the network,
    and both launchers end well with identical replicas and the budget exact."""
    port = free_port()
    steps = 40
    common = (*NODES, f"run.port={port}", f"run.dir={run_dir}", f"train.steps={steps}",
              "cluster.compute_ms=10", "fault.on_pipeline_loss=restart",
              "fault.restart_backoff=0.1")
    # rank 2: pipeline 1, stage 0, on node b
    (rc_a, err_a), (rc_b, err_b) = kill_on_node_b(run_dir, common, rank=2, after=4)
    assert (rc_a, rc_b) == (0, 0), (err_a, err_b)
    assert "pipeline 1 lost, it will be restarted" in err_b and "pipeline 1 restarted" in err_b
    (restart,) = metrics(run_dir, "restart")
    assert restart["pipeline"] == 1 and restart["incarnation"] == 1
    heals = metrics(run_dir, "heal")
    assert sorted(h["stage"] for h in heals) == [0, 1]
    assert all(h["pipeline"] == 1 and h["source"] == 0 for h in heals)  # from node a
    last = {}
    for m in metrics(run_dir, "train"):
        last[m["pipeline"]] = m["step"]
    assert sum(last.values()) == 2 * steps
    done = {d["rank"]: d for d in metrics(run_dir, "done")}
    for s in (0, 1):
        assert len({d["param_digest"] for d in done.values() if d["stage"] == s}) == 1
