"""Errors of talking to the job master, shared by the agent and ``elastic-master status`` (light: the
standard library only, so a CLI can catch them before it loads the HTTP client), and the protocol's one
error table: for each (status, code) the master answers, whether an agent retries, rejoins or stops."""

from __future__ import annotations

from enum import Enum


class Disposition(Enum):
    """What an agent does about a master's error reply."""

    RETRY = "retry"  # again, with backoff and jitter, until --master-timeout; then one line, non-zero exit
    REJOIN = "rejoin"  # the master does not know the node: stop the workers and join anew
    FINAL = "final"  # one line, non-zero exit: retrying cannot help


#: ``(status, code)`` -> disposition. Statuses absent here: 5xx, 408 and 429 are retried, the rest final.
ERROR_TABLE: dict[tuple[int, str], Disposition] = {
    (400, "job_error"): Disposition.FINAL,
    (401, "unauthorized"): Disposition.FINAL,  # wrong token
    (403, "bad_node_secret"): Disposition.FINAL,  # another agent holds this node id now
    (404, "unknown_node"): Disposition.REJOIN,  # declared dead, or a master restarted without its state
    (409, "wrong_job"): Disposition.FINAL,
    (409, "settings_mismatch"): Disposition.FINAL,
    (409, "node_excluded"): Disposition.FINAL,
    (409, "duplicate_node"): Disposition.RETRY,  # until the older incarnation is declared dead
    (413, "body_too_large"): Disposition.FINAL,
    (422, "invalid_request"): Disposition.FINAL,
    (503, "not_leader"): Disposition.RETRY,  # a standby: the client tries the next address
}


def disposition(status: int, code: str) -> Disposition:
    """The agent's reaction to an error reply ``status`` with error ``code`` (see :data:`ERROR_TABLE`)."""
    known = ERROR_TABLE.get((status, code))
    if known is not None:
        return known
    return Disposition.RETRY if status >= 500 or status in (408, 429) else Disposition.FINAL


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

    @property
    def disposition(self) -> Disposition:
        return disposition(self.status, self.code)
