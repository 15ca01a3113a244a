"""The agent↔worker control channel of in-process recovery: one Unix stream connection per worker.

A worker that runs under :func:`elastic.inprocess.run` connects to the socket named by
``ELASTIC_INPROCESS_SOCKET`` and says ``hello``; from then on its agent keeps it alive across rounds
instead of stopping it. Messages are JSON objects, one per line, each with an ``op``:

worker → agent
    ``hello {local_rank, pid}``: this worker recovers in process;
    ``broken {error}``: a collective failed (a peer vanished): a suspicion the agent reports;
    ``paused {round, step}``: the worker left the round's process group and holds the state of ``step``;
    ``resumed {round}``: the worker re-formed the group of ``round`` and trains again;
    ``failed {error}``: re-forming failed; the worker exits and the agent falls back to process restarts.

agent → worker
    ``pause {round}``: leave the current step (a new round is forming);
    ``resume {round, env}``: the next round's environment (torchrun's variables): form its group.

Standard library only: the agent imports it.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic.errors import ProtocolError

HELLO, BROKEN, PAUSED, RESUMED, FAILED = "hello", "broken", "paused", "resumed", "failed"
PAUSE, RESUME = "pause", "resume"
WORKER_OPS = frozenset({HELLO, BROKEN, PAUSED, RESUMED, FAILED})
AGENT_OPS = frozenset({PAUSE, RESUME})

#: A message longer than this is a protocol error (an environment is a few KB).
MAX_LINE_BYTES = 1 << 20


class WireError(ProtocolError, ValueError):
    """A line that is not a message of this channel."""


def encode(op: str, **fields: Any) -> bytes:
    """One message as a line of JSON."""
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, ops: frozenset[str]) -> dict[str, Any]:
    """The message of ``line``; :class:`WireError` when it is not JSON or its ``op`` is not in ``ops``."""
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"not a JSON line: {exc}") from exc
    if not isinstance(message, dict) or message.get("op") not in ops:
        raise WireError(f"unexpected message {str(message)[:200]!r}")
    return message


@dataclass
class LineReader:
    """Splits what a stream socket delivers into lines; :meth:`read` returns the next whole messages."""

    sock: socket.socket
    ops: frozenset[str]
    _buffer: bytes = b""

    def messages(self, log: logging.Logger) -> Iterator[dict[str, Any]]:
        """Every message until the peer closes the connection or breaks the protocol (logged)."""
        while True:
            try:
                chunk = self.read()
            except WireError as exc:
                log.warning("in-process channel: %s; closing the connection", exc)
                return
            if chunk is None:
                return
            yield from chunk

    def read(self) -> list[dict[str, Any]] | None:
        """The messages of the next chunk (maybe none); None once the peer closed the connection."""
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE_BYTES:
            raise WireError(f"a line longer than {MAX_LINE_BYTES} bytes")
        return [decode(line, self.ops) for line in lines if line.strip()]
