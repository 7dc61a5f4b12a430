"""Pipeline executors: run a stage's schedule and move tensors between neighbouring stages.

* :mod:`~sdpipe_cli.pipeline.p2p`: the messages between neighbours (tags, the per-iteration
  ``Control``, the drained word) and the ``Link`` that posts and waits on them without deadlock;
* :mod:`~sdpipe_cli.pipeline.executor`: the ``Executor``, one stage's blocks, hooks and link,
  and the compute of one forward or backward, shared by both loops below;
* :mod:`~sdpipe_cli.pipeline.stage`: ``FlushedStage``, the flushed loop (1F1B, GPipe);
* :mod:`~sdpipe_cli.pipeline.async_stage`: ``AsyncStage``, asynchronous 1F1B segments;
* :mod:`~sdpipe_cli.pipeline.stash`: the weight versions asynchronous 1F1B keeps;
* :mod:`~sdpipe_cli.pipeline.microbatches`: a batch cut into micro-batches;
* :mod:`~sdpipe_cli.pipeline.validation`: the validation pass, for training and ``sdpipe eval``.
"""

__all__ = ['async_stage', 'executor', 'microbatches', 'p2p', 'stage', 'stash', 'validation']
