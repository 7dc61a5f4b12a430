"""The ``sdpipe`` command: parse, compose the config once, launch and supervise, show progress."""

__all__ = ["commands", "display", "interrupts", "launcher", "parsing", "preparing", "report",
           "resuming", "run_loop", "sweeping"]
