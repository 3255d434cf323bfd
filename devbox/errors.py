"""The errors a user sees: one line, and an exit status that says whose fault it was."""

from __future__ import annotations

# Exit statuses, as in DESIGN.md: 2 for input the user can fix, 1 for failures.
EXIT_USAGE = 2
EXIT_FAILURE = 1


class DevboxError(Exception):
    """An error with a one-line message for the user; the CLI prints it without a traceback."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(DevboxError):
    """Bad input: an invalid name, an unknown box, a malformed config value."""

    exit_code = EXIT_USAGE


class StateError(DevboxError):
    """A state file devbox wrote can no longer be read; nothing was changed."""


class ResourceError(DevboxError):
    """What was asked for is not available now (GPUs, a port)."""
