"""A worker's training: the model, data, optimizer, checkpoints and the training loops."""

__all__ = ['async_loop', 'loop', 'main', 'worker']
