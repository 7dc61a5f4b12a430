"""Where sdpipe listens: the store on exactly the configured address, foreign hosts refused at once.

No test here sends a packet anywhere but loopback: foreign addresses are documentation ranges
(RFC 5737) that are only compared with this machine's list, never resolved or contacted.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import psutil
import pytest

from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.runtime import network, store

FOREIGN = "203.0.113.7"  # TEST-NET-3: never an address of this machine
TWO_NODES = ("cluster.nodes=[{name: a, host: 127.0.0.1, devices: [{}, {}]},"
             " {name: b, host: " + FOREIGN + ", devices: [{}, {}]}]",
             "run.port=29999", "model=mlp", "data=synthetic")


def listeners(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def test_local_addresses_include_loopback():
    mine = network.local_addresses()
    assert "127.0.0.1" in mine
    assert all("%" not in a for a in mine)


def test_check_local_accepts_this_machines_addresses_and_explicit_wildcards():
    assert network.check_local("127.0.0.1") == "127.0.0.1"
    assert network.check_local("localhost") in ("127.0.0.1", "::1")  # from /etc/hosts
    assert network.check_local("0.0.0.0") == "0.0.0.0"
    assert network.check_local("::") == "::"


def test_check_local_refuses_a_foreign_address_and_lists_ours():
    with pytest.raises(network.AddressError) as bad:
        network.check_local(FOREIGN)
    assert FOREIGN in str(bad.value) and "127.0.0.1" in str(bad.value)


def test_interface_of_loopback():
    assert network.interface_of("127.0.0.1") is not None
    assert network.interface_of(FOREIGN) is None


def test_the_store_listens_only_on_its_address():
    """A real TCPStore server: its one listening socket is 127.0.0.1:port, and clients work."""
    master, bound = store.host_store("127.0.0.1", 0, timeout=10)
    assert bound  # this torch takes a listening socket
    try:
        mine = [entry for entry in listeners(os.getpid()) if entry[1] == master.port]
        assert mine == [("127.0.0.1", master.port)]
        client = store.connect("127.0.0.1", master.port, timeout=10)
        client.set("k", "v")
        assert master.get("k") == b"v"
    finally:
        del master


def test_an_explicit_wildcard_listens_on_every_ipv4_interface():
    master, _ = store.host_store("0.0.0.0", 0, timeout=10)
    try:
        assert [e for e in listeners(os.getpid()) if e[1] == master.port] == [("0.0.0.0", master.port)]
    finally:
        del master


def test_a_busy_port_fails_before_a_store_exists():
    sock = network.listen("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            store.host_store("127.0.0.1", sock.getsockname()[1], timeout=5)
    finally:
        sock.close()


def test_connect_patiently_gives_up_after_its_timeout():
    sock = network.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    start = time.monotonic()
    with pytest.raises((RuntimeError, OSError)):  # c10d's errors for "nobody there"
        store.connect_patiently("127.0.0.1", port, timeout=1.5, attempt_s=0.5)
    assert 1.0 < time.monotonic() - start < 10


def test_patient_client_keeps_the_full_timeout():
    master, _ = store.host_store("127.0.0.1", 0, timeout=10)
    client = store.connect_patiently("127.0.0.1", master.port, timeout=30, attempt_s=0.5)
    assert client.timeout == timedelta(seconds=30)
    del client, master


def test_gloo_and_nccl_are_pinned_to_the_stores_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    from sdpipe_cli.cli.launcher import pinned_interfaces

    cfg = compose([])
    lo = network.interface_of("127.0.0.1")
    assert pinned_interfaces(cfg) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")  # the user's choice is kept
    assert pinned_interfaces(cfg)["GLOO_SOCKET_IFNAME"] == "mine"
    assert pinned_interfaces(compose(["cluster.host=0.0.0.0"])) == {}


@pytest.mark.parametrize("overrides, key", [
    ([f"cluster.host={FOREIGN}"], "cluster.host"),
    ([*TWO_NODES, "run.node=b"], "cluster.nodes[1].host"),
    (["cluster.nodes=[{name: a, host: 0.0.0.0, devices: [{}, {}]},"
      " {name: b, host: 127.0.0.1, devices: [{}, {}]}]", "run.port=29999", "run.node=b"],
     "cluster.nodes[0].host"),
])
def test_hosts_that_cannot_be_listened_on_are_refused(overrides, key):
    cfg = compose(overrides)
    validate(cfg)
    with pytest.raises(ConfigError) as bad:
        network.check_hosts(cfg)
    assert bad.value.key == key


def test_another_nodes_address_is_not_checked_here():
    cfg = compose([*TWO_NODES, "run.node=a"])
    validate(cfg)
    assert network.check_hosts(cfg) == "127.0.0.1"  # b's address is b's launcher's business


def test_workers_start_together_and_a_restarted_one_does_not_wait():
    """A real store: the first two workers wait until the third is in; a restarted worker counts
    itself in without waiting; a worker short of company gives up after its timeout."""
    import threading

    master, _ = store.host_store("127.0.0.1", 0, 10)
    clients = [store.connect("127.0.0.1", master.port, 10) for _ in range(3)]
    done: dict[int, tuple[bool, float]] = {}

    def worker(i: int) -> None:
        began = time.monotonic()
        done[i] = (store.start_together(clients[i], 3, timeout=10), time.monotonic() - began)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not done  # both wait for the third
    assert store.start_together(clients[2], 3, timeout=10, wait=False)  # e.g. a restarted worker
    for t in threads:
        t.join(10)
    assert [ok for ok, _ in done.values()] == [True, True]
    assert all(0.25 < waited < 5 for _, waited in done.values())

    lonely, _ = store.host_store("127.0.0.1", 0, 10)
    began = time.monotonic()
    assert store.start_together(store.connect("127.0.0.1", lonely.port, 10), 2, timeout=0.2) is False
    assert time.monotonic() - began < 5
