"""Errors and exit codes of the agent, in a module light enough for the CLI to import before the rest.

``elastic-run`` imports the HTTP client (httpx, pydantic) and the agent loop only after it started the
warm-start zygote, so that importing torch there starts as early as possible.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_CONFIG = 2


class AgentError(Exception):
    """A problem the user can fix; the CLI prints it as one line."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class MasterError(Exception):
    """Base of the errors talking to the master."""


class MasterUnreachableError(MasterError):
    """No master answered at any of the addresses."""


class MasterTLSError(MasterError):
    """TLS with the master failed in a way retrying cannot fix: its certificate does not verify against
    --tls-ca, or one side speaks https and the other plain http. Final: a configuration error."""


class MasterRejectedError(MasterError):
    """The master answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
