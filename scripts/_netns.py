"""Machines on one host: Linux network namespaces joined by a switch, every port shaped by tbf.

``scripts/bench_real_links.py``'s test bed (a sibling module, not a package: the script puts this
folder on ``sys.path``). :class:`Machines` makes N "machines", each a network namespace with its
own loopback and one port, address ``10.213.0.N/24``, joined by a bridge that lives in a switch
namespace through a veth pair per machine. Every port is shaped by the kernel's token bucket
(``tbf``), on the machine's side and on the switch's, so both directions of every link run at the
rate; :meth:`Machines.shape` changes it while runs go on. Traffic between two processes of one
machine stays on its loopback, unshaped, as on a real machine.

Why namespaces and real TCP rather than ``cluster.links``: the emulated links sleep a modelled
time, whereas here the bytes queue in the kernel, TCP backs off, and the store, the scheduler and
the collectives all share one link, as on a cluster.

Everything created is named ``sdpb<pid>-...`` (this process's id), so two runs on one host do
not collide and :meth:`Machines.close` removes exactly what it made: it ends the processes still
inside its namespaces (by their ids, as ``ip netns pids`` lists them) and deletes the namespaces,
which takes the bridge and the veth pairs with them. ``python scripts/_netns.py sink|send`` are
the two ends of the link measurement (:func:`measure`), started inside two machines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "sdpb"  # every namespace this module makes starts with it
SUBNET = "10.213.0"  # machine N is 10.213.0.N
PORT = "sdpb0"  # a machine's port (inside its namespace)
BRIDGE = "sdpbbr"
BURST, LATENCY = "64kb", "500ms"  # tbf's bucket and queue: a few packets at 15 Mbit/s, no drops
MEASURE_PORT = 5201
STOP_S = 5.0  # SIGTERM to SIGKILL, for what is still inside a namespace at close


class Unavailable(Exception):
    """This host cannot make the machines (not root, no iproute2, no tbf): one line why."""


def refusal() -> str | None:
    """Why this host cannot run namespaces, before anything is made; None if it may."""
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def address(machine: int) -> str:
    """The address of machine ``machine`` (1-based)."""
    return f"{SUBNET}.{machine}"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _zombie(pid: int) -> bool:
    """Ended, waiting to be reaped (by init, once its parent ended before it): nothing runs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def pids_in(namespace: str) -> list[int]:
    """The processes running inside ``namespace`` (``ip netns pids``, zombies left out)."""
    done = _run("ip", "netns", "pids", namespace, check=False)
    pids = [int(p) for p in done.stdout.split()] if done.returncode == 0 else []
    return [p for p in pids if not _zombie(p)]


def stale() -> list[str]:
    """Namespaces an earlier run of this module left (its process is gone, e.g. SIGKILLed)."""
    names = _run("ip", "netns", "list", check=False).stdout.split("\n")
    out = []
    for line in names:
        match = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if match and not _alive(int(match.group(2))):
            out.append(match.group(1))
    return out


