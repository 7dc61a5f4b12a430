"""One worker: the Worker, its flushed and asynchronous training loops, and the worker process."""

__all__ = ['async_loop', 'loop', 'main', 'worker']
