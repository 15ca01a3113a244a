"""The byte pipe under an agent stream (elastic.control.stream_client): a TCP connection to a master, with TLS
where the client has a CA file, and the HTTP/1.1 Upgrade that switches it to frames (docs/protocol.md, "The
agent stream"). Standard library only.

TLS runs through :class:`ssl.MemoryBIO` rather than an :class:`ssl.SSLSocket`: OpenSSL does not allow one
SSL object to be used by two threads at once, and a stream has a reader thread waiting for replies while
callers send. Every use of the SSL object holds one lock; the reader waits on the raw socket without it.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from dataclasses import dataclass

from elastic.control.addresses import split_address
from elastic.control.protocol import STREAM_PATH, STREAM_UPGRADE
from elastic.errors import MasterError

#: Bytes asked of the kernel per read.
READ_SIZE = 65536
#: Longest response head (status line and headers) accepted from a master.
MAX_HEAD_BYTES = 64 * 1024
#: Longest refusal body read (a master's ErrorBody is a few hundred bytes).
MAX_REFUSAL_BYTES = 64 * 1024


class StreamError(MasterError):
    """Base of the errors of an agent stream (the client turns them into its own errors)."""


class StreamLost(StreamError, ConnectionError):
    """The connection could not be opened, broke, or closed; ``dropped``: the master closed it (or reset
    it) before answering, as a TLS master does with a plain request. The cause, if any, is chained."""

    def __init__(self, message: str, *, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


class StreamTimeout(StreamError, TimeoutError):
    """No answer within the call's time (the connection stays open; a late answer is dropped)."""


class StreamRefused(StreamError):
    """The master answered the upgrade with an ordinary HTTP response (a refusal, or 404: no stream)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"the master answered the stream upgrade with HTTP {status}")
        self.status, self.body = status, body


class _Plain:
    """A plain TCP connection: reads and writes go straight to the socket (safe from two threads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> bytes:
        """The next bytes; b"" at the end of the stream."""
        return self.sock.recv(READ_SIZE)


class _TLS:
    """TLS over ``sock`` through memory buffers; every use of the SSL object holds ``_lock``."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str) -> None:
        self.sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        # server_hostname: the certificate must name the host as given (httpx checks it the same way).
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self._lock = threading.Lock()

    def handshake(self) -> None:
        """Complete the TLS handshake (the socket's timeout bounds each read)."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(READ_SIZE)
                if not data:
                    closed = "the master closed the connection during the TLS handshake"
                    raise StreamLost(closed, dropped=True) from None
                self._incoming.write(data)
        self._flush()

    def _flush(self) -> None:
        out = self._outgoing.read()
        if out:
            self.sock.sendall(out)

    def send(self, data: bytes) -> None:
        with self._lock:  # held while sending too: TLS records must leave in the order they were made
            self._tls.write(data)
            self._flush()

    def recv(self) -> bytes:
        """The next application bytes; b"" at the end of the stream (a close_notify or the socket's end)."""
        while True:
            data = self.sock.recv(READ_SIZE)
            if not data:
                return b""
            chunks: list[bytes] = []
            with self._lock:
                self._incoming.write(data)
                while True:
                    try:
                        chunk = self._tls.read(READ_SIZE)
                    except ssl.SSLWantReadError:
                        break
                    except ssl.SSLZeroReturnError:
                        chunk = b""
                    if not chunk:  # the master ended TLS: what was read before it still counts
                        return b"".join(chunks)
                    chunks.append(chunk)
                self._flush()  # TLS 1.3 may answer records of its own (a key update)
            if chunks:
                return b"".join(chunks)


Pipe = _Plain | _TLS


@dataclass
class Opened:
    """A connection the master switched to the stream: its pipe and the bytes read past the 101 head."""

    pipe: Pipe
    leftover: bytes


def open_stream(
    address: str,
    headers: dict[str, str],
    *,
    tls: ssl.SSLContext | None,
    timeout: float,
    send_timeout: float,
) -> Opened:
    """Connect to ``address`` (``HOST:PORT``; TCP, or TLS with ``tls``) and ask for the stream.

    ``headers``: the request's own (Authorization, X-Elastic-Job, X-Elastic-Protocol). The connection and
    the TLS handshake get ``min(timeout, 3 s)``, the upgrade's answer ``timeout``; a send blocked for
    ``send_timeout`` (a master that stopped reading) fails. Raises :class:`StreamRefused` for any answer
    but 101, :class:`StreamLost` when no answer comes (an ``ssl.SSLError`` as its cause: a TLS failure),
    :class:`StreamTimeout` when it comes too late."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, 3.0))
    except TimeoutError as exc:
        raise StreamTimeout(f"connecting to {address} timed out") from exc
    except OSError as exc:
        raise StreamLost(f"cannot connect to {address}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame leaves at once (no Nagle)
        pipe: Pipe = _Plain(sock)
        if tls is not None:
            pipe = _TLS(sock, tls, host)
            pipe.handshake()
        sock.settimeout(timeout)
        pipe.send(_request(address, headers))
        status, head_headers, rest = _read_head(pipe)
        if status != 101:
            raise StreamRefused(status, _read_body(pipe, head_headers, rest))
        if head_headers.get("upgrade", "").lower() != STREAM_UPGRADE:
            raise StreamLost(f"the master at {address} switched to {head_headers.get('upgrade')!r}")
        # From now on the reader blocks until a frame comes (no timeout), and a blocked send gives up after
        # send_timeout (SO_SNDTIMEO: the kernel's, so that the reader's waits are not cut).
        sock.settimeout(None)
        seconds = max(send_timeout, 0.001)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
        )
        return Opened(pipe, rest)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, TimeoutError) and not isinstance(exc, StreamError):
            raise StreamTimeout(f"the master at {address} did not answer the stream upgrade in time") from exc
        if isinstance(exc, ssl.SSLError):
            raise StreamLost(f"TLS with the master at {address} failed: {exc}") from exc
        if isinstance(exc, OSError) and not isinstance(exc, StreamError):
            dropped = isinstance(exc, (ConnectionResetError, BrokenPipeError))
            raise StreamLost(f"the connection to {address} failed: {exc}", dropped=dropped) from exc
        raise


def _request(address: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"GET {STREAM_PATH} HTTP/1.1",
        f"Host: {address}",
        "Connection: Upgrade",
        f"Upgrade: {STREAM_UPGRADE}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _read_head(pipe: Pipe) -> tuple[int, dict[str, str], bytes]:
    """The status, the headers (names lower-case) and the bytes after the head."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            raise StreamLost("the master's answer to the stream upgrade has an over-long head")
        chunk = pipe.recv()
        if not chunk:
            raise StreamLost("the master closed the connection without answering", dropped=True)
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise StreamLost(f"the master answered the stream upgrade with {status_line[:100]!r}")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, rest


def _read_body(pipe: Pipe, headers: dict[str, str], body: bytes) -> bytes:
    """A refusal's body: by its Content-Length, else up to the end of the connection (both bounded)."""
    length = headers.get("content-length", "")
    want = min(int(length), MAX_REFUSAL_BYTES) if length.isdigit() else MAX_REFUSAL_BYTES
    while len(body) < want:
        try:
            chunk = pipe.recv()
        except OSError:
            break  # the status is the answer; a body cut short only shortens its message
        if not chunk:
            break
        body += chunk
    return body[:want]
