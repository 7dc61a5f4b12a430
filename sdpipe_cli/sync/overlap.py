"""A group round's average behind the replica's next local steps (``sync.overlap``).

On a slow link a meeting's all-reduce is most of the time a replica does not compute: at
15 Mbit/s, meeting every 12 steps in bfloat16, 13 % of its time, for a round that takes two
of its steps. The round is decided as before (the decision is quick: the members wait for the
scheduler, not for the wire); then its average runs in a thread, over copies of the weights
the replica sent, while the replica goes on with its next local steps. After ``sync.overlap``
of them (or before its next round, whichever comes first) the replica waits for the average,
if it is not there yet, and merges it late (Streaming DiLoCo's delayed merge, torchft's
``fragment_sync_delay``, with a mixing factor of 1)::

    w <- w + (average - w_sent)

that is the group's average plus what the replica learned since it sent. With no steps in
between it is the round's average exactly. The merge comes after a fixed count of steps, not
whenever the thread ends, so that a run is still reproduced by its decisions
(``sync.replay``). Global syncs (the checkpoints, the run's end) stay in step: every replica
must leave them identical.

Only the collective runs in the thread: the communicator is made before it starts, so the
rendezvous happens in the members' main threads as for a round in step, and the thread writes
nothing but its copies (and the round's rounding residual, which the next round reads only
after merging this one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Behind", "overlap_on"]

log = logging.getLogger("sdpipe.sync")


def overlap_on(overlap: int, backend: str) -> int:
    """``sync.overlap`` as a worker runs it: in step on NCCL, where a collective in a thread
    beside the pipeline's own sends and receives, on other communicators, may deadlock when
    members start them in different orders (NCCL's documented hazard; untested here, so not
    taken)."""
    if overlap and backend == "nccl":
        log.warning("sync.overlap=%d: rounds run in step on NCCL", overlap)
        return 0
    return overlap


class Behind:
    """One round's average running behind: started on copies of ``tensors`` (what the replica
    sends), merged into the live ``tensors`` after local step ``due``. ``average(copies)``
    replaces the copies by the group's average (it may raise when a member is lost).
    ``group``: the round's (ranks, incarnations); ``moved``: the bytes it puts through this
    member's link; ``after``: the worker's previous average still running, which this one
    waits for: a worker's units may average over the same ranks, hence one communicator, and
    two collectives on it at once would meet in whatever order each member started them."""

    def __init__(self, tensors: list[torch.Tensor], average: Callable[[list[torch.Tensor]], Any],
                 due: int, group: tuple[list[int], list[int]], moved: float,
                 after: Behind | None = None):
        with torch.no_grad():
            self.sent = [t.detach().clone() for t in tensors]
            self.copies = [t.clone() for t in self.sent]
        self.due, self.group, self.moved = due, group, moved
        self.error: BaseException | None = None
        self._raised: BaseException | None = None
        self.seconds = 0.0  # the average's own time, from the start of the thread
        self._thread = threading.Thread(target=self._run, args=(average, after), daemon=True,
                                        name="sdpipe-overlap")
        self._thread.start()

    def _run(self, average: Callable[[list[torch.Tensor]], Any], after: Behind | None) -> None:
        if after is not None:
            after._thread.join()
        start = time.perf_counter()
        try:
            average(self.copies)
        except (RuntimeError, dist.DistError) as err:  # a member lost mid-round
            self.error = err
        except BaseException as err:  # anything else is the run's failure: raised at the merge
            self._raised = err
        self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def merge(self, tensors: list[torch.Tensor]) -> float:
        """Wait for the average and add what it changed of the sent weights to ``tensors``
        (nothing if a member was lost: the replica goes on alone, as in step; any other error
        of the average is raised here, in the replica's own thread). Returns the seconds
        waited."""
        start = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - start
        if self._raised is not None:
            raise self._raised
        if self.error is None:
            with torch.no_grad():
                for live, new, old in zip(tensors, self.copies, self.sent):
                    live.add_(new.sub_(old))
        return waited
