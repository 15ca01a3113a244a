"""The guard in front of ``/v1``: bearer token and job id first (401/409), then the body size (413),
before routing, so that an unauthenticated client learns nothing about request validation. An address
that keeps sending wrong tokens is answered 429 at once (:class:`master.http.rate_limits.PeerFailureLimiter`);
every refusal closes the connection, so a client without the token holds none open. The token and job
check is :func:`check_access`, which the agent stream's upgrade (master.http.stream) applies too; the token
check alone, with the same per-address count, is :func:`check_token`, which ``/metrics`` and ``/ui/login``
apply (master.http.metrics, master.http.ui). A request that passes marks its connection authenticated
(master.http.conn_guard.mark_authenticated): never evicted first nor counted per address. The token is
fixed bytes or a :class:`TokenCheck`: the master's :class:`elastic.control.token_source.WatchedToken`,
which follows a rotated ``--token-file`` and accepts the previous token for one heartbeat timeout."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol, TypeVar

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    MAX_BODY_BYTES,
    ErrorBody,
)
from master.http.conn_guard import mark_authenticated
from master.http.rate_limits import PeerFailureLimiter

T = TypeVar("T")
_JOB_HEADER = JOB_HEADER.lower().encode()


class TokenCheck(Protocol):
    """What accepts or refuses a bearer token (:class:`elastic.control.token_source.WatchedToken`)."""

    def accepts(self, given: bytes) -> bool: ...


def token_accepted(given: bytes, token: bytes | TokenCheck) -> bool:
    """Whether ``given`` is ``token`` (fixed bytes, compared in constant time) or ``token`` accepts it."""
    if isinstance(token, bytes):
        return secrets.compare_digest(given, token)
    return token.accepts(given)


class Gatekeeper:
    """ASGI middleware in front of ``/v1``: token and job id first (401/409), then the body size (413).

    It runs before routing, so an unauthenticated client learns nothing about request validation, and
    the body is read here (at most ``limit`` bytes, also for chunked requests) before the app parses it.
    """

    def __init__(
        self,
        app,
        token: str | TokenCheck,
        job_id: str,
        limit: int = MAX_BODY_BYTES,
        failures: PeerFailureLimiter | None = None,
    ) -> None:
        self.app, self.job_id, self.limit = app, job_id, limit
        self.token: bytes | TokenCheck = token.encode() if isinstance(token, str) else token
        self.failures = failures or PeerFailureLimiter()

    def _too_large(self) -> str:
        return f"request body exceeds {self.limit} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        peer = (scope.get("client") or ("",))[0]
        refusal = check_access(headers, peer, self.token, self.job_id, self.failures)
        if refusal is not None:
            return await _reply(send, refusal.status, refusal.code, refusal.message, list(refusal.headers))
        mark_authenticated(scope)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await _reply(send, 413, ErrorCode.BODY_TOO_LARGE, self._too_large())
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(message, receive), send)  # client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await _reply(send, 413, ErrorCode.BODY_TOO_LARGE, self._too_large())
        return await self.app(scope, _replay({"type": "http.request", "body": bytes(body)}, receive), send)


@dataclass(frozen=True)
class AccessRefusal:
    """Why a request is refused before anything else is looked at: its status, code, message and the extra
    headers of the reply (which always closes the connection)."""

    status: int
    code: ErrorCode
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


def check_access(
    headers: dict[bytes, bytes],
    peer: str,
    token: bytes | TokenCheck,
    job_id: str,
    failures: PeerFailureLimiter,
) -> AccessRefusal | None:
    """The gate's rule, for a request with ``headers`` (lower-case names) from address ``peer``: None when
    the bearer token is accepted (:func:`token_accepted`) and ``X-Elastic-Job`` is ``job_id``; else the
    refusal: 401 (a wrong or missing token, counted against ``peer``), 429 when ``peer`` sent too many
    wrong tokens lately (never for a valid token), 409 ``wrong_job``. No I/O: the HTTP gate and the agent
    stream's upgrade both answer what it says."""
    refusal = check_token(bearer_token(headers.get(b"authorization", b"")), peer, token, failures)
    if refusal is not None:
        return refusal
    job = headers.get(_JOB_HEADER, b"").decode(errors="replace")
    if job != job_id:
        return AccessRefusal(409, ErrorCode.WRONG_JOB, f"this master serves job {job_id!r}, not {job!r}")
    return None


def check_token(
    given: bytes, peer: str, token: bytes | TokenCheck, failures: PeerFailureLimiter
) -> AccessRefusal | None:
    """None when ``given`` is accepted (:func:`token_accepted`: ``token`` itself, or during a rotation's
    grace the previous token too); else 401 (counted against ``peer``), or 429 when ``peer`` sent too many
    wrong tokens lately (never for a valid token)."""
    if token_accepted(given, token):
        return None
    if failures.blocked(peer):  # a valid token never gets here: only wrong ones are limited
        return AccessRefusal(
            429,
            ErrorCode.UNAUTHORIZED,
            "too many requests with a wrong bearer token from this address; check --token-file",
            ((b"retry-after", str(int(failures.window_s)).encode()),),
        )
    failures.record_failure(peer)
    return AccessRefusal(
        401,
        ErrorCode.UNAUTHORIZED,
        "missing or wrong bearer token; check --token-file",
        ((b"www-authenticate", b'Bearer realm="elastic-master"'),),
    )


def refusal_response(refusal: AccessRefusal) -> bytes:
    """``refusal`` as a whole HTTP/1.1 response, for a caller that writes to the connection itself."""
    body = ErrorBody(error=refusal.code, message=refusal.message).model_dump_json().encode()
    return http_response(refusal.status, body, refusal.headers)


def http_response(status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A JSON response with ``body`` that closes the connection (as every refusal of the gate does)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {status} {phrase}".encode()]
    lines += [b"%s: %s" % pair for pair in _refusal_headers(body) + list(headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _refusal_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    # connection: close, so that a refused client holds no keep-alive connection (descriptor) open.
    return [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme is case-insensitive,
    RFC 7235); empty when the header is missing or uses another scheme."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


def _replay(first: dict, receive):
    """An ASGI ``receive`` that yields ``first`` once, then the server's own messages (the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


async def _reply(
    send, status: int, code: str, message: str, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = ErrorBody(error=code, message=message).model_dump_json().encode()
    headers = _refusal_headers(body) + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
