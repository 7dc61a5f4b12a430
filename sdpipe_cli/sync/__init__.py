"""Keeping the P replicas of each stage in step: strategies, the scheduler process, the parameter server."""

__all__ = ['groups', 'ps', 'scheduler', 'strategies']
