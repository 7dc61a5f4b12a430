"""After training: one model out of a run's stages and replicas (``sdpipe export``), its
evaluation (``sdpipe eval``) and, for language models, text from it (``sdpipe sample``).

- :mod:`~sdpipe_cli.export.weights`: which weights a run left (a checkpoint, or ``final/``),
  checked against the model, and the one model its replicas make;
- :mod:`~sdpipe_cli.export.formats`: that model written as transformers, torchvision or its own
  state dict, with ``export.json``; and an export read back;
- :mod:`~sdpipe_cli.export.evaluation`: its loss on a validation set in one process;
- :mod:`~sdpipe_cli.export.generation`: greedy or top-k text from a causal language model.
"""
