"""Pipeline executors: run a stage's schedule and move tensors between neighbouring stages."""

__all__ = ['async_stage', 'stage', 'stash']
