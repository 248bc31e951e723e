"""Errors a user can fix. The CLI turns them into exit code 2 with the message alone."""


class InputError(ValueError):
    """Bad input (a file, field, line or value): the message names it and what to do."""
