"""Reading SLURM's and torchrun's environment into a launcher's node and port (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from sdpipe_cli.config.job_env import PORT_BASE, PORT_SPAN, detect, expand_nodelist, infer, port_for_job
from sdpipe_cli.config.schema import ConfigError

REAL = [{"name": "a", "host": "10.0.0.1"}, {"name": "b", "host": "10.0.0.2"}]
BY_HOSTNAME = [{"name": "gpu07"}, {"name": "gpu08"}]


def slurm(node: int, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "123456", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "gpu[07-08]",
            **extra}


def test_nodelists_expand_as_slurm_writes_them():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("rack[1-2]-gpu[1,3]") == ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1",
                                                     "rack2-gpu3"]
    assert expand_nodelist("solo") == ["solo"]


@given(prefix=st.sampled_from(["gpu", "n", "node-"]), lo=st.integers(0, 500),
       count=st.integers(1, 40), width=st.integers(1, 4))
def test_a_range_expands_to_every_number_in_it_padded(prefix, lo, count, width):
    hi = lo + count - 1
    names = expand_nodelist(f"{prefix}[{lo:0{width}d}-{hi:0{width}d}]")
    assert len(names) == count
    assert names == [f"{prefix}{n:0{width}d}" for n in range(lo, hi + 1)]


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01-03]", "gpu[a-b]", "gpu[5-3]"])
def test_a_nodelist_that_cannot_be_read_names_the_variable(bad):
    with pytest.raises(ConfigError) as err:
        expand_nodelist(bad)
    assert err.value.key == "SLURM_JOB_NODELIST"


@given(st.integers(0, 10**9))
def test_every_job_gets_a_port_in_its_band(job_id):
    assert PORT_BASE <= port_for_job(job_id) < PORT_BASE + PORT_SPAN
    assert port_for_job(job_id) == port_for_job(job_id)  # each node derives the same


def test_outside_a_job_nothing_is_placed():
    assert detect({"HOME": "/root"}) is None
    assert infer(REAL, None, 0, None) == {}


def test_srun_places_the_launcher_by_node_id_and_derives_the_port():
    job = detect(slurm(1))
    assert infer(REAL, None, 0, job) == {"run.node": "b", "run.port": port_for_job(123456)}


def test_what_the_user_set_is_kept():
    assert infer(REAL, "a", 29500, detect(slurm(1))) == {}


def test_nodes_named_by_hostname_take_the_name_as_host_and_match_slurmd_nodename():
    job = detect(slurm(0, SLURMD_NODENAME="gpu08"))  # the name wins over the index
    assert infer(BY_HOSTNAME, None, 0, job) == {
        "cluster.nodes[0].host": "gpu07", "cluster.nodes[1].host": "gpu08",
        "run.node": "gpu08", "run.port": port_for_job(123456)}


def test_emulated_nodes_stay_emulated_inside_an_allocation():
    emulated = [{"name": "fast"}, {"name": "slow"}]  # not the job's hosts: one machine
    assert infer(emulated, None, 0, detect(slurm(0))) == {}
    assert infer([{"name": "gpu07"}], None, 0, detect(slurm(0))) == {}  # one node: nothing to do


def test_torchrun_places_by_group_rank_beside_its_own_store():
    job = detect({"GROUP_RANK": "1", "MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1",
                  **slurm(0)})  # srun torchrun ...: torchrun's placement wins
    assert job.source == "torchrun"
    assert infer(REAL, None, 0, job) == {"run.node": "b", "run.port": 29501}
    assert infer(BY_HOSTNAME, None, 0, job) == {}  # torchrun lists no hosts: nodes need theirs


def test_a_node_index_beyond_the_cluster_and_bad_numbers_are_named():
    with pytest.raises(ConfigError) as err:
        infer(REAL, None, 0, detect(slurm(2)))
    assert err.value.key == "run.node" and "SLURM node 2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        detect({"GROUP_RANK": "x", "MASTER_PORT": "29500"})
    assert err.value.key == "GROUP_RANK"
