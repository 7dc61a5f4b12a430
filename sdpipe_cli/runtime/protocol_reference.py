"""The messages between the processes, as a markdown table generated from the protocol module.

docs/ARCHITECTURE.md lists every message launcher, scheduler and workers exchange: who sends it,
who reads it, its store key and its fields. Written by hand, such a table drifts from the code the
first time a field is added; so it is generated from :mod:`sdpipe_cli.runtime.protocol` (the
dataclasses, their docstrings and :data:`~sdpipe_cli.runtime.protocol.ROUTES`) and the key
functions of :mod:`sdpipe_cli.runtime.store`, between two marker lines of that page, and
``tests/unit/test_protocol_reference.py`` fails until it is regenerated::

    python -m sdpipe_cli.runtime.protocol_reference --write docs/ARCHITECTURE.md
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing

from sdpipe_cli.config.generated import Section
from sdpipe_cli.runtime import protocol, store


def _key(cls: type) -> str:
    if cls in protocol.EVENTS.values() or cls is protocol.Report:
        return f"`{store.PREFIX}{store.EVENTS}` (queue)"
    # placeholders where the key functions take ints: the table shows a key's shape
    s, p, k, i, rank = typing.cast(list[typing.Any], ["<s>", "<p>", "<k>", "<i>", "<rank>"])
    keys = {protocol.Group: store.decision_key(s, p, k, i),
            protocol.BeginAnswer: store.begin_key(p, k, i),
            protocol.HealAnswer: store.heal_key(s, p, i),
            protocol.Hung: store.HUNG, protocol.Split: store.split_key(p),
            protocol.WireReport: store.wire_key(rank), protocol.MeetingChoice: store.MEETINGS}
    return f"`{store.PREFIX}{keys[cls]}`"


def _type(hint: typing.Any) -> str:
    text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    text = text or str(hint).replace("typing.", "").replace(f"{protocol.__name__}.", "")
    return text.replace("NoneType", "None")


def _fields(cls: type) -> str:
    if cls is protocol.Report:
        kinds = ", ".join(protocol.REPORT_FIELDS)
        return f"rank, pipeline, stage, time, incarnation, and per `type` ({kinds}) its own fields"
    hints = typing.get_type_hints(cls)
    shown = []
    for f in dataclasses.fields(cls):
        optional = (f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING)
        shown.append(f"{f.name}: {_type(hints[f.name])}{'' if not optional else ' (optional)'}")
    return ", ".join(shown) or "none"


def _what(cls: type) -> str:
    first = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    first = re.sub(r":(class|data|func):`~?([^`]+)`", r"`\2`", first).replace("``", "`")
    return first.replace("|", "\\|")


def table() -> str:
    """The markdown table, one row per message."""
    rows = ["| message | from -> to | store key | fields | what it says |",
            "|---|---|---|---|---|"]
    for cls, (sender, receiver) in protocol.ROUTES.items():
        event: typing.Any = cls  # an event class has its ``type``, which ``type`` does not know
        name = f"`{event.type}`" if cls in protocol.EVENTS.values() else f"`{cls.__name__}`"
        rows.append(f"| {name} | {sender} -> {receiver} | {_key(cls)} | {_fields(cls)} | "
                    f"{_what(cls)} |")
    progress = ", ".join(protocol.PROGRESS_FIELDS)
    rows.append(f"| progress | scheduler -> launcher | `{store.PREFIX}{store.PROGRESS}` | "
                f"an open record; checked where present: {progress} | the snapshot the progress "
                "bar and the summary show |")
    return "\n".join(rows)


SECTION = Section("messages", "sdpipe_cli.runtime.protocol_reference", table)
BEGIN, END, replaced = SECTION.begin, SECTION.end, SECTION.replaced


def main(argv: list[str]) -> int:
    return SECTION.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
