"""Errors of talking to the job master, shared by the agent and ``elastic-master status`` (light: no
imports, so a CLI can catch them before it loads the HTTP client)."""

from __future__ import annotations


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
