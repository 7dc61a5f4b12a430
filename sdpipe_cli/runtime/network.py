"""Where sdpipe listens: only on the address the config names, and only if it is this machine's.

torch's ``TCPStore`` server binds every interface when it creates its own socket, and gloo binds
whatever the machine's hostname resolves to. The store has no authentication (torchrun's trust
model), so listening more widely than asked hands the run to anyone who can reach the machine.
Here the launcher binds the store's socket itself, to exactly ``host:port``, and gives it to the
store (``master_listen_fd``, the hook torchrun uses to reuse its socket); gloo and NCCL are pinned
to the interface that carries that address.

A host that is not one of this machine's addresses is refused before anything starts: binding or
connecting to it could only hang or fail later. The wildcards ``0.0.0.0`` and ``::`` are accepted
when written explicitly, since that is a deliberate choice.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import cast

import psutil
from omegaconf import DictConfig

from sdpipe_cli.config.schema import ConfigError

WILDCARDS = ("0.0.0.0", "::")
BACKLOG = 2048  # pending connections: P x S workers connect at once, several times each


class AddressError(ValueError):
    """``host`` is not an address this machine can listen on; the message lists the ones it has."""


def local_addresses() -> list[str]:
    """This machine's IP addresses, as ``psutil.net_if_addrs`` reports them (scope ids dropped)."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                address = a.address.split("%", 1)[0]
                if address not in found:
                    found.append(address)
    return found


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` stands for: itself if it is one, else its name resolution
    (``/etc/hosts`` or DNS; nothing is contacted)."""
    try:
        return [str(ipaddress.ip_address(host.split("%", 1)[0]))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise AddressError(f"'{host}' does not resolve ({err})") from None
    # an IPv4 or IPv6 answer's address is a str (the (int, bytes) form is for builds without IPv6)
    return list(dict.fromkeys(str(ipaddress.ip_address(cast(str, i[4][0]).split("%", 1)[0]))
                              for i in infos))


def check_local(host: str) -> str:
    """The address of ``host`` to listen on, if it is this machine's (or an explicit wildcard);
    :class:`AddressError` otherwise."""
    if host in WILDCARDS:
        return host
    mine = local_addresses()
    candidates = resolve(host)
    for address in candidates:
        if address in mine:
            return address
    shown = host if candidates == [host] else f"{host} ({', '.join(candidates)})"
    raise AddressError(f"'{shown}' is not an address of this machine; it has "
                       f"{', '.join(mine)} (or write 0.0.0.0 to listen on every interface)")


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` (``lo`` for 127.0.0.1), if any."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addrs):
            return name
    return None


def connect_address(host: str) -> str:
    """Where this machine's own processes reach a server listening on ``host``: a wildcard is
    reached over loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host:port`` (``port=0``: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # '::' is not also IPv4's
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def check_hosts(cfg: DictConfig) -> str:
    """The address this launcher and its processes listen on: ``cluster.host`` on one machine,
    this node's ``host`` on a cluster of real nodes (the first node's is the store's). Refused
    with a :class:`ConfigError` before anything starts if it is not this machine's; other nodes'
    addresses are theirs to check."""
    nodes = cfg.cluster.nodes
    if not any(node.get("host") for node in nodes):
        key, host = "cluster.host", cfg.cluster.host
    else:
        for i, node in enumerate(nodes):
            if node.host in WILDCARDS:
                raise ConfigError(f"cluster.nodes[{i}].host", f"is {node.host}, which other nodes "
                                  "cannot reach; give the node's own address")
        i = [str(node.name) for node in nodes].index(cfg.run.node)
        key, host = f"cluster.nodes[{i}].host", nodes[i].host
    try:
        return check_local(host)
    except AddressError as err:
        raise ConfigError(key, str(err)) from None
