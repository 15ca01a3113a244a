"""The wire of the protocol-level fake nodes (bench/fake_fleet.py): raw asyncio clients of the master, cheap
enough that thousands of nodes fit in a few processes.

- :class:`StreamConn`: one ``elastic-stream/1`` connection (docs/protocol.md): the HTTP/1.1 Upgrade of
  ``GET /v1/stream``, then newline-delimited JSON calls matched to their replies by id, any number pending.
- :class:`HttpConn`: one keep-alive HTTP/1.1 connection, one request at a time (the "before": agents
  without the stream hold three of them: main loop, heartbeat thread, watch thread).
- :class:`Link`: a node's way to the master, by op (``join``, ``round``, ``heartbeat``, ``watch``...) over
  either; on a dropped connection or a ``503`` it forgets the connection and tries the next master address,
  as the agent's client does. Over TLS when given a client context (masters serving https).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any
from urllib.parse import urlencode

from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STREAM_PATH,
    STREAM_ROUTES,
    STREAM_UPGRADE,
)

#: (method, path) of each op over plain HTTP: the stream's, and the status the bench reads.
ROUTES = {**STREAM_ROUTES, "status": ("GET", "/status")}
#: Over HTTP, which of the agent's three connections carries an op (heartbeat thread, watch thread, main).
HTTP_ROLE = {"heartbeat": "beat", "watch": "watch"}
Reply = tuple[int, Any]  # (HTTP status, decoded JSON body or None)


class WireError(ConnectionError):
    """The connection could not be made or was lost: the node retries, on the next master address."""


class Refused(WireError):
    """The upgrade was answered with an ordinary HTTP response (``status``, decoded ``body``)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"upgrade refused: {status} {body}")
        self.status, self.body = status, body


