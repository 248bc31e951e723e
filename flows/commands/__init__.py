"""The handlers of `moe-pipeline`'s commands, which flows/cli.py declares: each takes the
parsed arguments and returns the exit code."""

EXIT_CONFIG = 2  # bad configuration or input: nothing was run or written
