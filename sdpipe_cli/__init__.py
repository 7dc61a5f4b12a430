"""sdpipe: semi-decentralized pipeline-parallel training for heterogeneous clusters."""

import warnings

__version__ = "0.1.0"

# torch warns at import when numpy is missing; sdpipe never uses numpy, so the line is only noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
