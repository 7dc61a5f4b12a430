"""The command line: parse, compose the config once, hand it to the launcher, show progress."""

__all__ = ['commands', 'interrupts', 'launcher']
