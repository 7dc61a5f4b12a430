"""What is trained: the model's blocks, the data, the optimizer and its schedule, and checkpoints of them."""

__all__ = ['checkpoint', 'data', 'models', 'optim']
