"""What a job scheduler's environment says about a multi-node run: SLURM's ``srun`` and torchrun.

On a cluster of real nodes one launcher runs per node, and each must know its node (``run.node``),
and all must agree on the store's port (``run.port``). Typed by hand on every node, that is error-
prone; under ``srun -N2 --ntasks-per-node=1 sdpipe train ...`` or ``torchrun --nnodes=2
--nproc-per-node=1 -m sdpipe_cli train ...`` the environment already says it:

- **SLURM**: this node is the cluster node named ``SLURMD_NODENAME`` (a cluster file may name its
  nodes by the hostnames SLURM gives) or else the ``SLURM_NODEID``-th one; the port is derived
  from ``SLURM_JOB_ID`` (:func:`port_for_job`), the same on every node of the job and different
  for jobs that share a node. Nodes named by hostname need no ``host``: when the job's node list
  (``SLURM_JOB_NODELIST``, bracket syntax expanded by :func:`expand_nodelist`) holds every node
  name, each name is its node's address. (Nodes without hosts whose names are not the job's are
  nodes emulated on this machine, and stay so.)
- **torchrun**: this node is the ``GROUP_RANK``-th; the store listens on ``MASTER_PORT + 1``
  (torchrun's own agent store holds ``MASTER_PORT`` on the first node). Its nodes need their
  ``host``: torchrun does not list the job's machines.

Only what the user left unset is filled in, and only for clusters of several nodes. This module
is pure: it reads a mapping, not ``os.environ``, and returns overrides for the caller to apply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sdpipe_cli.config.schema import ConfigError

__all__ = ["JobEnvironment", "detect", "expand_nodelist", "port_for_job", "infer"]

PORT_BASE, PORT_SPAN = 20000, 20000  # SLURM job ports: 20000-39999, clear of ephemeral ports


@dataclass(frozen=True)
class JobEnvironment:
    """Where the job scheduler placed this launcher."""

    source: str  # "SLURM" or "torchrun"
    node_index: int  # this node's index among the job's nodes
    node_name: str | None  # this node's hostname, if the scheduler says it
    hostnames: tuple[str, ...]  # the job's nodes in order, if the scheduler lists them
    port: int  # the store port every node derives alike

    def describe(self) -> str:
        return f"{self.source} node {self.node_index}" + (
            f" ({self.node_name})" if self.node_name else "")


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(key, f"is '{env[key]}' in the environment, not an integer") from None


def port_for_job(job_id: int) -> int:
    """The store port of SLURM job ``job_id``: every node of a job derives the same one."""
    return PORT_BASE + job_id % PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, e.g. ``gpu[01-03,07],login1`` -> gpu01, gpu02, gpu03, gpu07,
    login1 (zero padding kept; several bracket groups in one name expand as a product)."""
    names: list[str] = []
    for item in _split_top(nodelist):
        names.extend(_expand_one(item))
    return names


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError("SLURM_JOB_NODELIST", f"'{text}' has an unmatched ']'")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError("SLURM_JOB_NODELIST", f"'{text}' has an unmatched '['")
    items.append(text[start:])
    return [item for item in (s.strip() for s in items) if item]


def _expand_one(item: str) -> list[str]:
    open_ = item.find("[")
    if open_ < 0:
        return [item]
    close = item.index("]", open_)
    head, body, tail = item[:open_], item[open_ + 1:close], item[close + 1:]
    expanded: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ConfigError("SLURM_JOB_NODELIST", f"cannot read the range '{part}' in '{item}'")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError("SLURM_JOB_NODELIST", f"the range '{part}' in '{item}' runs backwards")
        width = len(lo)
        expanded.extend(f"{head}{n:0{width}d}" for n in range(int(lo), int(hi) + 1))
    return [name + rest for name in expanded for rest in _expand_one(tail)]


def detect(env: Mapping[str, str]) -> JobEnvironment | None:
    """The job scheduler's placement of this process, or None outside one. torchrun wins over
    SLURM (``srun torchrun ...`` runs torchrun's agent under SLURM)."""
    if "GROUP_RANK" in env and "MASTER_PORT" in env:
        return JobEnvironment("torchrun", _int(env, "GROUP_RANK"), None, (),
                              _int(env, "MASTER_PORT") + 1)
    if "SLURM_JOB_ID" in env and "SLURM_NODEID" in env:
        hosts = tuple(expand_nodelist(env.get("SLURM_JOB_NODELIST", "")))
        return JobEnvironment("SLURM", _int(env, "SLURM_NODEID"), env.get("SLURMD_NODENAME"), hosts,
                              port_for_job(_int(env, "SLURM_JOB_ID")))
    return None


def infer(nodes: Sequence[Mapping[str, Any]], node: str | None, port: int,
          job: JobEnvironment | None) -> dict[str, Any]:
    """Overrides (dotted key -> value) that place this launcher from ``job``, for a cluster of
    ``nodes`` (``cluster.nodes``: each a ``name`` and an optional ``host``) where the user set
    ``run.node = node`` and ``run.port = port``. Nothing for one node or outside a job."""
    if job is None or len(nodes) < 2:
        return {}
    names = [str(n["name"]) for n in nodes]
    hosts = [n.get("host") for n in nodes]
    out: dict[str, Any] = {}
    if not any(hosts):
        # Real nodes only if the job lists every name as one of its hosts; else they are nodes
        # emulated on this machine (a cluster file tried inside an allocation), left alone.
        if not job.hostnames or any(name not in job.hostnames for name in names):
            return {}
        out.update({f"cluster.nodes[{i}].host": name for i, name in enumerate(names)})
    elif not all(hosts):
        return {}  # a mix: validation names the node without an address
    if node is None:
        if job.node_name in names:
            out["run.node"] = job.node_name
        elif 0 <= job.node_index < len(names):
            out["run.node"] = names[job.node_index]
        else:
            raise ConfigError("run.node", f"this is {job.describe()} of the job, but cluster.nodes "
                              f"has {len(names)} nodes ({', '.join(names)})")
    if not port:
        out["run.port"] = job.port
    return out
