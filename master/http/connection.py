"""One connection to the master's listener: HTTP/1.1 parsed by h11 and served by the ASGI app (the FastAPI
app of master.http.app), under the connection guard (master.http.conn_guard); ``GET /v1/stream`` with the
stream's upgrade hands the connection to the agent stream (master.http.stream).

Why the master speaks HTTP/1.1 itself, over h11, instead of through uvicorn: the guard acts before any request
reaches an application (admitted or answered 503 when the connection is made, a deadline for every request
head and body, eviction of the oldest connection that presented no token), and the agent stream takes over a
connection after a plain HTTP request (101 to a protocol of its own). ASGI has hooks for neither: its only
upgrade is WebSocket (a different wire), and an application sees a connection only with its first request.
uvicorn's public API (``Config``, ``Server.serve(sockets=...)``) takes listening sockets, not a connection
someone else accepted and read, so doing both with uvicorn meant replacing its protocol class, whose
constructor and hooks are private and change between its releases. h11 is what uvicorn itself used here: a
public, sans-I/O HTTP/1.1 parser with a stable API; around it this module keeps what uvicorn's h11 protocol
did for this master (keep-alive between requests, request bodies with flow control, 100-continue, HEAD, the
disconnect a long-poll waits for, 400 on a malformed request, 500 when the application fails), in the ASGI 3
interface the app already speaks. The listener, the lifespan and the shutdown are master.http.serving.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import h11

from master.http.conn_guard import AUTHENTICATED_SCOPE_KEY, ConnectionGuard, release_transport

if TYPE_CHECKING:
    from master.http.stream import StreamEndpoint

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: An ASGI 3 application.
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Request body bytes buffered before the connection stops reading until the app takes them.
HIGH_WATER_BYTES = 65536
#: The most one read of a connection takes from its socket (into the server's one read buffer).
READ_BYTES = 65536
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_BAD_REQUEST = b"Invalid HTTP request received."
_TEXT_HEADERS = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]


@dataclass
class ConnectionContext:
    """What every connection of one server shares: the app, the guard, the agent stream's endpoint (None:
    no upgrade), the keep-alive timeout, the request tasks in flight (the server waits for them when it
    stops) and the lifespan's state (copied into each request's scope)."""

    app: ASGIApp
    guard: ConnectionGuard
    stream: StreamEndpoint | None
    keep_alive_s: float
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    state: dict[str, Any] = field(default_factory=dict)
    #: What every connection reads its socket into (:meth:`HttpConnection.get_buffer`): the event loop
    #: serves one read at a time and the parser copies what it keeps, so one buffer serves them all.
    #: asyncio's own reads allocate 256 KiB each and shrink it to what arrived: under a flood of
    #: connections trickling bytes, the heap those reads churned stayed in the master's RSS.
    read_buffer: memoryview = field(default_factory=lambda: memoryview(bytearray(READ_BYTES)))
    _date: tuple[int, bytes] = (0, b"")

    def date(self) -> bytes:
        """The ``date`` header's value (RFC 9110 §6.6.1), formatted once a second."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]


def _address(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, tuple) and len(value) >= 2 else None