def _split_head(buf: bytes) -> tuple[int, int, bytes] | None:
    """``(status, content length, rest)`` of a complete response head at the start of ``buf``."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    return status, length, buf[end + 4 :]


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _connect(
    loop: asyncio.AbstractEventLoop, factory: type[_Conn], host: str, port: int, tls: ssl.SSLContext | None
) -> Any:
    """``loop.create_connection``, over TLS (verifying the certificate for ``host``) when ``tls``."""
    if tls is None:
        return loop.create_connection(factory, host, port)
    return loop.create_connection(factory, host, port, ssl=tls, server_hostname=host)


class _Conn(asyncio.Protocol):
    """What both connections share: the transport, the pending futures, failing them all on loss."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(WireError(f"connection lost: {exc or 'closed by the master'}"))

    def _fail(self, exc: Exception) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class StreamConn(_Conn):
    """One upgraded connection; :meth:`send` returns the future of a call's :data:`Reply`."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: asyncio.Future[None] = self.loop.create_future()
        self.upgraded = False
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.last_id = 0
        self.stray = 0  # id-0 replies (a frame the master could not read): a bug of ours

    @classmethod
    async def open(
        cls, host: str, port: int, head: bytes, timeout: float, tls: ssl.SSLContext | None = None
    ) -> StreamConn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(_connect(loop, cls, host, port, tls), timeout)
            conn.transport.write(head)
            await asyncio.wait_for(asyncio.shield(conn.opened), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            if isinstance(exc, WireError):
                raise
            raise WireError(f"{host}:{port}: {exc!r}") from exc
        return conn

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        if not self.upgraded:
            head = _split_head(buf)
            if head is None:
                self.buf = buf
                return
            status, length, rest = head
            if status != 101:
                if len(rest) < length:
                    self.buf = buf
                    return
                self._fail(Refused(status, _decode(rest[:length])))
                self.close()
                return
            self.upgraded = True
            self.opened.set_result(None)
            buf = rest
        *lines, self.buf = buf.split(b"\n")
        for line in lines:
            msg = _decode(line)
            if not isinstance(msg, dict):
                self.stray += 1
                continue
            fut = self.pending.pop(msg.get("id"), None)
            if fut is None:
                self.stray += 1
            elif not fut.done():
                fut.set_result((msg["status"], msg.get("body")))

    def _fail(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
            self.opened.exception()  # retrieved: whoever awaits it gets it, nobody else logs it
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def send(self, rest: bytes) -> asyncio.Future[Reply]:
        """Send ``{"id": N,`` + ``rest`` (the frame's other members and its closing brace: see
        :func:`frame_rest`); the reply's future."""
        if self.closed:
            raise WireError("connection closed")
        self.last_id += 1
        fut = self.loop.create_future()
        self.pending[self.last_id] = fut
        self.transport.write(b'{"id":%d,' % self.last_id + rest + b"\n")
        return fut


def frame_rest(op: str, secret: str | None = None, query: dict | None = None, body: Any = None) -> bytes:
    """A call frame without its leading ``{"id": N,``: built once for the frames a node repeats."""
    frame: dict[str, Any] = {"op": op}
    if secret is not None:
        frame["secret"] = secret
    if query is not None:
        frame["query"] = query
    if body is not None:
        frame["body"] = body
    return json.dumps(frame, separators=(",", ":")).encode()[1:]


class HttpConn(_Conn):
    """One keep-alive HTTP/1.1 connection; one request at a time (the caller sequences them)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: asyncio.Future[Reply] | None = None

    @classmethod
    async def open(cls, host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None) -> HttpConn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(_connect(loop, cls, host, port, tls), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise WireError(f"{host}:{port}: {exc!r}") from exc
        return conn

    def send(self, data: bytes) -> asyncio.Future[Reply]:
        """Send one whole request (:meth:`Link.encode`); the reply's future."""
        if self.closed:
            raise WireError("connection closed")
        self.waiting = self.loop.create_future()
        self.transport.write(data)
        return self.waiting

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head = _split_head(self.buf)
        if head is None:
            return
        status, length, rest = head
        if len(rest) < length:
            return
        self.buf = rest[length:]
        fut, self.waiting = self.waiting, None
        if fut is not None and not fut.done():
            fut.set_result((status, _decode(rest[:length])))

    def _fail(self, exc: Exception) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(exc)


#: Shortest time between two rounds of :meth:`Link.warm_others` of one node (the agent's client: 10 s).
WARM_RETRY_S = 10.0
#: How long a refused connection (nobody listens: a master that died) counts as the answer for every node of
#: this process. A real agent pays its own connect on its own machine; 10,000 fake nodes on the master's
#: two cores would otherwise spend more CPU than the master on connects that all fail alike.
REFUSED_MEMO_S = 0.1
_refused_at: dict[tuple[str, int], tuple[float, str]] = {}


class Link:
    """A node's calls to the master by op, over one stream (``stream=True``) or HTTP connections by role
    (the agent's three: main loop, heartbeat thread, watch thread). ``addresses``: ``host:port`` of every
    master; ``tls``: the client context (trusting the masters' CA) when they serve https."""

    def __init__(
        self,
        addresses: list[str],
        token: str,
        job: str,
        *,
        stream: bool,
        timeout: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.addresses = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in addresses]
        self.index = 0
        self.stream, self.timeout, self.tls = stream, timeout, tls
        self.auth = f"Authorization: Bearer {token}\r\n{JOB_HEADER}: {job}\r\n{PROTOCOL_HEADER}: "
        self.auth += f"{PROTOCOL_VERSION}\r\n"
        #: Open connections by (role, address index): over the stream, one to every master (the leader's
        #: and an idle one to each standby, as the agent keeps them).
        self.conns: dict[tuple[str, int], StreamConn | HttpConn] = {}
        self._opening: dict[tuple[str, int], asyncio.Future] = {}
        self.opened = 0  # connections made in all (a reconnect after a failover counts again)
        self._warmed = float("-inf")  # when warm_others last ran
        self._warming: set[asyncio.Task] = set()
        self._closed = False

    def _key(self, role: str, index: int | None = None) -> tuple[str, int]:
        return role, self.index % len(self.addresses) if index is None else index

    def drop(self, role: str, conn: StreamConn | HttpConn) -> None:
        """Forget ``conn`` and move on to the next address if it was the current one (once: several calls
        may fail with it)."""
        for key, held in list(self.conns.items()):
            if held is conn:
                del self.conns[key]
                if key[1] == self.index % len(self.addresses):
                    self.index += 1
        conn.close()

    def skip(self, role: str, conn: StreamConn | HttpConn) -> None:
        """``conn``'s master answered 503 (a standby): move on to the next address. A stream stays open,
        as the agent keeps it (the way in when that master leads); an HTTP connection is dropped."""
        if not self.stream:
            return self.drop(role, conn)
        if self.conns.get(self._key(role)) is conn:
            self.index += 1

    def close(self) -> None:
        self._closed = True
        for task in self._warming:
            task.cancel()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    async def conn(self, role: str, index: int | None = None) -> StreamConn | HttpConn:
        """The open connection of ``role`` (all ops share ``stream``) to the current address (or to
        ``addresses[index]``), opened once even if several calls wait for it."""
        key = self._key(role, index)
        conn = self.conns.get(key)
        if conn is not None and not conn.closed:
            return conn
        if key in self._opening:
            return await asyncio.shield(self._opening[key])
        host, port = self.addresses[key[1]]
        refused = _refused_at.get((host, port))
        if refused is not None and time.monotonic() - refused[0] < REFUSED_MEMO_S:
            if index is None:
                self.index += 1
            raise WireError(refused[1])  # a new one: a re-raised exception would grow its traceback
        fut = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            if self.stream:
                head = f"GET {STREAM_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: Upgrade\r\n"
                head += f"Upgrade: {STREAM_UPGRADE}\r\n{self.auth}\r\n"
                conn = await StreamConn.open(host, port, head.encode(), self.timeout, self.tls)
            else:
                conn = await HttpConn.open(host, port, self.timeout, self.tls)
        except WireError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                _refused_at[host, port] = (time.monotonic(), str(exc))
            if index is None:
                self.index += 1
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self._opening.pop(key, None)
        self.opened += 1
        self.conns[key] = conn
        fut.set_result(conn)
        return conn

    def warm_others(self) -> None:
        """The current master answered: open an idle stream to every other address that has none (each
        at most every :data:`WARM_RETRY_S`), as the agent's client does."""
        now = time.monotonic()
        if not self.stream or self._closed or now - self._warmed < WARM_RETRY_S:
            return
        self._warmed = now
        current = self.index % len(self.addresses)
        for i in range(len(self.addresses)):
            held = self.conns.get(("stream", i))
            if i != current and (held is None or held.closed):
                task = asyncio.get_running_loop().create_task(self._warm(i))
                self._warming.add(task)
                task.add_done_callback(self._warming.discard)

    async def _warm(self, index: int) -> None:
        try:
            conn = await self.conn("stream", index)
        except WireError:
            return  # tried again later
        if self._closed:
            conn.close()

    def role(self, op: str) -> str:
        return "stream" if self.stream else HTTP_ROLE.get(op, "main")

    def ready(self, op: str) -> StreamConn | HttpConn | None:
        """The open connection ``op`` goes on, if there is one (the synchronous fast path of heartbeats)."""
        conn = self.conns.get(self._key(self.role(op)))
        return None if conn is None or conn.closed else conn

    def encode(
        self, op: str, secret: str | None = None, query: dict | None = None, body: Any = None
    ) -> bytes:
        """What :meth:`StreamConn.send` or :meth:`HttpConn.send` takes for this call (built once for the
        calls a node repeats)."""
        if self.stream:
            return frame_rest(op, secret, query, body)
        method, path = ROUTES[op]
        target = f"{API_PREFIX}{path}" + (f"?{urlencode(query)}" if query else "")
        data = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
        extra = f"{NODE_SECRET_HEADER}: {secret}\r\n" if secret else ""
        if body is not None:
            extra += "Content-Type: application/json\r\n"
        head = f"{method} {target} HTTP/1.1\r\nHost: master\r\n{self.auth}{extra}"
        head += f"Content-Length: {len(data)}\r\n\r\n"
        return head.encode() + data

    async def call(
        self,
        op: str,
        secret: str | None = None,
        query: dict | None = None,
        body: Any = None,
        encoded: bytes = b"",
        tried: int = 0,
    ) -> Reply:
        """One call, tried on each master address in turn (as the agent's client does): a connection that
        cannot be made or is lost, or a ``503`` (a standby), moves on to the next address. ``encoded``:
        :meth:`encode`'s bytes, prebuilt; ``tried``: addresses this call was already sent to (the next
        ones are tried, each once). Raises :class:`WireError` when no address answered; the last 503
        is returned."""
        role = self.role(op)
        data = encoded or self.encode(op, secret, query, body)
        last: WireError | Reply = WireError("no master address")
        for _ in range(len(self.addresses) - tried):
            try:
                conn = await self.conn(role)
            except Refused as exc:
                if exc.status != 503:
                    return exc.status, exc.body  # 401, 409, 429...: the master's answer to this node
                last = (exc.status, exc.body)
                continue
            except WireError as exc:
                last = exc
                continue
            try:
                reply = await conn.send(data)
            except WireError as exc:
                self.drop(role, conn)
                last = exc
                continue
            if reply[0] != 503:
                self.warm_others()
                return reply
            self.skip(role, conn)  # a standby, or a master stepping down
            last = reply
        if isinstance(last, WireError):
            raise last
        return last