class Machines:
    """N machines on a shaped switch (module docstring). Use as a context manager: the
    namespaces exist inside the ``with`` and are gone after it, whatever ended it."""

    def __init__(self, count: int, rate_mbit: float):
        self.count, self.rate = count, rate_mbit
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.created: list[str] = []

    def namespace(self, machine: int) -> str:
        return f"{self.tag}-m{machine}"

    def ports(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped port: each machine's, and the switch's to it."""
        return [p for m in range(1, self.count + 1)
                for p in ((self.namespace(m), PORT), (self.switch, f"{PREFIX}p{m}"))]

    def __enter__(self) -> Machines:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        for name in stale():
            if not pids_in(name):
                _run("ip", "netns", "del", name, check=False)
        self._add(self.switch)
        _run("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", BRIDGE, "up")
        for m in range(1, self.count + 1):
            ns, peer = self.namespace(m), f"{PREFIX}p{m}"
            self._add(ns)
            _run("ip", "link", "add", PORT, "netns", ns, "type", "veth", "peer", "name", peer,
                 "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", peer, "master", BRIDGE, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address(m)}/24", "dev", PORT)
            _run("ip", "-n", ns, "link", "set", PORT, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._shape(self.rate, first=True)

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)

    def _shape(self, rate: float, first: bool = False) -> None:
        """Every port at ``rate`` Mbit/s (0: unshaped): add, change or delete its tbf."""
        for ns, dev in self.ports():
            if rate > 0:
                verb = "add" if first or self.rate <= 0 else "change"
                done = _run("tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate",
                            f"{rate:g}mbit", "burst", BURST, "latency", LATENCY, check=False)
                if done.returncode != 0:
                    why = (done.stderr or done.stdout).strip()
                    raise Unavailable(f"cannot shape {dev} with tbf ({why})")
            elif not first and self.rate > 0:
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")
        self.rate = rate

    def shape(self, rate: float) -> None:
        """Change every port's rate while runs go on (``tc qdisc change``)."""
        self._shape(rate)

    def exec_prefix(self, machine: int) -> list[str]:
        """What runs a command inside machine ``machine``."""
        return ["ip", "netns", "exec", self.namespace(machine)]

    def leftovers(self, grace: float = 0.0) -> dict[str, list[int]]:
        """Processes still inside the machines after up to ``grace`` s (none once every run has
        ended well: a launcher waits for its children)."""
        deadline = time.monotonic() + grace
        while True:
            left = {ns: pids for ns in self.created if (pids := pids_in(ns))}
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    def close(self) -> None:
        """End what is still inside the namespaces (SIGTERM, then SIGKILL), then delete them."""
        left = [pid for pids in self.leftovers().values() for pid in pids]
        for pid in left:
            with _quiet():
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while any(_alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            with _quiet():
                os.kill(pid, signal.SIGKILL)
        for name in reversed(self.created):
            _run("ip", "netns", "del", name, check=False)
        self.created = []


class _quiet:
    """Ignore a process that ended meanwhile."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is ProcessLookupError


def measure(machines: Machines, seconds: float = 2.0, a: int = 1, b: int = 2) -> float:
    """Mbit/s of one TCP stream from machine ``b`` to machine ``a`` over ``seconds``: the bytes
    the receiver got over the time from its first byte to the end of the stream."""
    me = [sys.executable, str(Path(__file__).resolve())]
    sink = subprocess.Popen([*machines.exec_prefix(a), *me, "sink", address(a)],
                            stdout=subprocess.PIPE, text=True)
    try:
        send = subprocess.run([*machines.exec_prefix(b), *me, "send", address(a), f"{seconds:g}"],
                              capture_output=True, text=True, timeout=seconds + 60)
        out, _ = sink.communicate(timeout=seconds + 60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    if send.returncode != 0 or sink.returncode != 0:
        raise Unavailable(f"the link measurement failed: {send.stderr.strip()}")
    got = json.loads(out)
    return 8 * got["bytes"] / got["seconds"] / 1e6


def _sink(host: str) -> None:
    with socket.create_server((host, MEASURE_PORT)) as server:
        conn, _ = server.accept()
        with conn:
            total, first, last = 0, None, None
            while chunk := conn.recv(1 << 16):
                now = time.perf_counter()
                first = now if first is None else first
                total, last = total + len(chunk), now
    print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0.0}))


def _send(host: str, seconds: float) -> None:
    deadline = time.monotonic() + 30
    while True:  # the sink may still be starting
        try:
            conn = socket.create_connection((host, MEASURE_PORT), timeout=30)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    block = b"\0" * (1 << 16)
    with conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(block)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["sink"] and len(argv) == 2:
        _sink(argv[1])
    elif argv[:1] == ["send"] and len(argv) == 3:
        _send(argv[1], float(argv[2]))
    else:
        print("usage: _netns.py sink HOST | send HOST SECONDS", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
