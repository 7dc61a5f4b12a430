"""What one worker reads: its pipeline's training stream, the validation batches, and the data
part of its checkpoint.

Only the first stage (inputs) and the last (targets) of a pipeline open the data; both read the
same batches, since the order and every sample's randomness are functions of the position alone.
A last stage whose data set can give a label without reading the sample (``target(i)``: image
folders, CIFAR, digits) reads labels only, in its own process: it decodes no image.

The position of iteration ``step`` is ``base + (step - base_step) x batch_size``: ``(0, 0)`` for a
new run, the checkpoint's ``(position, step)`` after a resume, so a resume continues at exactly the
next sample.

Each reading process opens the data itself; it checks that it sees what the launcher recorded
(``data.resolved``: split sizes, paths, checksums), since two stages that read different copies
(another node's folder, another Python's standard library) would pair inputs with the wrong
targets without any error.
"""

from __future__ import annotations

import logging
from typing import Any

from sdpipe_cli.data import sources
from sdpipe_cli.data.loader import Batch, Loader, evaluation_batches
from sdpipe_cli.data.sampling import Order

__all__ = ["Feed"]

log = logging.getLogger("sdpipe.data")


class Feed:
    """Pipeline ``pipeline`` of ``pipelines``' data, for a stage that needs the ``inputs`` (the
    first) or only the targets (the last); ``pin_memory`` on CUDA. ``batch_size``: the samples
    of its iterations (fewer than ``train.batch_size`` where ``pipeline.balance`` gave the
    pipeline fewer micro-batches); validation batches are ``train.batch_size`` whatever it is."""

    def __init__(self, cfg: Any, pipeline: int, pipelines: int, *, inputs: bool = True,
                 pin_memory: bool = False, batch_size: int | None = None):
        self.cfg = cfg
        self.batch_size = int(batch_size or cfg.train.batch_size)
        self.splits = sources.open_splits(cfg)
        sources.check_same(self.splits, getattr(cfg.data, "resolved", None), "this process", "at launch")
        self.labels_only = not inputs and callable(getattr(self.splits.train, "target", None))
        self.workers = 0 if self.labels_only else sources.workers(cfg)
        order = Order(len(self.splits.train), pipeline, pipelines, int(cfg.train.seed))
        self.loader = Loader(self.splits.train, order, self.batch_size, workers=self.workers,
                             prefetch=int(cfg.data.prefetch), pin_memory=pin_memory,
                             labels_only=self.labels_only)
        self.fingerprint = sources.fingerprint(cfg)
        self.sizes_only = sources.fingerprint(cfg, content=False)
        self.base, self.base_step = 0, 0
        self.waited_s = 0.0  # the last batch's wait for the loader
        self.seen_bad: dict[str, str] = {}  # unreadable samples: name -> error
        self.bad_reads = 0  # how many times one was met (both stages, every epoch)
        self._new_bad: list[tuple[str, str]] = []

    def position(self, step: int) -> int:
        """Samples this pipeline has consumed before iteration ``step``."""
        return self.base + (step - self.base_step) * self.batch_size

    def batch(self, step: int) -> Batch:
        """Iteration ``step``'s batch; ``waited_s``: how long this call blocked for it."""
        waited = self.loader.waited_s
        batch = self.loader.get(self.position(step))
        self.waited_s = self.loader.waited_s - waited
        self._note(batch)
        return batch

    def validation(self, count: int):
        """The fixed validation batches (see :func:`~sdpipe_cli.data.loader.evaluation_batches`)."""
        for batch in evaluation_batches(self.splits.val, count, int(self.cfg.train.batch_size),
                                        int(self.cfg.train.seed),
                                        self.workers, self.labels_only):
            self._note(batch)
            yield batch

    def _note(self, batch: Batch) -> None:
        for name, error in batch.bad:
            self.bad_reads += 1
            if name not in self.seen_bad:
                self.seen_bad[name] = error
                self._new_bad.append((name, error))
                log.warning("unreadable sample %s (%s): replaced by the next one", name, error)

    def new_bad(self) -> list[tuple[str, str]]:
        """The unreadable samples met for the first time since the last call."""
        new, self._new_bad = self._new_bad, []
        return new

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"position": self.position(step), "step": step, "fingerprint": self.fingerprint,
                "pipelines": self.loader.order.pipelines}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where a checkpoint's stream stopped (a warning if the data changed since)."""
        if state.get("fingerprint") == self.sizes_only:  # an older sdpipe's: sizes agree
            log.info("the checkpoint's data fingerprint holds no digest of the content: the data "
                     "is checked by its sizes only")
        elif state.get("fingerprint") != self.fingerprint:
            log.warning("the data differs from the checkpoint's (fingerprint %s, now %s): the "
                        "resumed run reads a different stream", state.get("fingerprint"), self.fingerprint)
        self.base, self.base_step = int(state["position"]), int(state["step"])

    def close(self) -> None:
        self.loader.close()
