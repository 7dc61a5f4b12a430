"""Keeping the P replicas of each stage in step: strategies, the scheduler process, the parameter server."""

__all__ = ['ps', 'scheduler', 'strategies']
