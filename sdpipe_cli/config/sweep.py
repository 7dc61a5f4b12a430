"""Sweeps (``sdpipe train -m A=x,y B=u,v``): every combination of the swept values, one run each.

:func:`expand` (pure) reads the sweep with Hydra's own override parser (``a,b``, ``range(1,4)``,
``choice(...)``) into its combinations, in Hydra's order (the last override varies fastest), so
that the CLI can compose and validate every one before anything runs. :func:`multirun` then hands
the sweep to Hydra's multirun, whose launcher runs one job per combination: the basic launcher,
one after another in this process, or a plug-in the overrides pick (``hydra/launcher=
submitit_slurm``: one SLURM job each). Each job lands in ``<sweep>/<k>-<what varies>``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sdpipe_cli.config.composition import check_lengths
from sdpipe_cli.config.schema import ConfigError

__all__ = ["Combination", "expand", "for_hydra", "multirun"]


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

    check_lengths(overrides)
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


def for_hydra(override: str) -> bool:
    """Whether ``override`` sets Hydra itself (``hydra/launcher=submitit_slurm``,
    ``hydra.launcher.timeout_min=60``) rather than the run."""
    return override.startswith(("hydra/", "hydra.", "+hydra"))


def multirun(task, overrides: Sequence[str], root, combos: Sequence[Combination]) -> bool:
    """Run ``task(cfg)`` for every combination through Hydra's multirun, with its launcher
    (basic unless ``overrides`` pick another), each job in ``root/<k>-<what varies>`` (Hydra's
    ``override_dirname`` of the swept overrides, sorted by key). Returns whether a job was
    interrupted (which ends the sweep)."""
    import sys

    import hydra

    from sdpipe_cli.config.composition import config_dir, register_schema

    register_schema()
    varied = {v.split("=", 1)[0] for c in combos for v in c.varied}
    fixed = sorted({o.split("=", 1)[0].lstrip("+~") for o in overrides if not for_hydra(o)} - varied)
    # the folder Combination.name gives: Hydra's override_dirname is empty when nothing varies
    what = "${hydra.job.override_dirname}" if varied else "run"
    argv = ["sdpipe", "-m", *overrides, f"hydra.sweep.dir={root}",
            "hydra.sweep.subdir=${hydra.job.num}-" + what,
            "hydra.job.config.override_dirname.kv_sep=-",
            "hydra.job.config.override_dirname.item_sep=_",
            f"hydra.job.config.override_dirname.exclude_keys=[{','.join(fixed)}]",
            "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(task)
    saved = sys.argv
    sys.argv = argv
    try:
        main()
    except KeyboardInterrupt:
        return True
    finally:
        sys.argv = saved
    return False
