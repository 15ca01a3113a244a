"""The wire format of peer replication (:mod:`agent.checkpoints.replication`): JSON lines and raw file bytes
over one TCP connection per push, TLS on both sides exactly when the agent has ``--tls-cert/--tls-key`` (see
:func:`tls_contexts`).

**Keys** come from the master, in heartbeat replies (``CommandReply.replication_key`` and ``peer_keys``):
the master keeps a random secret per job (durable job state) and gives each node its *receiver key*
``R(n) = HMAC-SHA256(secret, ["replicate", incarnation, n])`` and, for each ring target ``t`` of ``n``,
the *pair key* ``K(n→t) = HMAC-SHA256(R(t), ["push", n])`` (:func:`pair_key`). A receiver derives the pair
key of any sender from its own ``R``; a sender holds only the pair keys of its own targets. So a member of
the job cannot push as another node (it never learns that node's pair keys), and a token holder that is
no member holds no key at all. The job token is not used here.

1. the receiver sends ``{"nonce": rn}``; the sender answers ``{"job", "node", "nonce": sn, "mac"}`` with
   ``mac = HMAC(K, ["hello", job, node, rn, sn])``; the receiver derives ``K`` for the claimed ``node``,
   checks the mac in constant time and answers ``{"ok": true, "mac": HMAC(K, ["welcome", rn, sn])}`` (the
   sender checks it: the listener is the node the master named, not a stale address) or an error and
   closes. Both sides then hold the session key ``S = HMAC(K, ["session", rn, sn])``;
2. the sender sends ``{"step", "save_id", "files": [[name, size], ...]}``; the receiver checks it against
   the sender's share of its shared memory (:mod:`agent.checkpoints.replica_server`) and answers
   ``{"ok": true}`` or an error, before any byte is written;
3. the sender sends the files' bytes in that order (at most ``--replication-bandwidth`` bytes/s), then
   ``{"xxh3_128": {name: hex}, "mac": hex}``: the digests (:func:`new_digest`) and the stream's MAC, an
   HMAC-SHA256 under ``S`` of the header line, every file byte and the digests (:func:`stream_mac`,
   :func:`digests_bytes`);
4. the receiver writes the files into ``<shm>/replicas/<sender>/sharded/`` (the layout of
   :mod:`elastic.checkpoint.shard_layout`), hashing and MACing as it receives; only if the MAC and every
   digest match does it record the digests in ``hashes.json`` (checked again at restore), commit the step,
   drop the sender's older replica and answer ``{"ok": true, "mac": HMAC(S, ["committed", step,
   save_id])}``; otherwise an error, and nothing is committed.

Every line is parsed strictly (:func:`elastic.inprocess.wire.load_object`: no NaN or infinities, a depth
limit, at most :data:`LINE_MAX` bytes); a malformed one is refused with an error line.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

from elastic import errors
from elastic.checkpoint import shard_layout as sl
from elastic.inprocess.wire import WireError, load_object

CHUNK = 4 << 20
#: Longest protocol line (a file list of thousands of ranks fits).
LINE_MAX = 1 << 20
IO_TIMEOUT_S = 60.0
#: The key of the digests in the trailer line (the digest of :func:`new_digest`).
DIGEST_KEY = "xxh3_128"
#: The one TLS rule of replication, quoted where a handshake or greeting fails (docs/security.md).
TLS_RULE = (
    "replication uses TLS exactly when the agent has --tls-cert/--tls-key (verifying peers with --tls-ca): "
    "give every agent of the job the same TLS options"
)


class ReplicationError(errors.ReplicationError):
    """A push failed (peer unreachable, refused, out of space, a hash mismatch); the message says why."""


def new_digest() -> Any:
    """A fresh digest of one file's bytes, as both sides compute it while streaming (``update``,
    ``hexdigest``): the checkpoint digest of :mod:`elastic.checkpoint.digest` (xxh3_128), which
    ``hashes.json`` records and a restore checks again; the stream's MAC, not this digest, is what a
    forger cannot match."""
    return sl.digest_hasher()


def _transcript(*parts: object) -> bytes:
    """Unambiguous bytes of a message's parts (a JSON array: no separator can be forged by a node id)."""
    return json.dumps(parts, separators=(",", ":")).encode()


