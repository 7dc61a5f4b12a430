"""Pure decisions, no I/O: schedules, partitions, group scheduling, cadence, supervision, the cluster model."""

__all__ = ['cadence', 'cluster', 'grouping', 'partition', 'placement', 'schedule', 'supervision']
