"""Markdown result tables of the benchmark scripts, stamped with when, where and how they were made.

Every ``scripts/bench_*.py`` takes ``--markdown PATH`` and writes its result table there through
:func:`write_markdown`, headed by one stamp line::

    measured 2026-11-30 UTC at commit 6b99383, machine: 2 cores, torch 2.13.0+cpu, Python 3.11.7,
    command: `python scripts/bench_sync.py --steps 6 ...`

A figure without its commit and machine cannot be compared with the next one, and a table copied by
hand into docs/BENCHMARKS.md loses both; so the script writes the stamp, and the page quotes the file.
This module is the scripts' one source of provenance: the commit, the machine (:func:`environment`)
and the command line; and of how a figure is written in a table (:func:`num` and the functions after
it: samples/s, losses, ratios, percentages, milliseconds, kB and MB), so that one kind of figure
reads the same in every script's table. Running ``sdpipe`` is ``_runner.py``'s; what the figures
are is ``sdpipe_cli.analysis``'s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short hash of HEAD, with ``-dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def torch_version() -> str:
    try:
        from importlib import metadata
        return metadata.version("torch")
    except Exception:  # not installed, or metadata missing: the stamp still gets written
        return "?"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as it was typed (relative script path kept), for the stamp."""
    return shlex.join(["python", *(sys.argv if argv is None else argv)])


def environment() -> dict:
    """Python, torch and sdpipe versions, CPUs and platform (``results.json``'s ``environment``)."""
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "?"
    return {"python": platform.python_version(), "torch": version("torch"),
            "sdpipe": version("sdpipe"), "cpus": os.cpu_count(), "platform": platform.platform()}


def short_stamp() -> str:
    """``<date>, commit <hash>``: the short form some scripts put beside their command line."""
    return f"{datetime.date.today().isoformat()}, commit {commit()}"


def stamp(command: str | None = None) -> str:
    now = datetime.datetime.now(datetime.UTC)
    return (f"measured {now:%Y-%m-%d} UTC at commit {commit()}, machine: {os.cpu_count()} cores, "
            f"torch {torch_version()}, Python {platform.python_version()}, "
            f"command: `{command or command_line()}`")


def write_markdown(path: Path, body: str, command: str | None = None) -> Path:
    """Write ``body`` (Markdown) to ``path`` under the stamp line; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stamp(command) + "\n\n" + body.strip("\n") + "\n")
    return path


def publish(body: str, markdown: Path | None) -> None:
    """Print a result table, and write it stamped to ``markdown`` (``--markdown``) if given."""
    print(body)
    if markdown:
        write_markdown(markdown, body)


def add_markdown_option(parser: argparse.ArgumentParser, stdout_flag: bool = False) -> None:
    """``--markdown PATH``: also write the result table, stamped, to PATH. With ``stdout_flag``
    a bare ``--markdown`` keeps its older meaning (print the tables as Markdown; value ``-``)."""
    if stdout_flag:
        parser.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                            help="write the result tables as stamped Markdown to PATH; "
                            "without PATH, print them as Markdown instead of rich tables")
    else:
        parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                            help="also write the result table as stamped Markdown to PATH")


def rows_table(rows: Sequence[dict], keys: Sequence[str] | None = None,
               float_format: str = ".4g") -> str:
    """A Markdown table of ``rows`` (dicts), one column per key of ``keys`` (default: the first
    row's); a float cell in ``float_format``, a missing one empty."""
    if not rows:
        return "(no rows)\n"
    keys = list(rows[0]) if keys is None else list(keys)

    def cell(value: object) -> str:
        if isinstance(value, float):
            return format(value, float_format)
        return "" if value is None else str(value).replace("|", "/")

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# -- figures in result tables: one format per kind of figure ---------------------------------------
MISSING = "-"  # a figure a run does not have (it failed, or its mode has none)
MIB = 2 ** 20  # bytes in a MiB (memory); a MB (files) is 10**6


def num(value: float | None, fmt: str) -> str:
    """``value`` in format ``fmt`` (``format(value, fmt)``); ``-`` for None."""
    return MISSING if value is None else format(value, fmt)


def rate(samples_per_s: float | None) -> str:
    """Samples/s, one decimal: ``123.4``."""
    return num(samples_per_s, ".1f")


def loss(value: float | None) -> str:
    """A loss, four decimals: ``2.1234``."""
    return num(value, ".4f")


def ratio(value: float | None, digits: int = 2) -> str:
    """One figure over another, as a multiple: ``1.23x``."""
    return MISSING if value is None else f"{value:.{digits}f}x"


def percent(fraction: float | None, digits: int = 1, *, sign: bool = False,
            space: bool = False) -> str:
    """A fraction as a percentage: ``12.3%`` (``+12.3%`` with ``sign``, ``12.3 %`` with
    ``space``); the same digits as ``format(fraction, ".1%")``."""
    if fraction is None:
        return MISSING
    return format(100 * fraction, f"{'+' if sign else ''}.{digits}f") + (" %" if space else "%")


def ms(value: float | None, digits: int = 2) -> str:
    """Milliseconds, two decimals: ``1.23``."""
    return num(value, f".{digits}f")


def kilobytes(nbytes: float | None, digits: int = 1) -> str:
    """Bytes in kB (1000 bytes), one decimal: ``12.3``."""
    return MISSING if nbytes is None else format(nbytes / 1e3, f".{digits}f")


def mib(nbytes: float, digits: int | None = 2) -> float:
    """Bytes in MiB (memory), rounded to ``digits`` (None: to an int), for a JSON result."""
    return round(nbytes / MIB, digits)


def megabytes(nbytes: float, digits: int | None = 2) -> float:
    """Bytes in MB (10**6: files), rounded to ``digits`` (None: to an int), for a JSON result."""
    return round(nbytes / 1e6, digits)
