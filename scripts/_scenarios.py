"""The heterogeneity scenarios of the scripts: which pipelines are slow, how much, and how it is said
in overrides. Defined once here for ``bench_sync.py``, ``bench_convergence.py``, ``bench_policy.py``,
``sim_fingerprint.py`` and the other scripts that slow a pipeline (a sibling module, not a package:
each script puts this folder on ``sys.path``).

Scenarios by slowdown (``cluster.slowdown``, one factor per pipeline, :func:`slowdowns`):

- ``equal``: every pipeline at speed 1;
- ``straggler``: the last pipeline ``slow`` times slower (default :data:`SLOW`):
  ``cluster.slowdown=[1,1,1,3]`` at P = 4;
- ``mixed``: the last two pipelines 2x and 4x slower (:data:`MIXED`): ``[1,1,2,4]`` at P = 4
  (``[2,4]`` at P = 2, ``[4]`` at P = 1);
- ``random``: every pipeline at speed 1, and each worker ``slow`` times slower in a seeded 10 % of
  its iterations (:func:`random_stragglers`, the straggles of ``cluster=hetero_random``).

And the cluster configs that carry their own heterogeneity (``configs/cluster/``):
:data:`HETERO_STATIC` (three pipelines, one on 3x slower devices), :data:`HETERO_RANDOM` (the
``random`` straggles on four pipelines), :data:`HETERO_MIXED` (two device generations on two nodes,
a speed change, slow cross-node links) and :data:`SLOW_LINKS` (four machines over a slow link).
Where compute is modelled from block costs (``partition=auto``, re-planning), :func:`write_profile`
writes the profile of one device whose blocks all cost the same.
A script's own name for a scenario may differ (``bench_policy.py``'s ``mixed`` is
``cluster=hetero_mixed``, its ``1124`` the ``mixed`` slowdown here): each keeps its names and the
overrides it always gave, built here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SLOW = 3.0  # the straggler's slowdown, unless a script is told another
MIXED = (2.0, 4.0)  # mixed: the slowdowns of the last pipelines, the others at speed 1
RANDOM_PROBABILITY = 0.1  # random: each iteration, each worker is slow with this probability
SLOWDOWN_SCENARIOS = ("equal", "straggler", "mixed", "random")

HETERO_STATIC = "cluster=hetero_static"
HETERO_RANDOM = "cluster=hetero_random"
HETERO_MIXED = "cluster=hetero_mixed"
SLOW_LINKS = "cluster=slow_links"


def slowdowns(scenario: str, pipelines: int, slow: float = SLOW) -> list[float]:
    """Each pipeline's slowdown in ``scenario`` (one of :data:`SLOWDOWN_SCENARIOS`)."""
    if scenario not in SLOWDOWN_SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SLOWDOWN_SCENARIOS)}")
    factors = [1.0] * pipelines
    if scenario == "straggler":
        factors[-1] = slow
    elif scenario == "mixed":
        factors[-len(MIXED):] = MIXED[-pipelines:]
    return factors


def factors_text(factors: Iterable[float]) -> str:
    """``1,1,1,3``: slowdowns as an override and a title write them."""
    return ",".join(f"{f:g}" for f in factors)


def slowdown(factors: Iterable[float]) -> str:
    """The override ``cluster.slowdown=[1,1,1,3]``."""
    return f"cluster.slowdown=[{factors_text(factors)}]"


def random_stragglers(slow: float = SLOW) -> list[str]:
    """The ``random`` scenario's straggles: each worker ``slow`` times slower in a seeded
    :data:`RANDOM_PROBABILITY` of its iterations."""
    return [f"cluster.stragglers.probability={RANDOM_PROBABILITY:g}",
            f"cluster.stragglers.factor={slow:g}", "cluster.stragglers.per=iteration"]


def overrides(scenario: str, pipelines: int, slow: float = SLOW) -> list[str]:
    """``scenario``'s overrides on ``pipelines`` pipelines: its ``cluster.slowdown`` (given even
    when every factor is 1), then, for ``random``, its straggles."""
    extra = random_stragglers(slow) if scenario == "random" else []
    return [slowdown(slowdowns(scenario, pipelines, slow)), *extra]


def write_profile(path: Path, model: str, blocks: int, microbatch: int, block_ms: float) -> Path:
    """A profile of one device at speed 1, every other device taking its times over its speed:
    each of ``model``'s ``blocks`` ``block_ms`` forward and twice that backward."""
    path.write_text(json.dumps({
        "format": "sdpipe-profile/1", "created": "2026-12-05T00:00:00", "torch": "-",
        "model": {"name": model, "blocks": blocks, "microbatch_size": microbatch,
                  "block_params": [70_000] * blocks},
        "cluster": {"name": "bench"}, "p2p": [], "allreduce": [],
        "devices": [{"name": "local:0", "node": "local", "speed": 1.0, "rank": 0, "pipeline": 0,
                     "stage": 0, "forward_ms": [block_ms] * blocks,
                     "backward_ms": [2 * block_ms] * blocks, "peak_memory_mb": 1.0,
                     "memory_source": "rss"}]}))
    return path
