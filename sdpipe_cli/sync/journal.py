"""The scheduler's journal: every batch of events it acted on, with the moment it acted.

The scheduler is the one process with the run's global view, and a light one: its state is a
fold of the events it was sent (ready signals, reports, saves, losses), its clock, and whether a
stop was asked for. So it writes each batch here *before* acting on it, and a scheduler started
again after the first one died replays the journal (its clock set to each batch's moment, its
answers held back, since the workers have them) and has the same state as the dead one: the same
rounds, budget, incarnations and checkpoints, no decision given twice or differently.

Each event is written as it is popped from the store's queue, one JSON line ``{"e": raw}``,
and each batch, when the scheduler acts on it, as ``{"t": clock, "stop": bool, "n": count}``
closing the ``count`` event lines before it (a batch journaled whole, ``"events": [raw, ...]``
in its own line, reads the same); a header line ``{"started": clock}`` comes first. Lines go to
the OS at once (a process killed keeps them; a node lost takes the run with it anyway). A line
cut short by the kill is the last and is skipped. Event lines after the last batch line were
popped and never acted on: the scheduler started again acts on them first (``unacted``).

Popped events were once journaled with their batch, after the whole batch was popped and the
stop flag read: a scheduler killed in between lost them, and a replica whose ready signal was
among them waited for its round until the store's timeout (two minutes), failing its pipeline
(seen in a chaos test: a killed worker's pipeline and the scheduler killed a second later).
Now only an event popped and not yet written (a few microseconds of Python) can be lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sdpipe_cli.runtime.errors import WriteFailed

__all__ = ["Batch", "Journal", "journal_path", "read"]


def journal_path(run_dir: os.PathLike | str, config: str = "config.yaml") -> Path:
    """The journal of the run's leg whose config file is ``config``: ``config.yaml`` ->
    ``logs/scheduler.journal``, ``config.resume-step_10.yaml`` ->
    ``logs/scheduler.resume-step_10.journal``; a later leg never overwrites an earlier one's."""
    leg = Path(config).name.removeprefix("config").removesuffix(".yaml")
    return Path(run_dir) / "logs" / f"scheduler{leg}.journal"


@dataclass(frozen=True)
class Batch:
    t: float  # the scheduler's clock when it acted on the batch
    stop: bool  # whether a stop had been asked for (the store's flag, read with the batch)
    events: tuple[str, ...]  # the messages as popped from the queue, in that order


class Journal:
    """Appends events and batches to the journal at ``path``."""

    def __init__(self, file: IO[str], unacted: tuple[str, ...] = ()):
        self._file = file
        self.path = Path(file.name)  # <run>/logs/<name>.journal
        # events journaled (popped) and not yet closed by a batch line: at first, those a dead
        # scheduler popped and never acted on, which its successor acts on first
        self.unacted = unacted
        self._popped = len(unacted)

    @classmethod
    def create(cls, path: Path, started: float) -> Journal:
        """A new journal (a new leg of the run: whatever was there is replaced)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        journal = cls(path.open("w", encoding="utf-8"))
        journal._line({"started": started})
        return journal

    @classmethod
    def resume(cls, path: Path) -> Journal:
        """The journal a restarted scheduler goes on writing (after a torn last line, if any),
        with the events the dead one popped and never acted on (:attr:`unacted`)."""
        text = path.read_bytes()
        keep = text[: text.rfind(b"\n") + 1]
        if len(keep) != len(text):
            with path.open("r+b") as f:
                f.truncate(len(keep))
        return cls(path.open("a", encoding="utf-8"), read(path)[2])

    def popped(self, event: str) -> None:
        """One event as popped from the queue, before anything else is done with it."""
        self._line({"e": event})
        self._popped += 1

    def record(self, t: float, stop: bool, events: list[str]) -> None:
        """The batch ``events`` is acted on at ``t``: it closes the events journaled as popped
        (they must be these), or is written whole where none were."""
        if self._popped:
            if self._popped != len(events):
                raise ValueError(f"{self.path}: a batch of {len(events)} events closes "
                                 f"{self._popped} journaled")
            self._line({"t": t, "stop": stop, "n": len(events)})
        else:
            self._line({"t": t, "stop": stop, "events": events})
        self._popped, self.unacted = 0, ()

    def _line(self, value: dict) -> None:
        try:
            self._file.write(json.dumps(value, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: the run stops, naming the file
            raise WriteFailed(self.path, err, self.path.parent.parent) from err

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # the line a failed write left in the buffer (that failure was raised)
            pass


def read(path: Path) -> tuple[float, list[Batch], tuple[str, ...]]:
    """The moment the journal's scheduler started, its batches in order, and the events popped
    after its last batch (never acted on). A torn last line is left out; anything else that is
    not a journal is :class:`ValueError`."""
    # the part after the last newline is empty, or was cut short by a kill: never acted on
    complete = path.read_text(encoding="utf-8").split("\n")[:-1]
    if not complete:
        raise ValueError(f"{path}: empty, not a scheduler journal")
    try:
        started = float(json.loads(complete[0])["started"])
        batches: list[Batch] = []
        popped: list[str] = []
        for line in complete[1:]:
            value = json.loads(line)
            if "e" in value:
                popped.append(str(value["e"]))
                continue
            if "n" in value:
                count = int(value["n"])
                if count != len(popped):
                    raise ValueError(f"a batch of {count} events after {len(popped)}")
                events, popped = tuple(popped), []
            else:
                events = tuple(str(e) for e in value["events"])
            batches.append(Batch(float(value["t"]), bool(value["stop"]), events))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a scheduler journal ({err})") from None
    return started, batches, tuple(popped)