def _mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, _transcript(*parts), hashlib.sha256).hexdigest()


def pair_key(receiver_key: bytes, sender: str) -> bytes:
    """``K(sender→receiver)`` from the receiver's key (master.job.views derives the same for the sender)."""
    return hmac.digest(receiver_key, _transcript("push", sender), "sha256")


def hello_mac(key: bytes, job: str, node: str, receiver_nonce: str, sender_nonce: str) -> str:
    """The sender's proof that it holds ``K(node→receiver)``, for these nonces."""
    return _mac(key, "hello", job, node, receiver_nonce, sender_nonce)


def welcome_mac(key: bytes, receiver_nonce: str, sender_nonce: str) -> str:
    """The receiver's proof that it holds the same key (it is the node the master named)."""
    return _mac(key, "welcome", receiver_nonce, sender_nonce)


def session_key(key: bytes, receiver_nonce: str, sender_nonce: str) -> bytes:
    """The key of one push's stream MAC and commit proof."""
    return hmac.digest(key, _transcript("session", receiver_nonce, sender_nonce), "sha256")


def committed_mac(session: bytes, step: int, save_id: str) -> str:
    """The receiver's proof that it committed ``step`` (a forged ``ok`` cannot fake progress)."""
    return _mac(session, "committed", step, save_id)


def stream_mac(session: bytes, header: bytes) -> Any:
    """The running MAC of one push, started with its header line's bytes (``update`` each file chunk,
    then :func:`digests_bytes`). HMAC-SHA256: hashlib releases the GIL on large chunks."""
    mac = hmac.new(session, digestmod=hashlib.sha256)
    mac.update(header)
    return mac


def digests_bytes(digests: dict[str, str]) -> bytes:
    """The digests as the stream MAC covers them (sorted by name)."""
    return _transcript("digests", sorted(digests.items()))


def matches(expected: str, given: object) -> bool:
    """``given`` is the hex MAC ``expected``, compared in constant time."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def send_line(sock: socket.socket, value: object) -> None:
    """Send one protocol line (compact JSON and a newline)."""
    sock.sendall(encode(value))


def encode(value: object) -> bytes:
    """One protocol line's bytes, the newline included."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class Reader:
    """Buffered reads of lines and exact byte counts from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, bytearray()
        #: The bytes of the last line :meth:`line` returned, without its newline (what a MAC covers).
        self.last_raw = b""

    def line(self) -> dict[str, Any]:
        """The next line's JSON object; :class:`ReplicationError` when it is malformed or too long, or
        the connection closes first."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > LINE_MAX:
                raise ReplicationError(f"protocol line longer than {LINE_MAX} bytes")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ReplicationError("connection closed")
            self.buffer += chunk
        index = self.buffer.index(b"\n")
        if index > LINE_MAX:
            raise ReplicationError(f"protocol line longer than {LINE_MAX} bytes")
        raw = bytes(self.buffer[:index])
        del self.buffer[: index + 1]
        try:
            value = load_object(raw)
        except WireError as exc:
            raise ReplicationError(f"malformed protocol line: {exc}") from None
        self.last_raw = raw
        return value

    def chunks(self, size: int) -> Iterator[bytes]:
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


def expect_ok(reader: Reader, what: str) -> dict[str, Any]:
    """Read the peer's answer to ``what``; raise its error unless it is ``{"ok": true, ...}``."""
    reply = reader.line()
    if reply.get("ok") is not True:
        reason = reply.get("error")
        raise ReplicationError(
            f"the peer refused {what}: {reason if isinstance(reason, str) else 'no reason given'}"
        )
    return reply


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
