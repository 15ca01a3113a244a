"""The agent stream, client side (docs/protocol.md, "The agent stream"): one connection to a master carrying
the agent's calls, multiplexed (:class:`StreamConnection`), and a client's streams, at most one per master
address (:class:`MasterStreams`). Synchronous and thread-safe; standard library only.

After the upgrade (elastic.control.stream_transport), a call is one JSON line ``{"id", "op", "secret",
"query", "body"}`` and its reply one line ``{"id", "status", "body"}``. Replies may come in any order (a watch
long-poll waits while heartbeats are answered): one reader thread per connection hands each reply to the
caller waiting for its id. Callers send under one lock and wait on their own event, each with its own
timeout; a reply that comes after its caller gave up is dropped. When the connection ends, every pending
call fails at once with :class:`StreamLost`, and so does every later call: a connection is never reopened
(its :class:`MasterStreams` opens a new one).

The streams of one :class:`elastic.control.client.MasterClient` are opened on first use and shared by every
thread of the client (heartbeats, long-polls, the main loop), so that an agent holds one connection to its
master. A master that answers the upgrade with 404 is of a release without the stream (426: a proxy on the
way dropped the upgrade): that is remembered and the client speaks plain HTTP to it, until a request to
that address fails (the master there may have been restarted as a newer release). ``ELASTIC_MASTER_STREAM=0``
turns streams off (plain HTTP throughout, one connection per thread as before): for comparing and
debugging.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any

from elastic.control.protocol import STREAM_MAX_FRAME_BYTES
from elastic.control.stream_transport import (
    Pipe,
    StreamError,
    StreamLost,
    StreamRefused,
    StreamTimeout,
    open_stream,
)
from elastic.errors import MasterError

# -- one connection ---------------------------------------------------------------------------------
__all__ = [
    "StreamConnection",
    "StreamError",
    "StreamFrameTooLarge",
    "StreamLost",
    "StreamRefused",
    "StreamTimeout",
]

log = logging.getLogger(__name__)

#: Longest reply line accepted from a master (its replies are a few KiB): beyond, the master broke the
#: protocol and the connection is closed rather than buffered without end.
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: The longest wait before a heartbeat that a shed heartbeat's ``retry_after_s`` is obeyed for (the master
#: asks for at most half its heartbeat timeout); a longer one is ignored.
MAX_BACKOFF_S = 60.0


class StreamFrameTooLarge(StreamError):
    """A call longer than the master reads on a stream (STREAM_MAX_FRAME_BYTES); nothing was sent."""


class _Waiter:
    """One pending call: set once, by the reader (a reply) or by the end of the connection (an error)."""

    __slots__ = ("done", "reply", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: tuple[int, Any] | None = None
        self.error: BaseException | None = None


def encode_call(
    call_id: int, op: str, *, secret: str | None, query: dict[str, Any] | None, body_json: str | None
) -> bytes:
    """The frame of one call. ``body_json``: the body as compact JSON text (a pydantic model's
    ``model_dump_json()``), put in as it is."""
    text = f'{{"id":{call_id},"op":{json.dumps(op)}'
    if secret is not None:
        text += f',"secret":{json.dumps(secret)}'
    if query:
        text += f',"query":{json.dumps(query, separators=(",", ":"))}'
    if body_json is not None:
        if "\n" in body_json:  # a newline ends a frame; compact JSON never holds one
            raise ValueError("a stream call's body must be compact JSON (no newline)")
        text += f',"body":{body_json}'
    return (text + "}\n").encode()


class StreamConnection:
    """A stream to the master at ``address``, open from :meth:`open` until :meth:`close` or its loss."""

    def __init__(self, address: str, pipe: Pipe, leftover: bytes = b"") -> None:
        self.address = address
        self._pipe = pipe
        self._sock = pipe.sock
        self._lock = threading.Lock()  # the pending calls, the id counter, the state
        self._send_lock = threading.Lock()  # one frame at a time on the wire
        self._sock_lock = threading.Lock()  # shutdown vs close of the socket (never a reused descriptor)
        self._pending: dict[int, _Waiter] = {}
        self._last_id = 0
        self._error: StreamLost | None = None  # set once the connection is over
        self._ending: str | None = None  # why this side ends it (close, a failed send)
        self._sock_closed = False
        #: No heartbeat before this time (monotonic): an overloaded master's ``retry_after_s`` (see call()).
        self._beat_after = float("-inf")
        self._reader = threading.Thread(
            target=self._read, args=(leftover,), name=f"master-stream {address}", daemon=True
        )
        self._reader.start()

    @classmethod
    def open(
        cls,
        address: str,
        headers: dict[str, str],
        *,
        tls: ssl.SSLContext | None,
        timeout: float,
        send_timeout: float | None = None,
    ) -> StreamConnection:
        """Connect and upgrade (see :func:`elastic.control.stream_transport.open_stream` for the time limits
        and
        the errors: :class:`StreamRefused`, :class:`StreamLost`, :class:`StreamTimeout`)."""
        opened = open_stream(address, headers, tls=tls, timeout=timeout, send_timeout=send_timeout or timeout)
        return cls(address, opened.pipe, opened.leftover)

    @property
    def closed(self) -> bool:
        """True once the connection is over (closed by either side, or broken)."""
        return self._error is not None or self._ending is not None

    def call(
        self,
        op: str,
        *,
        timeout: float,
        secret: str | None = None,
        query: dict[str, Any] | None = None,
        body_json: str | None = None,
    ) -> tuple[int, Any]:
        """Send one call and wait at most ``timeout`` seconds for its reply: ``(status, body)``, the body
        decoded from JSON. Raises :class:`StreamTimeout` (the connection stays), :class:`StreamLost` (it is
        over), :class:`StreamFrameTooLarge` (nothing sent)."""
        if op == "heartbeat":
            self._back_off(timeout)
        waiter = _Waiter()
        with self._lock:
            self._raise_if_over()
            self._last_id += 1
            call_id = self._last_id
            self._pending[call_id] = waiter
        frame = encode_call(call_id, op, secret=secret, query=query, body_json=body_json)
        if len(frame) > STREAM_MAX_FRAME_BYTES + 1:
            self._forget(call_id)
            raise StreamFrameTooLarge(f"a {op} call of {len(frame)} bytes is over the stream's frame limit")
        try:
            with self._send_lock:
                self._pipe.send(frame)
        except OSError as exc:  # a blocked send past its time, a reset: the connection is unusable
            self._forget(call_id)
            self._end(f"a send failed: {exc}")
            raise StreamLost(f"sending to the master at {self.address} failed: {exc}") from exc
        if not waiter.done.wait(timeout):
            self._forget(call_id)  # a reply that comes now is dropped
            if not waiter.done.is_set():
                raise StreamTimeout(f"no reply from the master at {self.address} within {timeout:g}s")
        if waiter.error is not None:
            raise StreamLost(str(waiter.error)) from waiter.error.__cause__
        reply = waiter.reply
        if reply is None:  # cannot happen: done without an error means the reader set the reply
            raise StreamLost(f"the stream to the master at {self.address} lost a reply")
        if op == "heartbeat" and reply[0] == 429 and isinstance(reply[1], dict):
            wait = reply[1].get("retry_after_s")
            if isinstance(wait, (int, float)) and 0 < wait <= MAX_BACKOFF_S:
                self._beat_after = time.monotonic() + float(wait)
        return reply

    def _back_off(self, timeout: float) -> None:
        """An overloaded master shed this agent's last heartbeat and asked it to wait ``retry_after_s``
        (master.service.overload) before the next: wait what is left of that (at most ``timeout``)."""
        left = self._beat_after - time.monotonic()
        if left > 0:
            time.sleep(min(left, timeout))

    def close(self) -> None:
        """Close the connection: pending calls fail with :class:`StreamLost`; returns once the reader
        thread has ended and the socket is closed."""
        self._end("closed by the client")
        if threading.current_thread() is not self._reader:
            self._reader.join()

    # -- internals ----------------------------------------------------------------------------------
    def _raise_if_over(self) -> None:
        if self._error is not None:
            raise StreamLost(str(self._error)) from self._error.__cause__
        if self._ending is not None:
            raise StreamLost(f"the stream to the master at {self.address} is {self._ending}")

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._pending.pop(call_id, None)

    def _end(self, why: str) -> None:
        """End the connection from this side: the reader wakes (end of stream) and fails what is pending."""
        with self._lock:
            if self._ending is None:
                self._ending = why
        with self._sock_lock:
            if not self._sock_closed:
                with contextlib.suppress(OSError):  # already reset by the master: the reader sees it too
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self, leftover: bytes) -> None:
        buffer = bytearray(leftover)
        cause: BaseException | None = None
        try:
            while True:
                self._dispatch_lines(buffer)
                if len(buffer) > MAX_REPLY_BYTES:
                    raise StreamLost(f"a reply of over {MAX_REPLY_BYTES} bytes")
                data = self._pipe.recv()
                if not data:
                    break
                buffer += data
        except (OSError, ValueError) as exc:  # the socket failed, or the master broke the protocol
            cause = exc
        finally:
            self._finish(cause)

    def _dispatch_lines(self, buffer: bytearray) -> None:
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            self._dispatch(bytes(buffer[start:end]))
            start = end + 1
        del buffer[:start]

    def _dispatch(self, line: bytes) -> None:
        message = json.loads(line)  # ValueError ends the connection: the master broke the protocol
        call_id = message.get("id") if isinstance(message, dict) else None
        status = message.get("status") if isinstance(message, dict) else None
        if not isinstance(call_id, int) or not isinstance(status, int):
            raise ValueError(f"a reply without an int id and status: {line[:200]!r}")
        if call_id == 0:  # about a frame the master could not read (413 closes the connection)
            log.warning("the master at %s refused a frame: %s %s", self.address, status, message.get("body"))
            return
        with self._lock:  # set under the lock: a caller that times out now finds it either done or gone
            waiter = self._pending.pop(call_id, None)
            if waiter is not None:
                waiter.reply = (status, message.get("body"))
                waiter.done.set()

    def _finish(self, cause: BaseException | None) -> None:
        with self._lock:
            why = self._ending or (f"{cause}" if cause is not None else "closed by the master")
            error = StreamLost(f"the stream to the master at {self.address} ended: {why}")
            error.__cause__ = cause
            self._error = error
            pending, self._pending = self._pending, {}
            for waiter in pending.values():
                waiter.error = error
                waiter.done.set()
        # Not while a frame is being sent: the descriptor must not be closed (and reused) under a send.
        with self._send_lock, self._sock_lock:
            self._sock_closed = True
            self._sock.close()
        log.debug("stream to %s ended: %s", self.address, why)


# -- a client's streams, one per master address -----------------------------------------------------

#: ``0`` (or ``false``, ``no``, ``off``): agents speak plain HTTP to their masters, no stream.
STREAM_ENV = "ELASTIC_MASTER_STREAM"
_OFF = frozenset({"0", "false", "no", "off"})
#: Answers to the upgrade that mean "no stream here", remembered: 404, a master of an older release; 426,
#: the upgrade headers were lost on the way (a proxy that does not pass upgrades on).
_NO_STREAM = frozenset({404, 426})
#: Shortest time between two attempts of :meth:`MasterStreams.warm_others` at one address.
WARM_RETRY_S = 10.0
#: The master's own refusals of the upgrade (docs/protocol.md): the call's answer, as over HTTP. Any other
#: status (a proxy's 400 or 502, say) sends that call over plain HTTP, without remembering it.
_REFUSALS = frozenset({401, 409, 429, 503})


def stream_wanted(environ: Mapping[str, str]) -> bool:
    """Whether clients use the agent stream: yes unless :data:`STREAM_ENV` says no."""
    return environ.get(STREAM_ENV, "").strip().lower() not in _OFF


class NoStream(MasterError):
    """The master at this address has no stream (it answered the upgrade 404): use plain HTTP."""


class MasterStreams:
    """One stream per master address of ``addresses`` (indexes into that list)."""

    def __init__(self, addresses: list[str], headers: dict[str, str], tls: ssl.SSLContext | None) -> None:
        self.addresses = addresses
        self._headers = headers
        self._tls = tls
        self._lock = threading.Lock()  # the table of streams and of masters without one
        self._streams: dict[int, StreamConnection] = {}
        self._without: set[int] = set()  # addresses whose master answered the upgrade 404
        # One opener per address: the threads that need a stream at once wait for it, none opens a second.
        self._openers = [threading.Lock() for _ in addresses]
        self._warmed: dict[int, float] = {}  # address -> when warm_others last tried to open its stream
        self._closes = 0  # calls of close(), so that a stream warmed meanwhile is not left open

    def offered(self, index: int) -> bool:
        """False when the master at ``index`` is known to have no stream."""
        return index not in self._without

    def call(
        self,
        index: int,
        op: str,
        *,
        timeout: float,
        wait: float = 0.0,
        secret: str | None = None,
        query: dict[str, Any] | None = None,
        body_json: str | None = None,
    ) -> tuple[int, Any]:
        """``op`` on the stream to ``addresses[index]``, opened first if need be: ``(status, body)``.

        ``timeout`` bounds opening (connect: at most 3 s) and the reply, which may take ``wait`` more (a
        long-poll). An upgrade the master refuses (401, 409, 429, 503) comes back as that status and its body
        (bytes); raises :class:`NoStream` (use HTTP) for other answers, or a
        :class:`elastic.control.stream_client.StreamError` (transport)."""
        try:
            stream = self._stream(index, timeout)
        except StreamRefused as exc:  # 401, 409 wrong_job, 429, 503 not_leader or busy: the call's answer
            return exc.status, exc.body
        return stream.call(op, timeout=timeout + wait, secret=secret, query=query, body_json=body_json)

    def _stream(self, index: int, timeout: float) -> StreamConnection:
        with self._lock:
            stream = self._streams.get(index)
        if stream is not None and not stream.closed:
            return stream
        opener = self._openers[index]
        if not opener.acquire(timeout=timeout):  # another thread is still opening it: this call's time is up
            raise StreamTimeout(f"the stream to the master at {self.addresses[index]} is still opening")
        try:
            with self._lock:
                stream = self._streams.pop(index, None)
            if stream is not None:
                if not stream.closed:
                    with self._lock:
                        self._streams[index] = stream
                    return stream
                stream.close()  # over: its reader has ended; joined here
            address = self.addresses[index]
            try:
                stream = StreamConnection.open(address, self._headers, tls=self._tls, timeout=timeout)
            except StreamRefused as exc:
                if exc.status in _NO_STREAM:
                    why = f"HTTP {exc.status}"
                    log.info("the master at %s offers no agent stream (%s): plain HTTP", address, why)
                    with self._lock:
                        self._without.add(index)
                    raise NoStream(address) from None
                if exc.status not in _REFUSALS:  # not the master's answer: a proxy's, say; HTTP this time
                    raise NoStream(address) from None
                raise
            with self._lock:
                self._streams[index] = stream
            return stream
        finally:
            opener.release()

    def stream_lacking_again(self, index: int) -> None:
        """A plain request to ``index`` failed (a restart breaks one): ask for the stream again next time."""
        with self._lock:
            self._without.discard(index)

    def drop(self, index: int) -> None:
        """Close the stream to ``addresses[index]``."""
        with self._lock:
            stream = self._streams.pop(index, None)
        if stream is not None:
            stream.close()

    def warm_others(self, index: int, timeout: float) -> None:
        """The master at ``index`` answered (it leads): make sure a stream is open to every other address,
        in the background, so that when this one fails its successor is one frame away, not a connection
        and an upgrade behind 10,000 others. An address is tried at most every :data:`WARM_RETRY_S`."""
        now = time.monotonic()
        with self._lock:
            todo = [
                i
                for i in range(len(self.addresses))
                if i != index
                and i not in self._without
                and (i not in self._streams or self._streams[i].closed)
                and now - self._warmed.get(i, float("-inf")) >= WARM_RETRY_S
            ]
            for i in todo:
                self._warmed[i] = now
        for i in todo:
            threading.Thread(target=self._warm, args=(i, timeout), name="stream-warm", daemon=True).start()

    def _warm(self, index: int, timeout: float) -> None:
        closes = self._closes
        try:
            self._stream(index, timeout)
        except (MasterError, OSError) as exc:  # a refusal (at its cap, an older standby), no answer: later
            log.debug("no standby stream to %s yet: %s", self.addresses[index], exc)
            return
        if self._closes != closes:  # the client closed its streams meanwhile: this one goes too
            self.drop(index)

    def open_count(self) -> int:
        """How many streams are open now."""
        with self._lock:
            return sum(not stream.closed for stream in self._streams.values())

    def close(self) -> None:
        """Close every stream (their pending calls fail); a later call opens a new one."""
        with self._lock:
            self._closes += 1
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
