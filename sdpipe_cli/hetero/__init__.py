"""Heterogeneous clusters: emulating slower devices and links, and measuring a cluster."""

__all__ = ['emulation', 'profiler']
