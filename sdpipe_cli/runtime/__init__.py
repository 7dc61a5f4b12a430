"""How a child process starts and talks: bootstrap, the store, the network, error files, metrics."""

__all__ = ['bootstrap', 'errors', 'metrics', 'network', 'processes', 'store', 'trace']
