"""The guard in front of ``/v1``: bearer token and job id first (401/409), then the body size (413),
before routing, so that an unauthenticated client learns nothing about request validation. An address
that keeps sending wrong tokens is answered 429 at once (:class:`master.rate_limits.PeerFailureLimiter`);
every refusal closes the connection, so a client without the token holds none open."""

from __future__ import annotations

import secrets
from typing import TypeVar

from elastic.master_errors import ErrorCode
from elastic.protocol import (
    API_PREFIX,
    JOB_HEADER,
    MAX_BODY_BYTES,
    ErrorBody,
)
from master.rate_limits import PeerFailureLimiter

T = TypeVar("T")


class Gatekeeper:
    """ASGI middleware in front of ``/v1``: token and job id first (401/409), then the body size (413).

    It runs before routing, so an unauthenticated client learns nothing about request validation, and
    the body is read here (at most ``limit`` bytes, also for chunked requests) before the app parses it.
    """

    def __init__(
        self,
        app,
        token: str,
        job_id: str,
        limit: int = MAX_BODY_BYTES,
        failures: PeerFailureLimiter | None = None,
    ) -> None:
        self.app, self.token, self.job_id, self.limit = app, token.encode(), job_id, limit
        self.failures = failures or PeerFailureLimiter()

    def _too_large(self) -> str:
        return f"request body exceeds {self.limit} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not secrets.compare_digest(bearer_token(headers.get(b"authorization", b"")), self.token):
            peer = (scope.get("client") or ("",))[0]
            if self.failures.blocked(peer):  # a valid token never gets here: only wrong ones are limited
                return await _reply(
                    send,
                    429,
                    ErrorCode.UNAUTHORIZED,
                    "too many requests with a wrong bearer token from this address; check --token-file",
                    extra_headers=[(b"retry-after", str(int(self.failures.window_s)).encode())],
                )
            self.failures.record_failure(peer)
            return await _reply(
                send,
                401,
                ErrorCode.UNAUTHORIZED,
                "missing or wrong bearer token; check --token-file",
                extra_headers=[(b"www-authenticate", b'Bearer realm="elastic-master"')],
            )
        job = headers.get(JOB_HEADER.lower().encode(), b"").decode(errors="replace")
        if job != self.job_id:
            return await _reply(
                send, 409, ErrorCode.WRONG_JOB, f"this master serves job {self.job_id!r}, not {job!r}"
            )
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
    # connection: close, so that a refused client holds no keep-alive connection (descriptor) open.
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})