class HttpConnection(asyncio.BufferedProtocol):
    """One accepted connection: admitted by the guard (or answered 503 ``busy``), then HTTP/1.1 requests,
    one at a time, each served by the app in a task; or, after the stream's upgrade request, the agent
    stream's. Attributes read by master.http.stream: ``scope`` and ``headers`` (the request just parsed,
    names lower-case), ``transport``, ``client``, ``server`` and ``guard``.

    What a connection holds while it waits for a request is kept small (a flood of slow connections is
    thousands of them, docs/security.md): no read buffer of its own (:meth:`get_buffer`), no event for a
    write buffer that is never full, and no request, scope or app state past its response."""

    def __init__(self, context: ConnectionContext) -> None:
        self.context, self.guard = context, context.guard
        #: The HTTP/1.1 parser, made once the guard admitted the connection (a refused one needs none).
        self.conn: h11.Connection
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None
        self.scheme = "http"
        self.scope: Scope = {}
        self.headers: list[tuple[bytes, bytes]] = []
        self._exchange: _Exchange | None = None
        self._keep_alive: asyncio.TimerHandle | None = None
        #: The deadline of the request head or body being received (conn_guard's header_timeout_s).
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._reading_paused = False
        #: While the transport's write buffer is full (pause_writing): done when it drained, or closed.
        self._drained: asyncio.Future[None] | None = None

    # -- the transport's callbacks -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.client = _address(transport.get_extra_info("peername"))
        peer = self.client[0] if self.client is not None else ""
        if not self.guard.admit(self, peer):
            self._refused = True  # never counted as a connection of the server
            self.guard.refuse(transport, peer)
            return
        self.conn = h11.Connection(h11.SERVER)
        self.server = _address(transport.get_extra_info("sockname"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") is not None else "http"
        self.guard.opened(self, peer)
        self._arm_deadline()  # the first request head: a connection that sends none is closed too

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.context.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self.context.read_buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._stop_keep_alive()
        self.conn.receive_data(data)
        self._handle_events()

    def connection_lost(self, exc: Exception | None) -> None:
        release_transport(self.transport)  # its own cycle (conn_guard.release_transport says why)
        if self._refused:
            return
        self.guard.release(self)
        self._stop_keep_alive()
        self._stop_deadline()
        exchange = self._exchange
        if exchange is not None:
            if not exchange.response_complete:
                exchange.disconnected = True
            exchange.wake()
        self._wake_writer()  # a send waiting for the peer to read returns (disconnected)
        # Break the reference cycles through this connection (its exchange's back reference, the scope's
        # authentication callback): freed by reference counting now, not at the daemon's next full
        # collection (master.service.gc_pacing: every 10 minutes), which a flood of short-lived
        # connections would otherwise pile up for.
        self._exchange = None
        self.scope = {}

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    async def writable(self) -> None:
        """Return once the transport takes more bytes (at once, unless the peer reads slowly)."""
        if self._drained is not None and not self._drained.done():
            await self._drained  # one request at a time: a single waiter

    def _wake_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- what the guard and the server call ----------------------------------------------------------------
    def close(self) -> None:
        """Close the connection (the guard's eviction or first-request timeout)."""
        if self.transport is not None:
            self.transport.close()

    def shutdown(self) -> None:
        """The server stops: close now when no request is in flight, else once it is answered."""
        if self._exchange is None or self._exchange.response_complete or not self._exchange.started:
            self.close()
        else:
            self._exchange.keep_alive = False

    # -- what the agent stream's upgrade calls ---------------------------------------------------------------
    def take_trailing(self) -> bytes:
        """The bytes that followed the request just parsed (the stream's first frames, when the agent sent
        them with its upgrade): h11 stops at the request's end and keeps them."""
        while True:
            event = self.conn.next_event()
            if event is h11.PAUSED or event is h11.NEED_DATA:
                break
        data, _ = self.conn.trailing_data
        return bytes(data)

    # -- HTTP ----------------------------------------------------------------------------------------------
    def _handle_events(self) -> None:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                log.debug("invalid HTTP request from %s: %s", self.client, exc)
                return self._bad_request()
            if event is h11.NEED_DATA:
                # A head or body under way has a deadline: one byte of a next request head on a kept-alive
                # connection, or a trickled body, holds the connection no longer than a first request.
                if self._deadline is None:
                    their = self.conn.their_state
                    if their is h11.SEND_BODY or (their is h11.IDLE and self.conn.trailing_data[0]):
                        self._arm_deadline()
                return
            if event is h11.PAUSED:  # a pipelined request, or an upgrade the app answered: after the reply
                return self._pause_reading()
            if isinstance(event, h11.Request):
                if self._request(event):
                    return  # the agent stream has the connection now
            elif isinstance(event, h11.Data):
                exchange = self._exchange
                if exchange is not None and self.conn.our_state is not h11.DONE:
                    exchange.body += event.data
                    if len(exchange.body) > HIGH_WATER_BYTES:
                        self._pause_reading()
                    exchange.wake()
            elif isinstance(event, h11.EndOfMessage):
                self._stop_deadline()  # the whole request arrived
                if self.conn.our_state is h11.DONE:  # answered before the body ended: next request
                    self._resume_reading()
                    self.conn.start_next_cycle()
                    continue
                exchange = self._exchange
                if exchange is not None:
                    exchange.more_body = False
                    exchange.wake()
                    if not exchange.started:  # a small body, held until complete: the app starts now
                        self._start(exchange)
                if self.conn.their_state is h11.MUST_CLOSE:
                    return
            else:  # h11.ConnectionClosed: the peer is done
                return

    def _request(self, event: h11.Request) -> bool:
        """Serve a request whose head arrived; True when the agent stream took the connection."""
        self._stop_deadline()  # the head arrived in time (its body, if any, gets a deadline of its own)
        self._stop_keep_alive()
        self.headers = list(event.headers)  # h11 gives names lower-case
        raw_path, _, query = event.target.partition(b"?")
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": event.http_version.decode("ascii"),
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": event.method.decode("ascii"),
            "root_path": "",
            "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "state": dict(self.context.state),
            AUTHENTICATED_SCOPE_KEY: self._authenticated,
        }
        # The agent stream is the only upgrade this master makes; any other request, Upgrade header or not,
        # goes to the app as a plain request (h11 then refuses the switch when the reply is not a 101).
        stream = self.context.stream
        if stream is not None and stream.wants(self):
            stream.upgrade(self)
            return True
        exchange = _Exchange(self, self.scope)
        self._exchange = exchange
        # A small body (a heartbeat, a login form) is read whole before the app starts: a client that
        # trickles it, or never finishes it, costs a buffer until its deadline, not an application call
        # in flight (tens of KiB each). Large, chunked or 100-continue bodies stream to the app as before.
        if not _small_body(event) or self.conn.they_are_waiting_for_100_continue:
            self._start(exchange)
        return False

    def _start(self, exchange: _Exchange) -> None:
        exchange.started = True
        task = asyncio.get_running_loop().create_task(exchange.run(self.context.app))
        self.context.tasks.add(task)
        task.add_done_callback(self.context.tasks.discard)

    def _bad_request(self) -> None:
        transport = self.transport
        assert transport is not None
        try:
            for part in (
                h11.Response(status_code=400, headers=_TEXT_HEADERS, reason=_PHRASES[400]),
                h11.Data(data=_BAD_REQUEST),
                h11.EndOfMessage(),
            ):
                transport.write(self.conn.send(part) or b"")
        except h11.LocalProtocolError:
            pass  # a response had started already: closing is all that is left
        transport.close()

    def response_complete(self) -> None:
        """The app's response is sent: wait for the next request for at most the keep-alive timeout, and
        serve one that was pipelined meanwhile."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        # The exchange, its scope and what the app put there (FastAPI's exit stack, the route) are the
        # app task's to hold now, not an idle connection's until its next request.
        self._exchange = None
        self.scope = {}
        self._stop_keep_alive()
        loop = asyncio.get_running_loop()
        self._keep_alive = loop.call_later(self.context.keep_alive_s, self._keep_alive_expired)
        self._resume_reading()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            self._handle_events()

    def _authenticated(self) -> None:
        self.guard.authenticated(self)

    def _arm_deadline(self) -> None:
        self._stop_deadline()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.guard.header_timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        self.guard.timed_out(self)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _keep_alive_expired(self) -> None:
        self._keep_alive = None
        self.close()

    def _stop_keep_alive(self) -> None:
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()


def _small_body(request: h11.Request) -> bool:
    """Whether ``request`` declares a body of 1 to :data:`HIGH_WATER_BYTES` bytes (``content-length``)."""
    for name, value in request.headers:
        if name == b"content-length":
            return value.isdigit() and 0 < int(value) <= HIGH_WATER_BYTES
    return False


class _Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of the app's call."""

    def __init__(self, connection: HttpConnection, scope: Scope) -> None:
        self.connection, self.scope, self.conn = connection, scope, connection.conn
        transport = connection.transport
        assert transport is not None
        self.transport = transport
        self.head = scope["method"] == "HEAD"
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.keep_alive = True
        self.response_started = False
        self.response_complete = False
        #: Whether the app was called (a small body is read whole first).
        self.started = False
        self.waiting_for_100_continue = self.conn.they_are_waiting_for_100_continue
        #: Something for ``receive`` came (:meth:`wake`); the future ``receive`` waits on, made only then
        #: (an exchange whose body trickles holds no event while it waits for it).
        self._woken = False
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """Something for ``receive``: body bytes, the body's end, the response's end or a disconnect."""
        self._woken = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next_wake(self) -> None:
        if not self._woken:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._woken = False

    async def run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            self.transport.close()  # the server's drain ran out of time
            raise
        except Exception as exc:
            method, path = self.scope["method"], self.scope["path"]
            if self.disconnected:  # the client went away (or missed a deadline) while the app read its body
                log.debug("%s %s: the client disconnected (%s)", method, path, type(exc).__name__)
                return
            log.error("the master failed to serve %s %s", method, path, exc_info=exc)
            if not self.response_started:
                await self._internal_error()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                log.error("the app returned no response to %s %s", self.scope["method"], self.scope["path"])
                await self._internal_error()
            elif not self.response_complete and not self.disconnected:
                self.transport.close()

    async def _internal_error(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _TEXT_HEADERS})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.waiting_for_100_continue = False
            continue_ = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            self.transport.write(self.conn.send(continue_) or b"")
        if not self.disconnected and not self.response_complete:
            self.connection._resume_reading()
            await self._next_wake()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Message) -> None:
        if not self.disconnected:
            await self.connection.writable()  # the peer reads slowly: the write buffer stays bounded
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self.response_started = True
            self.waiting_for_100_continue = False
            status = int(message["status"])
            headers = [(b"date", self.connection.context.date()), *message.get("headers", [])]
            response = h11.Response(status_code=status, headers=headers, reason=_PHRASES.get(status, b""))
            self.transport.write(self.conn.send(response) or b"")
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
            body = message.get("body", b"")
            if body and not self.head:  # h11 frames a reply to HEAD without a body
                self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            if not message.get("more_body", False):
                self.response_complete = True
                self.wake()
                self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} after the response completed")
        if self.response_complete:
            if self.conn.our_state is h11.MUST_CLOSE or not self.keep_alive:
                self.transport.close()
            else:
                self.connection.response_complete()
