"""The agent stream (docs/protocol.md, "The agent stream") spoken from a plain blocking socket, for tests of
the master's side: the upgrade request and its answer, then one JSON frame per line each way."""

from __future__ import annotations

import json
import select
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any

from elastic.control.protocol import (
    JOB_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STREAM_PATH,
    STREAM_UPGRADE,
)


def upgrade_request(
    token: str | None,
    job_id: str | None,
    *,
    path: str = STREAM_PATH,
    revision: int | None = PROTOCOL_VERSION,
    upgrade: str = STREAM_UPGRADE,
    extra: dict[str, str] | None = None,
) -> bytes:
    """``GET path`` asking to switch to the stream; None leaves a header out."""
    headers = {"Host": "master", "Connection": "Upgrade", "Upgrade": upgrade}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if job_id is not None:
        headers[JOB_HEADER] = job_id
    if revision is not None:
        headers[PROTOCOL_HEADER] = str(revision)
    headers.update(extra or {})
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"GET {path} HTTP/1.1\r\n{lines}\r\n".encode()


@dataclass
class Answer:
    """The master's answer to the upgrade request: its status, headers (lower-case names) and body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


class StreamSocket:
    """One connection to a master: :meth:`open` sends the upgrade request (and ``first`` bytes with it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rb")
        self.answer: Answer | None = None

    @classmethod
    def open(
        cls,
        address: tuple[str, int],
        request: bytes,
        first: bytes = b"",
        *,
        tls: ssl.SSLContext | None = None,
        timeout: float = 10.0,
    ) -> StreamSocket:
        sock = socket.create_connection(address, timeout=timeout)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=address[0])
        stream = cls(sock)
        sock.sendall(request + first)
        stream.answer = stream._read_answer()
        return stream

    def _read_answer(self) -> Answer:
        status_line = self.file.readline()
        if not status_line:
            raise ConnectionError("the master closed the connection without answering")
        answer = Answer(int(status_line.split()[1]))
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            answer.headers[name.strip().lower()] = value.strip()
        length = int(answer.headers.get("content-length", "0"))
        answer.body = self.file.read(length) if length else b""
        return answer

    def send(self, **frame: Any) -> None:
        self.send_raw(json.dumps(frame).encode() + b"\n")

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> dict[str, Any]:
        """The next frame from the master (a ConnectionError at EOF; TimeoutError when none comes)."""
        line = self.file.readline()
        if not line:
            raise ConnectionError("the master closed the stream")
        return json.loads(line)

    def call(self, **frame: Any) -> dict[str, Any]:
        """Send one call and return its reply (nothing else must be pending)."""
        self.send(**frame)
        reply = self.reply()
        assert reply["id"] == frame["id"], reply
        return reply

    def closed_by_peer(self, timeout: float) -> bool:
        """Whether the master closes the connection within ``timeout`` (what it sends meanwhile is read)."""
        self.sock.settimeout(timeout)
        try:
            while self.file.readline():
                pass
        except TimeoutError:
            return False
        except (ConnectionResetError, ssl.SSLError):
            pass
        return True

    def silent_for(self, seconds: float) -> bool:
        """Whether the master sends nothing, and does not close the connection, for ``seconds``."""
        readable, _, _ = select.select([self.sock], [], [], seconds)
        return not readable

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> StreamSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
