"""docs/RUNS.md's table of the metrics lines, generated from :mod:`.records`.

Written by hand, the table drifted from the lines (three kinds were missing); so it is generated
between two marker lines of that page, and ``tests/unit/test_records.py`` fails until it is
regenerated::

    python -m sdpipe_cli.analysis.records_reference --write docs/RUNS.md
"""

from __future__ import annotations

import re
import sys

from sdpipe_cli.analysis.records import RECORDS
from sdpipe_cli.config.generated import Section

_ESCAPE = re.compile(r"(?<!\\)\|")  # a | inside a cell


def table() -> str:
    """docs/RUNS.md's table of the lines: one row per kind, its docstring."""
    rows = ["| kind | fields |", "|---|---|"]
    for r in RECORDS:
        text = _ESCAPE.sub(r"\|", " ".join((r.__doc__ or "").split()))
        rows.append(f"| `{r.kind}` | {text} |")
    return "\n".join(rows)


SECTION = Section("records", "sdpipe_cli.analysis.records_reference", table)
BEGIN, END, replaced = SECTION.begin, SECTION.end, SECTION.replaced


def main(argv: list[str]) -> int:
    return SECTION.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
