"""Sweeps (``sdpipe train -m A=x,y B=u,v``): every combination of the swept values, one run each.

Hydra's own grammar says what is swept (``a,b``, ``range(1,4)``, ``choice(...)``); its parser
expands each override here, and the combinations are their product in the order given, the last
override varying fastest, as Hydra's basic sweeper orders them. Each combination becomes a plain
list of overrides that ``sdpipe train`` composes and validates like any other; the CLI runs them
one after another in one sweep folder (``<sweep>/<k>-<what varies>``) and compares them in one
table. Pure: no config is composed and nothing runs here.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Sequence

from sdpipe_cli.config.schema import ConfigError

__all__ = ["Combination", "expand"]


@dataclass(frozen=True)
class Combination:
    index: int
    overrides: tuple[str, ...]  # the fixed overrides and this combination's swept ones
    varied: tuple[str, ...]  # only the swept ones, ``key=value``

    @property
    def name(self) -> str:
        """A folder name: the index and what varies (``0-sync-allreduce_train.lr-0.001``),
        with nothing an override's grammar reads (``=``, ``,``, quotes, brackets)."""
        label = "_".join(v.replace("=", "-", 1) for v in self.varied) or "run"
        return f"{self.index}-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", label)[:120]


def expand(overrides: Sequence[str]) -> list[Combination]:
    """The sweep's combinations; a ConfigError naming the override Hydra cannot read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes: list[list[str]] = []
    swept: list[int] = []  # the axes written as sweeps
    for text in overrides:
        try:
            (parsed,) = parser.parse_overrides([text])
        except HydraException as err:
            raise ConfigError(text.split("=", 1)[0], str(err).splitlines()[0]) from None
        if parsed.is_sweep_override():
            key = parsed.get_key_element()
            values = list(parsed.sweep_string_iterator())
            if not values:
                raise ConfigError(key, f"'{text}' sweeps over nothing")
            swept.append(len(axes))
            axes.append([f"{key}={v}" for v in values])
        else:
            axes.append([text])
    return [Combination(index, tuple(combo), tuple(combo[i] for i in swept))
            for index, combo in enumerate(itertools.product(*axes))]
