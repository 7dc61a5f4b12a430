"""A run's ``metrics.jsonl`` read back, and every figure derived from it, each defined once.

Pure reading and arithmetic (no torch): ``sdpipe report``, the sweep table and the benchmark
scripts under ``scripts/`` read runs here, so that a figure means the same wherever it is shown.
:mod:`.records` holds the one schema of the lines: a typed record class per kind, whose
docstring says what each field means (docs/RUNS.md's table is generated from them), from which
:data:`SCHEMA` comes and with which the scheduler (and :mod:`sdpipe_cli.runtime.metrics`) make
lines; ``reading.py`` has the reader and the clocks; the figures are in ``figures.py``. Times
are seconds on the run's clock (from its launch) unless a function says otherwise.

The figures:

- :func:`samples_per_s`: a run's throughput, all pipelines together. The window runs from the
  earliest ``train`` line of any pipeline to the latest one, and counts each pipeline's samples
  after its own first ``train`` line (``samples`` is cumulative per pipeline): every pipeline's
  first iteration, which pays start-up and connection set-up, is left out. It slightly
  undercounts (the other pipelines' first iterations end inside the window), alike for every
  sync mode. Not the ``samples_per_s`` field of a train line (one pipeline's running rate,
  ``core/cadence.py``'s ``Throughput``) nor ``summary.json``'s (the sum of those).
- :func:`solo_rates`: each pipeline's own samples/s, over its own first-to-last train line span
  (optionally between two iterations); summed over a ``sync=none`` run: :func:`limit`, the
  heterogeneity limit, and :func:`fraction_of_limit`.
- :func:`final_val_loss`, :func:`final_val_accuracy` (classifiers), :func:`val_loss_curve`,
  :func:`time_to_loss` (from the run's first train line), :func:`mean_loss` and
  :func:`lowest_loss` (training loss, all pipelines), :func:`mean_group_size`,
  :func:`sync_times` (waits for a group), :func:`consensus`, :func:`overrun_fraction`,
  :func:`iterations`; :func:`analyse` gathers a benchmark run's, :func:`outcome` a run's headline
  figures (a table of runs).
"""

from sdpipe_cli.analysis.figures import (
    SAME_LOSS,
    analyse,
    consensus,
    final_val_accuracy,
    final_val_loss,
    fraction_of_limit,
    iterations,
    last_by_pipeline,
    limit,
    lowest_loss,
    mean_group_size,
    mean_loss,
    outcome,
    overrun_fraction,
    samples_per_s,
    solo_rates,
    steady_rates,
    sync_times,
    sync_traffic,
    time_to_loss,
    val_loss_curve,
    validation,
)
from sdpipe_cli.analysis.reading import (
    Line,
    by_time,
    conforms,
    first_iteration_began,
    first_train_time,
    from_first_iteration,
    of_kind,
    pipelines,
    read_metrics,
    timelines,
)
from sdpipe_cli.analysis.records import BY_KIND, CHECKED, CHOICES, RECORDS, REQUIRED, SCHEMA, Record

__all__ = [
    "BY_KIND", "CHECKED", "CHOICES", "RECORDS", "REQUIRED", "SAME_LOSS", "SCHEMA", "Line", "Record", "analyse",
    "by_time", "conforms", "consensus",
    "final_val_accuracy", "final_val_loss", "first_iteration_began", "first_train_time",
    "fraction_of_limit", "from_first_iteration", "iterations", "last_by_pipeline", "limit",
    "lowest_loss", "mean_group_size", "mean_loss", "of_kind", "outcome", "overrun_fraction", "pipelines",
    "read_metrics", "samples_per_s", "solo_rates", "steady_rates", "sync_times", "sync_traffic",
    "time_to_loss",
    "timelines", "val_loss_curve", "validation",
]
