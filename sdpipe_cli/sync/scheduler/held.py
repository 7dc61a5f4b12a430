"""What a scheduler replaying its dead predecessor's journal writes to: nothing that was written.

A scheduler started again replays the journal of the one that died (:mod:`.process`), acting on
every recorded batch of events as that one did, so that it ends in the same state. What the dead
one wrote is in the store and in ``metrics.jsonl`` already: :class:`Held` keeps the replayed
writes to the store back (those of the last batch are written again when it goes live, in case
the dead one died before it wrote them), :class:`Muted` drops the metrics lines.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Held", "Muted"]


class Held:
    """The store, for a scheduler replaying its journal: reads go through, writes are held
    (those of the batch being replayed, for :meth:`~.handling.Scheduler.go_live`)."""

    def __init__(self, real: Any) -> None:
        self.store = real
        self.last_batch: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> None:
        self.last_batch[key] = value

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.last_batch.update(zip(keys, values))

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def get(self, key: str) -> Any:
        return self.store.get(key)


class Muted:
    """``metrics.jsonl`` while replaying: the dead scheduler wrote those lines already."""

    def write(self, record: dict | None) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass
