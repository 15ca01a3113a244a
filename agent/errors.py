"""Errors and exit codes of the agent, in a module light enough for the CLI to import before the rest.

``elastic-run`` imports the HTTP client (httpx, pydantic) and the agent loop only after it started the
warm-start zygote, so that importing torch there starts as early as possible.
"""

from __future__ import annotations

from elastic import errors
from elastic.exit_codes import ExitCode

# The agent's names for two rows of the one table (elastic.exit_codes).
EXIT_FAILED = ExitCode.FAILED
EXIT_CONFIG = ExitCode.USAGE


class AgentError(errors.UsageError):
    """A problem the user can fix; the CLI prints it as one line."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code
