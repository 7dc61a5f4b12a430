"""Processes and their wiring: the launcher and supervisor, the store, the network, error files, metrics."""

__all__ = ['bootstrap', 'errors', 'metrics', 'network', 'store']
