"""The coordination namespace: every key that launcher, scheduler and workers share in the TCPStore.

All coordination between processes goes through one ``torch.distributed.TCPStore`` (hosted by the
launcher) and torch.distributed itself, never through pipes or shared memory, so that the same
code runs when the processes live on different hosts. This module names the keys and moves JSON
messages over them (their types and their decoding are :mod:`~sdpipe_cli.runtime.protocol`'s);
it holds no policy.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sdpipe_cli.runtime import network, protocol

PG_PREFIX = "pg/"  # torch.distributed's own rendezvous keys
PREFIX = "sdpipe/"  # ours
EVENTS = "events"  # queue: worker -> scheduler records (start, step, eval, done)
PROGRESS = "progress"  # scheduler (profiling: rank 0) -> launcher: JSON snapshot for the display
T0 = "t0"  # wall-clock start of the run (seconds since the epoch), set by the launcher
# seconds of train.time_limit that earlier legs of this sdpipe command used (a re-plan's or a
# restart's leg), set by the launcher when not 0
LIMIT_SPENT = "limit_spent"
RUN = "run"  # first node -> other nodes' launchers: the resolved config and resume path (JSON)
FAILED = "failed"  # any launcher -> the others: the first failure, in one line
STOP_REQUESTED = "stop_requested"  # set by the launcher on Ctrl-C/SIGTERM: stop at a consistent point
RESTARTS = "restarts"  # counter: pipeline restarts so far, by every node's launcher
HUNG = "hung"  # scheduler -> launcher: ranks silent past run.heartbeat_timeout (JSON list), to kill
STARTING = "starting"  # counter: workers built and ready for their first iteration
GO = "go"  # set by the last of them: every worker starts its first iteration now


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


def push(store: dist.Store, queue: str, message: Any) -> None:
    """Append a :mod:`~sdpipe_cli.runtime.protocol` message to ``queue``."""
    store.queue_push(queue, protocol.encode(message))


def put(store: dist.Store, key: str, message: Any) -> None:
    """Set ``key`` to a :mod:`~sdpipe_cli.runtime.protocol` message."""
    store.set(key, protocol.encode(message))


def set_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get_json(store: dist.Store, key: str, default: Any = None) -> Any:
    if not store.check([key]):
        return default
    return json.loads(store.get(key))


def read(store: dist.Store, key: str, cls: type, default: Any = None) -> Any:
    """The message of class ``cls`` under ``key`` (``default`` while it is unset)."""
    if not store.check([key]):
        return default
    return protocol.decode(store.get(key), cls, PREFIX + key)


def read_progress(store: dist.Store, default: Any = None) -> Any:
    """The progress snapshot, checked (:func:`~sdpipe_cli.runtime.protocol.decode_progress`)."""
    if not store.check([PROGRESS]):
        return default
    return protocol.decode_progress(store.get(PROGRESS), PREFIX + PROGRESS)


def run_clock(store: dist.Store) -> float:
    """The run's start time, so that every process stamps metrics on one time axis."""
    return float(store.get(T0)) if store.check([T0]) else time.time()


def limit_spent(store: dist.Store) -> float:
    """How much of ``train.time_limit`` this command's earlier legs used (0 for its first)."""
    return float(store.get(LIMIT_SPENT)) if store.check([LIMIT_SPENT]) else 0.0


def split_key(pipeline: int) -> str:
    """Where the scheduler says how ``pipeline`` is split since it was re-split in place
    (:class:`~sdpipe_cli.runtime.protocol.Split`)."""
    return f"split/{pipeline}"


def wire_key(rank: int) -> str:
    """Where worker ``rank`` reports its measured wire
    (:class:`~sdpipe_cli.runtime.protocol.WireReport`)."""
    return f"wire/{rank}"


MEETINGS = "meetings"  # scheduler -> workers: the meetings settled from the wire (MeetingChoice)


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


def take(store: dist.Store, key: str, cls: type) -> Any:
    """Block until ``key`` is set (up to the store's timeout), then read, delete and decode the
    message of class ``cls`` under it."""
    raw = store.get(key)
    store.delete_key(key)
    return protocol.decode(raw, cls, PREFIX + key)


def start_together(store: dist.Store, workers: int, timeout: float, wait: bool = True,
                   poll_s: float = 0.01) -> bool:
    """Count this worker in before its first iteration and, with ``wait``, return once all
    ``workers`` are in: whether they were within ``timeout`` seconds (False: it goes on alone).

    Workers finish building their model and data up to seconds apart; started as they are ready,
    pipelines at the same speed would run whole iterations apart for the rest of the run (the
    group policy averages across iterations), so that each one evaluates at its own time and the
    others take it for a straggler. A restarted worker counts itself in without waiting (its peers
    are past their start, or wait for its count), so a worker lost before the start does not hold
    the others; one lost after counting in is counted twice, which at worst starts the others
    before a slow one is built. Polled in short sleeps, so an interrupt is acted on.
    """
    if store.add(STARTING, 1) >= workers:
        store.set(GO, "1")
    if not wait:
        return True
    deadline = time.monotonic() + timeout
    while not store.check([GO]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
