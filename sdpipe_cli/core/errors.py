"""Bad input: the one exception type for a setting, a file or a value the user can fix.

Every kind of bad input (a config key, a cluster description, a data set, a checkpoint) is a
:class:`BadInput` naming where it is wrong and why. The CLI prints it in one line and exits 2,
and a child process that meets one records it as such, so that a checkpoint found damaged by the
worker loading it exits 2 as well as one found damaged before the launch.
"""

from __future__ import annotations


class BadInput(ValueError):
    """``where`` (a config key, a file, a store key) is wrong: ``reason`` says how to fix it."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.key, self.reason = where, reason
