"""A pipeline's stream of batches: prepared ahead in background processes, resumable, and honest
about the time the stage waited for it.

:class:`Loader` wraps torch's ``DataLoader`` around any map-style data set. The order comes from
:class:`~sdpipe_cli.data.sampling.Order` (a pure function of the position), so the loader's whole
state is one number, the *position*: the samples this pipeline has consumed. A checkpoint stores
it; a resume, or a healed pipeline, starts the stream there again.

Randomness in a sample's transform (crop, flip, BERT's masking) is drawn from torch's global RNG,
which is seeded per sample from the sample's key before the data set is asked for it: the batch is
then the same whichever background process makes it, in whichever stage, on every resume. Users'
transforms that draw from torch's RNG (as torchvision's do) get the same guarantee.

A sample that cannot be read (a truncated JPEG, a file that vanished) does not stop a run at step
10 000: the next sample of the data set takes its place, deterministically, so the first and last
stages still agree, and the batch carries the name of the file and the error, which the worker
logs once and counts. Only :data:`MAX_BAD_IN_A_ROW` consecutive failures, which mean the data set
itself is broken, end the run with a :class:`DataError`.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from sdpipe_cli.data.sampling import Order, seed_of
from sdpipe_cli.runtime.errors import DataError

__all__ = ["Batch", "Loader", "evaluation_batches", "read_sample", "MAX_BAD_IN_A_ROW"]

MAX_BAD_IN_A_ROW = 16  # consecutive unreadable samples that mean the data set itself is broken


@dataclass
class Batch:
    """Inputs and targets of one batch, and the samples replaced because they could not be read
    (``(name, error)`` each). ``broken`` is set instead when the data set failed outright."""

    inputs: Any = None
    targets: Any = None
    bad: list[tuple[str, str]] = field(default_factory=list)
    broken: str | None = None

    def pin_memory(self) -> Batch:
        """Page-locked copies (the ``DataLoader``'s pinning thread calls this on CUDA), so that
        the copy to the device can overlap the compute."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return Batch(pin_memory(self.inputs), pin_memory(self.targets), self.bad, self.broken)


@contextmanager
def rng_kept():
    """torch's CPU generator, Python's and numpy's as they were before the block."""
    numpy = sys.modules.get("numpy")
    saved = (torch.default_generator.get_state(), random.getstate(),
             numpy.random.get_state() if numpy is not None else None)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        if saved[2] is not None:
            numpy.random.set_state(saved[2])


def _name(dataset: Dataset, index: int) -> str:
    describe = getattr(dataset, "describe", None)
    return str(describe(index)) if callable(describe) else f"sample {index}"


class _Keyed(Dataset):
    """``dataset`` asked by ``(index, key)``: seeds the RNG from the key, replaces an unreadable
    sample, and returns ``(inputs, targets, bad, broken)``.

    A data set with a ``target(i)`` method (the label without reading the sample) replaces an
    unreadable sample by the next one *of the same target*, so that a stage that needs only the
    targets (``labels_only``: the last stage of a pipeline) need not decode anything and still
    agrees with the first stage, which decodes. Others take the next sample.
    """

    def __init__(self, dataset: Dataset, labels_only: bool = False):
        self.dataset = dataset
        self.n = len(dataset)
        self.target = getattr(dataset, "target", None)
        self.labels_only = labels_only and callable(self.target)

    def __len__(self) -> int:
        return self.n

    def _candidates(self, index: int) -> Iterator[int]:
        """``index``, then the samples that may replace it, in order."""
        yield index
        label = self.target(index) if callable(self.target) else None
        for step in range(1, self.n):
            at = (index + step) % self.n
            if label is None or self.target(at) == label:  # type: ignore[misc]
                yield at

    def __getitem__(self, item: tuple[int, int]):
        if self.labels_only or torch.utils.data.get_worker_info() is not None:
            return self._read(item)  # a loader process: its RNG is its own
        with rng_kept():  # the training process: leave its RNG (dropout's) as it was
            return self._read(item)

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        """A batch at once (torch's fetcher asks so): the training process's RNG is kept
        once around the batch rather than around each sample, whose saving and restoring
        (three generators' states) cost more than reading a small model's sample."""
        if self.labels_only or torch.utils.data.get_worker_info() is not None:
            return [self._read(item) for item in items]
        with rng_kept():
            return [self._read(item) for item in items]

    def _read(self, item: tuple[int, int]):
        index, key = item
        if self.labels_only:
            return None, self.target(index), [], None  # type: ignore[misc]
        bad: list[tuple[str, str]] = []
        for at in itertools.islice(self._candidates(index), MAX_BAD_IN_A_ROW):
            try:
                x, y = self._seeded(at, key)
                return x, y, bad, None
            except Exception as err:  # noqa: BLE001 - any sample may fail; the run must not
                bad.append((_name(self.dataset, at), " ".join(str(err).split())[:200] or type(err).__name__))
        return None, None, bad, (f"{len(bad)} samples in a row could not be read, the last "
                                 f"{bad[-1][0]}: {bad[-1][1]}")

    def _seeded(self, index: int, key: int):
        torch.default_generator.manual_seed(key)  # CPU only: torch.manual_seed costs ~2 ms a call
        random.seed(key)
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # users' transforms may draw from numpy's global RNG
            numpy.random.seed(key % 2**32)
        sample = self.dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise DataError("data", f"a data set item must be (inputs, target); item {index} is "
                            f"{type(sample).__name__}")
        return sample


def _collate(samples: list) -> Batch:
    bad = [b for s in samples for b in s[2]]
    broken = next((s[3] for s in samples if s[3] is not None), None)
    if broken is not None:
        return Batch(bad=bad, broken=broken)
    try:
        inputs = None if samples[0][0] is None else default_collate([s[0] for s in samples])
        return Batch(inputs, default_collate([s[1] for s in samples]), bad)
    except (RuntimeError, TypeError) as err:  # samples of different shapes or types
        return Batch(bad=bad, broken=f"the samples cannot be batched together: {' '.join(str(err).split())[:200]}")


def _die_with_parent(_worker_id: int) -> None:
    """A background process ends with the training process, however that ends (SIGKILL too):
    a forked loader holds the parent's sockets and device handles open while it lives."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: torch's own watchdog ends it within seconds


def _context() -> str | None:
    """Fork where there is fork: a worker runs in a fork server's child, whose default start
    method would start each background process from scratch (seconds of imports); a fork
    shares the data set already open."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


class _Stream:
    """The batch sampler: ``order``'s batches from ``position`` on (a ``DataLoader`` asks it
    lazily, ``prefetch`` batches ahead per background process)."""

    def __init__(self, order: Order, position: int, batch_size: int):
        self.order, self.position, self.batch_size = order, position, batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return self.order.batches(self.position, self.batch_size)


class Loader:
    """The training batches of one pipeline: ``get(position)`` returns the batch of
    ``batch_size`` samples that starts at ``position``; asked in sequence, batches come from
    ``workers`` background processes that stay ``prefetch`` batches ahead (``workers=0``: made
    in this process, on demand). ``waited_s``: the total time :meth:`get` blocked."""

    def __init__(self, dataset: Dataset, order: Order, batch_size: int, *, workers: int = 0,
                 prefetch: int = 2, pin_memory: bool = False, labels_only: bool = False):
        self.dataset, self.order, self.batch_size = _Keyed(dataset, labels_only), order, int(batch_size)
        self.workers, self.prefetch, self.pin_memory = int(workers), int(prefetch), pin_memory
        self.waited_s = 0.0
        self._it: Iterator[Batch] | None = None
        self._next = -1  # the position the running stream gives next

    def _start(self, position: int) -> None:
        self.close()
        extra = ({"prefetch_factor": self.prefetch, "multiprocessing_context": _context(),
                  "worker_init_fn": _die_with_parent} if self.workers else {})
        if self.workers and extra["multiprocessing_context"] == "fork":
            # garbage left in this process (objects in reference cycles, e.g. a store with its
            # own threads) is collected here, not by the forked children, where a finalizer
            # that joins a thread which was not copied aborts the process
            gc.collect()
        # a generator of its own: DataLoader draws a seed from one, the training RNG must not move
        self._it = iter(DataLoader(self.dataset, batch_sampler=_Stream(self.order, position, self.batch_size),
                                   num_workers=self.workers, collate_fn=_collate,
                                   pin_memory=self.pin_memory, generator=torch.Generator(), **extra))
        self._next = position

    def get(self, position: int) -> Batch:
        start = time.perf_counter()
        if self._it is None or position != self._next:
            self._start(position)
        batch = next(self._it)  # type: ignore[arg-type]
        self._next += self.batch_size
        self.waited_s += time.perf_counter() - start
        if batch.broken is not None:
            raise DataError("data", batch.broken)
        return batch

    def close(self) -> None:
        """Stop the background processes (also done when the loader is collected)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def read_sample(dataset: Dataset, key: int) -> tuple[Any, Any]:
    """The data set's first readable sample, read as the loader reads one (seeded by ``key``,
    this process's RNGs kept, an unreadable one replaced): what the launcher learns shapes from."""
    x, y, _, broken = _Keyed(dataset)[(0, key)]
    if broken is not None:
        raise DataError("data", broken)
    return x, y


def evaluation_batches(dataset: Dataset, count: int, batch_size: int, seed: int,
                       workers: int = 0, labels_only: bool = False) -> Iterator[Batch]:
    """The validation batches: the data set's first ``count x batch_size`` samples in order (again
    from the start if the split is smaller), the same for every pipeline and every evaluation
    (their keys depend on the index only), so that losses compare across pipelines and time."""
    n = len(dataset)
    plan = ([(i % n, seed_of("val", seed, i % n)) for i in range(b * batch_size, (b + 1) * batch_size)]
            for b in range(count))  # one batch's keys at a time: a long evaluation holds no more
    # a generator of its own: DataLoader draws a seed from one, the training RNG must not move
    extra = {"multiprocessing_context": _context(), "worker_init_fn": _die_with_parent} if workers else {}
    for batch in DataLoader(_Keyed(dataset, labels_only), batch_sampler=plan, num_workers=min(workers, count),
                            collate_fn=_collate, generator=torch.Generator(), **extra):
        if batch.broken is not None:
            raise DataError("data", batch.broken)
        yield batch
