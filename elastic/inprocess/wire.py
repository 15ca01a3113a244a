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

either way
    ``error {error}``: the other side's last line broke the protocol (why); the sender closes next.

**Malformed input** (:func:`decode`): a line that is not UTF-8 JSON, nested deeper than
:data:`MAX_DEPTH`, holds NaN or an infinity (also an overflowing literal such as ``1e999``), is not an
object, longer than :data:`MAX_LINE_BYTES`, names an op the reader does not take, or lacks a field of its
op or gives it the wrong type is a :class:`WireError`; :meth:`LineReader.messages` then answers ``error``,
logs one line (no traceback) and ends the connection. The listener serves each connection apart, so one
bad client costs only its own connection. Unknown extra fields are ignored (a newer peer may add some).

Standard library only: the agent imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from elastic.errors import ProtocolError

HELLO, BROKEN, PAUSED, RESUMED, FAILED = "hello", "broken", "paused", "resumed", "failed"
PAUSE, RESUME = "pause", "resume"
ERROR = "error"
WORKER_OPS = frozenset({HELLO, BROKEN, PAUSED, RESUMED, FAILED, ERROR})
AGENT_OPS = frozenset({PAUSE, RESUME, ERROR})

#: A message longer than this is a protocol error (an environment is a few KB).
MAX_LINE_BYTES = 1 << 20
#: After a refusal, what the peer still sends is read and dropped for at most this long.
LINGER_S = 1.0
#: Deepest nesting of a message (the deepest one, ``resume``'s environment, has 2).
MAX_DEPTH = 8


class WireError(ProtocolError, ValueError):
    """A line that is not a message of this channel."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _int_or_none(value: object) -> bool:
    return value is None or _is_int(value)


def _str(value: object) -> bool:
    return isinstance(value, str)


def _environment(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


#: Each op's fields and their checks: a message lacking one, or with a wrong type, is refused.
FIELDS: dict[str, dict[str, Callable[[object], bool]]] = {
    HELLO: {"local_rank": _nonneg_int, "pid": _positive_int},
    BROKEN: {"error": _str},
    PAUSED: {"round": _int_or_none, "step": _nonneg_int},
    RESUMED: {"round": _is_int},
    FAILED: {"error": _str},
    PAUSE: {"round": _is_int},
    RESUME: {"round": _is_int, "env": _environment},
    ERROR: {"error": _str},
}


def encode(op: str, **fields: Any) -> bytes:
    """One message as a line of JSON."""
    return json.dumps({"op": op, **fields}, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _refuse_constant(name: str) -> float:
    raise WireError(f"{name} is not a number this channel takes")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # a literal such as 1e999 parses to infinity
        raise WireError(f"{text[:40]} is not a finite number")
    return value


def _depth(value: object, limit: int) -> int:
    """The nesting depth of a parsed JSON value, counted no further than ``limit + 1``."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            level.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def load_object(line: bytes | bytearray, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The JSON object of one protocol line, parsed strictly: :class:`WireError` (one line, saying why)
    unless it is UTF-8 JSON of an object, with finite numbers only, nested at most ``max_depth`` deep.

    Python's parser takes ``NaN``/``Infinity`` and raises RecursionError on deep nesting; both are
    refused here, as the master's API refuses them. Also used by agent-to-agent replication."""
    try:
        value = json.loads(bytes(line).decode(), parse_constant=_refuse_constant, parse_float=_finite_float)
    except WireError:
        raise
    except RecursionError:
        raise WireError("not a JSON line: nested too deeply") from None
    except ValueError as exc:  # not UTF-8, not JSON, an integer of more digits than Python converts
        raise WireError(f"not a JSON line: {exc}") from None
    if not isinstance(value, dict):
        raise WireError(f"a JSON {type(value).__name__}, not an object")
    if _depth(value, max_depth) > max_depth:
        raise WireError(f"nested deeper than {max_depth}")
    return value


def decode(line: bytes | bytearray, ops: frozenset[str]) -> dict[str, Any]:
    """The message of ``line``: :class:`WireError` when it is not a strict JSON object (:func:`load_object`),
    its ``op`` is not in ``ops``, or a field of its op is missing or of the wrong type (:data:`FIELDS`)."""
    message = load_object(line)
    op = message.get("op")
    if not isinstance(op, str) or op not in ops:
        raise WireError(f"unexpected op {str(op)[:80]!r}")
    for name, check in FIELDS[op].items():
        if name not in message or not check(message[name]):
            raise WireError(f"{op}: field {name!r} missing or of the wrong type")
    return message


@dataclass
class LineReader:
    """Splits what a stream socket delivers into lines; :meth:`read` returns the next whole messages."""

    sock: socket.socket
    ops: frozenset[str]
    _buffer: bytearray = field(default_factory=bytearray)

    def messages(self, log: logging.Logger) -> Iterator[dict[str, Any]]:
        """Every message until the peer closes the connection or breaks the protocol: then it is answered
        ``error`` (why) and one line is logged, no traceback; the caller closes the connection. The
        messages before a bad line are delivered."""
        while True:
            try:
                lines = self._next_lines()
            except WireError as exc:
                self._refuse(log, exc)
                return
            if lines is None:
                if self._buffer.strip():
                    log.warning("in-process channel: the peer closed the connection mid-line")
                return
            for line in lines:
                try:
                    message = decode(line, self.ops)
                except WireError as exc:
                    self._refuse(log, exc)
                    return
                yield message

    def read(self) -> list[dict[str, Any]] | None:
        """The messages of the next chunk (maybe none); None once the peer closed the connection."""
        lines = self._next_lines()
        return None if lines is None else [decode(line, self.ops) for line in lines]

    def _next_lines(self) -> list[bytearray] | None:
        """The whole non-blank lines of the next chunk; None once the peer closed the connection."""
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        self._buffer += chunk
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = rest
        if len(rest) > MAX_LINE_BYTES or any(len(line) > MAX_LINE_BYTES for line in lines):
            raise WireError(f"a line longer than {MAX_LINE_BYTES} bytes")
        return [line for line in lines if line.strip()]

    def _refuse(self, log: logging.Logger, exc: WireError) -> None:
        log.warning("in-process channel: the peer broke the protocol (%s); closing the connection", exc)
        with contextlib.suppress(OSError):  # never blocks: a peer that does not read is not waited for
            self.sock.send(encode(ERROR, error=str(exc)[:500]), socket.MSG_DONTWAIT)
        # Then read what the peer still sends, bounded, before the caller closes: closing with unread
        # bytes resets the connection, and the peer could lose the error line.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(LINGER_S)
            drained = 0
            while drained < MAX_LINE_BYTES and (chunk := self.sock.recv(65536)):
                drained += len(chunk)
