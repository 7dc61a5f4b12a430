"""The coordination namespace: every key that launcher, scheduler and workers share in the TCPStore.

All coordination between processes goes through one ``torch.distributed.TCPStore`` (hosted by the
launcher) and torch.distributed itself, never through pipes or shared memory, so that the same
code runs when the processes live on different hosts. This module names the keys and moves JSON
records over them; it holds no policy.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from sdpipe_cli.runtime import network

PG_PREFIX = "pg/"  # torch.distributed's own rendezvous keys
PREFIX = "sdpipe/"  # ours
EVENTS = "events"  # queue: worker -> scheduler records (start, step, eval, done)
PROGRESS = "progress"  # scheduler (profiling: rank 0) -> launcher: JSON snapshot for the display
T0 = "t0"  # wall-clock start of the run (seconds since the epoch), set by the launcher
RUN = "run"  # first node -> other nodes' launchers: the resolved config and resume path (JSON)
FAILED = "failed"  # any launcher -> the others: the first failure, in one line
STOP_REQUESTED = "stop_requested"  # set by the launcher on Ctrl-C/SIGTERM: stop at a consistent point
RESTARTS = "restarts"  # counter: pipeline restarts so far, by every node's launcher
HUNG = "hung"  # scheduler -> launcher: ranks silent past run.heartbeat_timeout (JSON list), to kill


def host_store(host: str, port: int, timeout: float) -> tuple[dist.TCPStore, bool]:
    """The master store, listening on exactly ``host:port`` (``port=0``: a free port, read it
    back from ``.port``), and whether that binding held.

    The socket is bound here and handed to the store (:func:`network.listen`), because the store's
    own socket would listen on every interface. A torch without ``master_listen_fd`` gets a store
    that binds as torch does; the second value is then False so that the caller can say so.
    """
    sock = network.listen(host, port)
    bound = sock.getsockname()[1]
    options = dict(is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    fd = sock.detach()  # the store owns the socket from here on, and closes it
    try:
        return dist.TCPStore(host, bound, master_listen_fd=fd, use_libuv=True, **options), True
    except TypeError:  # torch too old to take a listening socket
        os.close(fd)
        return dist.TCPStore(host, bound, **options), False
    except BaseException:
        os.close(fd)
        raise


def connect(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the launcher's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def connect_patiently(host: str, port: int, timeout: float, attempt_s: float = 1.0,
                      check: Callable[[], None] = lambda: None) -> dist.TCPStore:
    """:func:`connect`, retried in short attempts for up to ``timeout`` seconds, calling ``check``
    between attempts (it may raise to give up, e.g. on an interrupt).

    One long attempt blocks inside torch, where an interrupt is not seen until it gives up; short
    ones return to Python in between, so an interrupt is acted on within ``attempt_s``.
    """
    deadline = time.monotonic() + timeout
    while True:
        check()
        left = deadline - time.monotonic()
        try:
            client = connect(host, port, max(0.1, min(attempt_s, left)))
        except Exception:  # noqa: BLE001 - c10d raises several types for "nobody there"
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
            continue
        client.set_timeout(timedelta(seconds=timeout))
        return client


def namespace(store: dist.Store) -> dist.PrefixStore:
    return dist.PrefixStore(PREFIX, store)


def push(store: dist.Store, queue: str, record: dict[str, Any]) -> None:
    store.queue_push(queue, json.dumps(record))


def pop_all(store: dist.Store, queue: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Every record waiting in ``queue`` (up to ``limit``), without blocking."""
    records = []
    for _ in range(min(store.queue_len(queue), limit)):
        records.append(json.loads(store.queue_pop(queue, block=False)))
    return records


def set_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get_json(store: dist.Store, key: str, default: Any = None) -> Any:
    if not store.check([key]):
        return default
    return json.loads(store.get(key))


def run_clock(store: dist.Store) -> float:
    """The run's start time, so that every process stamps metrics on one time axis."""
    return float(store.get(T0)) if store.check([T0]) else time.time()


def profile_key(rank: int) -> str:
    """Where a profiling worker puts its measurements (JSON) for rank 0 to assemble."""
    return f"profile/{rank}"


def decision_key(stage: int, pipeline: int, iteration: int, incarnation: int = 0) -> str:
    """Where the scheduler puts the group of (stage, pipeline, iteration); the worker deletes it.

    The key names the pipeline's incarnation: a decision published for a process that died before
    it read it stays in the store, and a restarted replica that goes on from an earlier iteration
    must not take that stale group (with the dead process's communicators) for its own."""
    return f"group/{stage}/{pipeline}.{incarnation}/{iteration}"


def begin_key(pipeline: int, iteration: int, incarnation: int = 0) -> str:
    """Where the scheduler answers the first stage of ``pipeline`` about to start ``iteration``
    (asynchronous schedules: whether that iteration ends a segment); the worker deletes it. Named
    after the incarnation, as :func:`decision_key` is."""
    return f"begin/{pipeline}.{incarnation}/{iteration}"


def heal_key(stage: int, pipeline: int, incarnation: int) -> str:
    """Where the scheduler answers a restarted replica (its source, or stop); it deletes it."""
    return f"heal/{stage}/{pipeline}/{incarnation}"


def wait_json(store: dist.Store, key: str) -> Any:
    """Block until ``key`` is set (up to the store's timeout), then read, delete and decode it."""
    value = json.loads(store.get(key))
    store.delete_key(key)
    return value
