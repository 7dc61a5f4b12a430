"""sdpipe: semi-decentralized pipeline-parallel training for heterogeneous clusters."""

__version__ = "0.1.0"
