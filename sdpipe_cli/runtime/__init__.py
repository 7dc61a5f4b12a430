"""Processes and their wiring: the launcher and supervisor, the store, the network, error files, metrics."""

__all__ = ['errors', 'launcher', 'metrics', 'network', 'store']
