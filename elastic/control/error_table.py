"""Errors of talking to the job master, shared by the agent and ``elastic-master status`` (light: the
standard library only, so a CLI can catch them before it loads the HTTP client), and the protocol's one
error table: for each (status, code) the master answers, whether an agent retries, rejoins or stops.

:class:`ErrorCode` is the one list of wire error codes (the ``error`` field of an error reply), shared by
master and agent; HTTP statuses are attached to codes only in the master's HTTP layer and in
:data:`ERROR_TABLE`. Renaming a code on the wire must keep old peers working: add the old spelling to
:data:`_ALIASES` (an agent then accepts both) or bump the protocol version.
"""

from __future__ import annotations

from enum import Enum

from elastic import errors


class Disposition(Enum):
    """What an agent does about a master's error reply."""

    RETRY = "retry"  # again, with backoff and jitter, until --master-timeout; then one line, non-zero exit
    REJOIN = "rejoin"  # the master does not know the node: stop the workers and join anew
    FINAL = "final"  # one line, non-zero exit: retrying cannot help


class ErrorCode(str, Enum):
    """The error codes of the master's error replies (``ErrorBody.error``); the value is the wire form."""

    JOB_ERROR = "job_error"  # the job refuses the call (generic)
    UNAUTHORIZED = "unauthorized"  # missing or wrong bearer token (or UI session)
    BAD_NODE_SECRET = "bad_node_secret"  # the node secret is missing or not the node's
    UNKNOWN_NODE = "unknown_node"  # the master does not know the node (never joined, dead or left)
    WRONG_JOB = "wrong_job"  # the job header is missing or names another job
    SETTINGS_MISMATCH = "settings_mismatch"  # the node's settings differ from the job's
    NODE_EXCLUDED = "node_excluded"  # the node check excluded this node
    DUPLICATE_NODE = "duplicate_node"  # another live incarnation holds this node id
    BODY_TOO_LARGE = "body_too_large"  # the request body is over the limit
    INVALID_REQUEST = "invalid_request"  # malformed JSON, or a bad field or query parameter
    NOT_LEADER = "not_leader"  # a standby master (or one that lost its lease)
    BUSY = "busy"  # the master serves its maximum of connections (master.http.conn_guard)
    NOT_FOUND = "not_found"  # no such path on this listener (or no such operation on the agent stream)
    UPGRADE_REQUIRED = "upgrade_required"  # GET /v1/stream without the upgrade headers
    INTERNAL_ERROR = "internal_error"  # the master failed to serve an agent-stream call (a bug; logged)

    # A member equals its wire text (str's __eq__) and must hash like it, so that tables keyed by members
    # answer lookups by the plain text a reply carries (Enum's own hash is that of the member's name).
    def __hash__(self) -> int:
        return str.__hash__(self)

    def __str__(self) -> str:  # the wire text, also in f-strings and messages
        return self.value

    @classmethod
    def parse(cls, code: str) -> ErrorCode | str:
        """The code of a reply: a member for a known code or an old spelling of one, else the text."""
        try:
            return cls(_ALIASES.get(code, code))
        except ValueError:
            return code  # a newer master's code: the status decides (see disposition)


#: Old wire spellings -> the current code (accepted from old peers, never sent).
_ALIASES: dict[str, str] = {"node_unknown": ErrorCode.UNKNOWN_NODE.value}

#: ``(status, code)`` -> disposition. Statuses absent here: 5xx, 408 and 429 are retried, the rest final.
ERROR_TABLE: dict[tuple[int, ErrorCode], Disposition] = {
    (400, ErrorCode.JOB_ERROR): Disposition.FINAL,
    (401, ErrorCode.UNAUTHORIZED): Disposition.FINAL,  # wrong token
    (429, ErrorCode.UNAUTHORIZED): Disposition.FINAL,  # wrong token, repeated: refused at once for a while
    (403, ErrorCode.BAD_NODE_SECRET): Disposition.FINAL,  # another agent holds this node id now
    (404, ErrorCode.UNKNOWN_NODE): Disposition.REJOIN,  # declared dead, or a master restarted without state
    (409, ErrorCode.WRONG_JOB): Disposition.FINAL,
    (409, ErrorCode.SETTINGS_MISMATCH): Disposition.FINAL,
    (409, ErrorCode.NODE_EXCLUDED): Disposition.FINAL,
    (409, ErrorCode.DUPLICATE_NODE): Disposition.RETRY,  # until the older incarnation is declared dead
    (413, ErrorCode.BODY_TOO_LARGE): Disposition.FINAL,
    (422, ErrorCode.INVALID_REQUEST): Disposition.FINAL,
    (503, ErrorCode.NOT_LEADER): Disposition.RETRY,  # a standby: the client tries the next address
    (503, ErrorCode.BUSY): Disposition.RETRY,  # at its connection cap: later, or another master
    (429, ErrorCode.BUSY): Disposition.RETRY,  # agent stream: too many calls pending on the connection
    (404, ErrorCode.NOT_FOUND): Disposition.FINAL,  # agent stream: an operation this master does not know
    (426, ErrorCode.UPGRADE_REQUIRED): Disposition.FINAL,
    (500, ErrorCode.INTERNAL_ERROR): Disposition.RETRY,  # agent stream: the call failed in the master
}


def disposition(status: int, code: str) -> Disposition:
    """The agent's reaction to an error reply ``status`` with error ``code`` (see :data:`ERROR_TABLE`)."""
    parsed = ErrorCode.parse(code)
    known = ERROR_TABLE.get((status, parsed)) if isinstance(parsed, ErrorCode) else None
    if known is not None:
        return known
    return Disposition.RETRY if status >= 500 or status in (408, 429) else Disposition.FINAL


MasterError = errors.MasterError


class MasterUnreachableError(MasterError):
    """No master answered at any of the addresses."""


class MasterTLSError(MasterError):
    """TLS with the master failed in a way retrying cannot fix: its certificate does not verify against
    --tls-ca, or one side speaks https and the other plain http. Final: a configuration error."""


class NotAMasterError(MasterError):
    """An address answers HTTP, but not as an elastic-master does (no JSON answer): a mistyped --master, or
    another service on that port. Final: a usage error (exit 2), never retried, never hosted over."""

    def __init__(self, address: str, status: int, content_type: str) -> None:
        self.address, self.status = address, status
        self.content_type = content_type.split(";")[0].strip() or "no content type"
        super().__init__(f"{address} is not an elastic-master (HTTP {status}, {self.content_type})")


class MasterRejectedError(MasterError):
    """The master answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    @property
    def disposition(self) -> Disposition:
        return disposition(self.status, self.code)
