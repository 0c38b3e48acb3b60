"""What every ``lightning-swarm`` command shares: its errors and exit codes."""

from __future__ import annotations

EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 1, 2, 3


class CLIError(Exception):
    """An error the user can act on: printed as one line on stderr, no traceback."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code
