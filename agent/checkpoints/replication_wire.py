"""The wire format of peer replication (:mod:`agent.checkpoints.replication`): JSON lines and raw file bytes
over one TCP connection per push, TLS on both sides exactly when the agent has ``--tls-cert/--tls-key`` (see
:func:`tls_contexts`).

1. the receiver sends ``{"nonce": hex}``; the sender answers ``{"job", "node", "mac"}`` with
   ``mac = HMAC-SHA256(job token, nonce|job|node)`` (the token never crosses the wire); the receiver
   checks it in constant time and answers ``{"ok": true}`` or an error and closes;
2. the sender sends ``{"step", "save_id", "files": [[name, size], ...]}`` then the files' bytes in that
   order (at most ``--replication-bandwidth`` bytes/s), then ``{"sha256": {name: hex}}``;
3. the receiver (:mod:`agent.checkpoints.replica_server`) writes them into
``<shm>/replicas/<sender>/sharded/`` (the
   layout of :mod:`elastic.checkpoint.shard_layout`), hashing as it receives; if every hash matches, it
   records them in ``hashes.json`` (checked again at restore), commits the step, drops the sender's older
   replica and answers ``{"ok": true}``; otherwise an error, and nothing is committed.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl

from elastic import errors
from elastic.checkpoint import shard_layout as sl

CHUNK = 4 << 20
_LINE_MAX = 1 << 20  # a JSON line of the protocol (a file list of thousands of ranks fits)
IO_TIMEOUT_S = 60.0
#: The one TLS rule of replication, quoted where a handshake or greeting fails (docs/security.md).
TLS_RULE = (
    "replication uses TLS exactly when the agent has --tls-cert/--tls-key (verifying peers with --tls-ca): "
    "give every agent of the job the same TLS options"
)


class ReplicationError(errors.ReplicationError):
    """A push failed (peer unreachable, refused, out of space, a hash mismatch); the message says why."""


def mac(token: str, nonce: str, job: str, node: str) -> str:
    """The sender's proof that it holds the job token, for this ``nonce``."""
    return hmac.new(token.encode(), f"{nonce}|{job}|{node}".encode(), hashlib.sha256).hexdigest()


def send_line(sock: socket.socket, value: object) -> None:
    """Send one protocol line (compact JSON and a newline)."""
    sock.sendall(json.dumps(value, separators=(",", ":")).encode() + b"\n")


class Reader:
    """Buffered reads of lines and exact byte counts from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, bytearray()

    def line(self) -> dict:
        while b"\n" not in self.buffer:
            if len(self.buffer) > _LINE_MAX:
                raise ReplicationError("protocol line too long")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ReplicationError("connection closed")
            self.buffer += chunk
        index = self.buffer.index(b"\n")
        raw = bytes(self.buffer[:index])
        del self.buffer[: index + 1]
        try:
            value = json.loads(raw)
        except ValueError:
            raise ReplicationError("malformed protocol line") from None
        if not isinstance(value, dict):
            raise ReplicationError("malformed protocol line")
        return value

    def chunks(self, size: int):
        """Yield exactly ``size`` bytes, in chunks."""
        if self.buffer:
            head = bytes(self.buffer[:size])
            del self.buffer[: len(head)]
            size -= len(head)
            yield head
        while size > 0:
            chunk = self.sock.recv(min(size, CHUNK))
            if not chunk:
                raise ReplicationError("connection closed mid-file")
            size -= len(chunk)
            yield chunk


def valid_name(name: object) -> bool:
    """A file name a sharded save may hold (a data file, the metadata or the manifest)."""
    return isinstance(name, str) and (sl.file_id(name) is not None or name in (sl.METADATA, sl.MANIFEST))


def expect_ok(reader: Reader, what: str) -> None:
    """Read the peer's answer to ``what``; raise its error unless it is ``{"ok": true}``."""
    reply = reader.line()
    if reply.get("ok") is not True:
        raise ReplicationError(f"the peer refused {what}: {reply.get('error', 'no reason given')}")


def tls_contexts(
    tls_cert: str | None, tls_key: str | None, tls_ca: str | None
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """``(listener's, sender's)`` TLS contexts under the one rule (:data:`TLS_RULE`): both when the agent
    has a certificate and key, neither otherwise (an agent with only ``--tls-ca`` verifies the master,
    and its peers' listeners, lacking certificates, speak plain TCP).

    Raises:
        TLSConfigError: a file cannot be used, or a certificate is given without a CA to verify peers.
    """
    from elastic.control.tls import TLSConfigError, client_context, server_context

    if not (tls_cert and tls_key):
        return None, None
    if not tls_ca:
        raise TLSConfigError("replication over TLS (--tls-cert/--tls-key) needs --tls-ca to verify peers")
    return server_context(tls_cert, tls_key), client_context(tls_ca)
