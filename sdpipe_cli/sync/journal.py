"""The scheduler's journal: every batch of events it acted on, with the moment it acted.

The scheduler is the one process with the run's global view, and a light one: its state is a
fold of the events it was sent (ready signals, reports, saves, losses), its clock, and whether a
stop was asked for. So it writes each batch here *before* acting on it, and a scheduler started
again after the first one died replays the journal (its clock set to each batch's moment, its
answers held back, since the workers have them) and has the same state as the dead one: the same
rounds, budget, incarnations and checkpoints, no decision given twice or differently.

One JSON line per batch: ``{"t": clock, "stop": bool, "events": [raw message, ...]}``, after a
header line ``{"started": clock}``. Lines go to the OS at once (a process killed keeps them; a
node lost takes the run with it anyway). A line cut short by the kill is the last and is skipped;
its events were never acted on. Events popped from the store's queue and not yet written are
lost with the process: a replica whose ready signal was among them waits until named hung, and
its pipeline is then lost and restarted as any other.
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
    """Appends batches to the journal at ``path``."""

    def __init__(self, file: IO[str]):
        self._file = file
        self.path = Path(file.name)  # <run>/logs/<name>.journal

    @classmethod
    def create(cls, path: Path, started: float) -> Journal:
        """A new journal (a new leg of the run: whatever was there is replaced)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        journal = cls(path.open("w", encoding="utf-8"))
        journal._line({"started": started})
        return journal

    @classmethod
    def resume(cls, path: Path) -> Journal:
        """The journal a restarted scheduler goes on writing (after a torn last line, if any)."""
        text = path.read_bytes()
        keep = text[: text.rfind(b"\n") + 1]
        if len(keep) != len(text):
            with path.open("r+b") as f:
                f.truncate(len(keep))
        return cls(path.open("a", encoding="utf-8"))

    def record(self, t: float, stop: bool, events: list[str]) -> None:
        self._line({"t": t, "stop": stop, "events": events})

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


def read(path: Path) -> tuple[float, list[Batch]]:
    """The moment the journal's scheduler started, and its batches in order. A torn last line
    is left out; anything else that is not a journal is :class:`ValueError`."""
    # the part after the last newline is empty, or was cut short by a kill: never acted on
    complete = path.read_text(encoding="utf-8").split("\n")[:-1]
    if not complete:
        raise ValueError(f"{path}: empty, not a scheduler journal")
    try:
        started = float(json.loads(complete[0])["started"])
        batches = []
        for line in complete[1:]:
            value = json.loads(line)
            batches.append(Batch(float(value["t"]), bool(value["stop"]),
                                 tuple(str(e) for e in value["events"])))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a scheduler journal ({err})") from None
    return started, batches
