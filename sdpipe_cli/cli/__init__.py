"""The ``sdpipe`` command: parse, compose the config once, launch and supervise, show progress."""

__all__ = ['commands', 'interrupts', 'launcher']
