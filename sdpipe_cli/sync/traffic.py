"""What one worker's sync sends and receives, by link class, and the time it spends doing so.

On a cluster whose machines are joined by a slow link, a sync mode is judged by what it puts on
that link as much as by its loss: bytes per sample, and the share of a worker's time spent
communicating. Every collective a strategy runs goes through :class:`~sdpipe_cli.sync.groups.
GroupCache` (and the parameter server's pushes and pulls through :meth:`Traffic.point`), which
records each one here: the bytes this worker sent and received, the link class the members span
(``same_node``, or ``cross_node`` as soon as one member is on another node: a ring is bound by
its slowest link; ``server`` for a parameter server's pushes and pulls), and the seconds from the
call to its completion (the emulated link's time included). Pipeline messages (activations and
their gradients) are not sync traffic.

The counts model what the collective moves, not what a transport library happens to send: a ring
all-reduce of n bytes over k members moves 2(k-1)/k x n bytes out of each member and as many in;
a broadcast of n bytes, n into each member but the root and n out of each but the last of a chain;
an all-to-all or an all-gather of n bytes in all (int8 changes' two phases), (k-1)/k x n out of
each member and as many in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["Traffic"]

LinkOf = Callable[[Sequence[int]], str]


class Traffic:
    """Counts per link class: bytes sent, bytes received, seconds, collectives. :meth:`take`
    returns what came since the last take (for a per-iteration record); :attr:`totals` all."""

    def __init__(self, link_of: LinkOf | None = None):
        self.link_of = link_of or (lambda ranks: "same_node")
        self.totals: dict[str, list[float]] = {}
        self._since: dict[str, list[float]] = {}
        self._lock = threading.Lock()  # a round merged late counts from its own thread

    def _add(self, link: str, sent: float, received: float, seconds: float) -> None:
        with self._lock:
            for table in (self.totals, self._since):
                row = table.setdefault(link, [0.0, 0.0, 0.0, 0])
                row[0] += sent
                row[1] += received
                row[2] += seconds
                row[3] += 1

    def all_reduce(self, ranks: Sequence[int], nbytes: int, seconds: float) -> None:
        k = len(ranks)
        if k < 2:
            return
        moved = 2 * (k - 1) / k * nbytes
        self._add(self.link_of(ranks), moved, moved, seconds)

    def exchange(self, ranks: Sequence[int], nbytes: int, seconds: float) -> None:
        """An all-to-all or an all-gather of ``nbytes`` in all over ``ranks``: each member keeps
        its own 1/k of them and sends or receives the rest."""
        k = len(ranks)
        if k < 2:
            return
        moved = (k - 1) / k * nbytes
        self._add(self.link_of(ranks), moved, moved, seconds)

    def broadcast(self, ranks: Sequence[int], nbytes: int, root: bool, last: bool,
                  seconds: float) -> None:
        if len(ranks) < 2:
            return
        self._add(self.link_of(ranks), 0 if last else nbytes, 0 if root else nbytes, seconds)

    def point(self, link: str, sent: int, received: int, seconds: float) -> None:
        """Messages between this worker and a process outside the cluster's placement (a
        parameter server: ``link`` is ``server``)."""
        self._add(link, sent, received, seconds)

    @staticmethod
    def _fields(table: dict[str, list[float]]) -> dict:
        if not table:
            return {}
        return {"sent_bytes": int(sum(r[0] for r in table.values())),
                "recv_bytes": int(sum(r[1] for r in table.values())),
                "links": sorted(table)}

    def take(self) -> dict:
        """What was sent and received since the last take: ``sent_bytes``, ``recv_bytes`` and
        the ``links`` crossed (nothing when nothing was)."""
        with self._lock:
            since, self._since = self._since, {}
        return self._fields(since)

    def summary(self) -> dict:
        """The whole run's, per link class: ``{link: {sent_bytes, recv_bytes, seconds, calls}}``."""
        return {link: {"sent_bytes": int(r[0]), "recv_bytes": int(r[1]),
                       "seconds": round(r[2], 4), "calls": int(r[3])}
                for link, r in sorted(self.totals.items())}
