"""The agent stream, master side: one connection per agent that carries the node API's calls (info, join,
round, heartbeat, watch, leave) as newline-delimited JSON frames, multiplexed (docs/protocol.md, "The
agent stream").

An agent opens it with ``GET /v1/stream`` and ``Connection: Upgrade``, ``Upgrade: elastic-stream/1``
(RFC 9110 §7.8). The master's HTTP connection (master.http.connection.HttpConnection) hands such a
request to :meth:`StreamEndpoint.upgrade`, which checks it by the gate's own rule
(master.http.gatekeeper.check_access: 401, 429, 409, each a whole HTTP response that closes the
connection), refuses it 503 ``not_leader`` on a master that does not lead, and otherwise answers ``101
Switching Protocols`` and gives the connection to a :class:`StreamConnection`. No web framework is on
this path: a heartbeat is decoded, validated, applied and answered inline in the read callback (a task
only when the store must be waited for); long-polls and the other calls run as tasks and are answered
when done, in any order (the reply carries the call's id).

Every call answers as its HTTP route does (master.service.api_ops holds the logic of both): the same status,
the same :class:`~elastic.control.protocol.ErrorBody` codes, 422 ``invalid_request`` naming the field, and the
reply as :func:`master.http.wire_compat.for_client` gives it for the revision the upgrade's
``X-Elastic-Protocol`` named. When the connection closes, its pending calls are cancelled, and each pending
round or watch long-poll is
a closed connection of its node, as a disconnected HTTP long-poll is (Job.connection_lost)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    PROTOCOL_HEADER,
    STREAM_MAX_FRAME_BYTES,
    STREAM_MAX_PENDING,
    STREAM_PATH,
    STREAM_UPGRADE,
    ErrorBody,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
)
from master.http.conn_guard import ConnectionGuard, release_transport
from master.http.errors import ApiError, http_status
from master.http.gatekeeper import TokenCheck, check_access, http_response, refusal_response
from master.http.rate_limits import PeerFailureLimiter
from master.http.wire_compat import for_client, revision
from master.job.errors import JobError
from master.service import api_ops
from master.service.overload import retry_after
from master.service.service import MasterService

log = logging.getLogger(__name__)

_UPGRADE = STREAM_UPGRADE.encode()
_PROTOCOL_HEADER = PROTOCOL_HEADER.lower().encode()
SWITCHING = b"HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: " + _UPGRADE + b"\r\n\r\n"


def _error(code: str, message: str) -> bytes:
    return ErrorBody(error=code, message=message).model_dump_json().encode()


class UpgradingConnection(Protocol):
    """What the stream needs of the HTTP connection that asks for it (master.http.connection.HttpConnection):
    the parsed request, the bytes read past it, the transport and the guard that counts the connection."""

    scope: Any
    headers: list[tuple[bytes, bytes]]  # names lower-cased
    transport: asyncio.Transport | None
    client: tuple[str, int] | None
    server: tuple[str, int] | None
    guard: ConnectionGuard

    def take_trailing(self) -> bytes:
        """The bytes that followed the request (the stream's first frames, if any)."""
        ...

    def close(self) -> None: ...

    def shutdown(self) -> None: ...


class StreamEndpoint:
    """What every stream connection of one master shares: the service, the gate's token and its per-address
    count of wrong tokens (the same :class:`PeerFailureLimiter` as the HTTP gate's)."""

    def __init__(self, service: MasterService, token: TokenCheck, failures: PeerFailureLimiter) -> None:
        self.service, self.token, self.failures = service, token, failures
        self.job_id = service.settings.job.job_id
        self.max_pending, self.max_frame = STREAM_MAX_PENDING, STREAM_MAX_FRAME_BYTES
        #: The last heartbeat reply encoded per protocol revision, with its bytes (_dump_command).
        self.dumped: dict[int, tuple[BaseModel, bytes]] = {}
        # The answer to a heartbeat shed under overload (master.service.overload): the agent beats again
        # after retry_after_s.
        job = service.settings.job
        wait = retry_after(job.heartbeat_interval_s, job.heartbeat_timeout_s)
        message = "the master is overloaded and shed this heartbeat (its node counts as heard); "
        message += f"beat again in {wait:g}s"
        self.shed_reply = json.dumps(
            {"error": ErrorCode.BUSY.value, "message": message, "retry_after_s": wait}, separators=(",", ":")
        ).encode()

    def wants(self, protocol: UpgradingConnection) -> bool:
        """Whether the request ``protocol`` just parsed asks for the stream: ``GET /v1/stream`` with
        ``Connection: Upgrade``, ``Upgrade: elastic-stream/1`` and no body, on the API listener (the metrics
        listener serves ``/metrics`` only). Any other request, upgrade or not, goes to the app as usual."""
        scope = protocol.scope
        if scope["method"] != "GET" or scope["path"] != STREAM_PATH:
            return False
        port = self.service.settings.metrics_port
        if port is not None and (protocol.server or (None, None))[1] == port:
            return False
        upgrade, connection = b"", False
        for name, value in protocol.headers:  # names lower-cased by h11
            if name == b"upgrade":
                upgrade = value.strip().lower()
            elif name == b"connection":
                connection = connection or b"upgrade" in (t.strip().lower() for t in value.split(b","))
            elif name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
                return False  # a body: not an upgrade we make (the route answers 426)
        return connection and upgrade == _UPGRADE

    def upgrade(self, protocol: UpgradingConnection) -> None:
        """Answer the upgrade ``protocol`` parsed (:meth:`wants`): a refusal that closes the connection, or
        101 and a :class:`StreamConnection` from then on, fed the bytes h11 had read past the request."""
        transport = protocol.transport
        assert transport is not None
        trailing = protocol.take_trailing()
        headers = dict(protocol.headers)
        peer = (protocol.client or ("",))[0]
        refusal = check_access(headers, peer, self.token, self.job_id, self.failures)
        if refusal is not None:
            transport.write(refusal_response(refusal))
            transport.close()
            return
        if self.service.stopping:
            message = f"master {self.service.master_id} is shutting down; ask another master"
            transport.write(http_response(503, _error(ErrorCode.NOT_LEADER, message)))
            transport.close()
            return
        # A standby accepts the stream too (its calls answer 503 not_leader until it leads): agents keep an
        # idle stream to every master, so that a takeover meets no reconnect storm (docs/protocol.md).
        transport.write(SWITCHING)
        client_revision = revision(headers.get(_PROTOCOL_HEADER, b"").decode(errors="replace"))
        stream = StreamConnection(self, transport, client_revision, protocol.guard)
        protocol.guard.hand_over(protocol, stream)  # counted once, under the cap, shut down with the server
        transport.set_protocol(stream)
        if trailing:
            stream.data_received(trailing)


@dataclass
class _Pending:
    """A call served by a task; a long-poll names its node (see :meth:`StreamConnection.connection_lost`)."""

    task: asyncio.Task
    node_id: str | None = None
    secret: str | None = None


class StreamConnection(asyncio.Protocol):
    """One agent's stream after the upgrade: reads frames, serves calls, writes replies. Stays counted by
    the connection guard (master.http.conn_guard) until :meth:`connection_lost`; never closed as idle."""

    def __init__(
        self,
        endpoint: StreamEndpoint,
        transport: asyncio.Transport,
        client_revision: int,
        guard: ConnectionGuard,
    ) -> None:
        self.endpoint, self.service = endpoint, endpoint.service
        self.transport, self.revision = transport, client_revision
        self._guard = guard
        self._buffer = b""
        self._pending: dict[int, _Pending] = {}
        self._closing = False  # the server shuts down: close once the pending calls are answered
        self._lost = False
        self._ops: dict[str, Callable[[int, str | None, dict, Any], None]] = {
            "info": self._info,
            "join": self._join,
            "round": self._round,
            "heartbeat": self._heartbeat,
            "watch": self._watch,
            "leave": self._leave,
        }

    # -- the transport's callbacks -------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._buffer:
            data, self._buffer = self._buffer + data, b""
        lines = data.split(b"\n")
        rest = lines.pop()  # what follows the last newline: the start of a frame still coming
        for line in lines:
            if self._lost or self.transport.is_closing():
                return
            if len(line) > self.endpoint.max_frame:
                return self._too_large()
            self._call(line)
        if len(rest) > self.endpoint.max_frame:
            return self._too_large()
        self._buffer = rest

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call.task.cancel()
            if call.node_id is not None:  # a long-poll whose client went away, as over HTTP
                api_ops.lost(self.service, call.node_id, call.secret)
        self._guard.release(self)
        release_transport(self.transport)  # its own cycle (conn_guard.release_transport says why)

    def pause_writing(self) -> None:
        # The peer reads no replies: read no more calls until it does (the write buffer stays bounded).
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def close(self) -> None:
        """Close the stream now."""
        self.transport.close()

    def shutdown(self) -> None:
        """The server shuts down (master.http.serving calls this on each connection): close once every
        pending call is answered (after the step-down, long-polls answer 503 ``not_leader`` at once)."""
        self._closing = True
        if not self._pending:
            self.transport.close()

    # -- frames --------------------------------------------------------------------------------------------
    def _send(self, call_id: int, status: int, body: bytes) -> None:
        if not self._lost:
            self.transport.write(b'{"id":%d,"status":%d,"body":%b}\n' % (call_id, status, body))

    def _refuse(self, call_id: int, status: int, code: str, message: str) -> None:
        self._send(call_id, status, _error(code, message))

    def _too_large(self) -> None:
        message = f"frame exceeds {self.endpoint.max_frame} bytes; closing the stream"
        self._refuse(0, 413, ErrorCode.BODY_TOO_LARGE, message)
        self.transport.close()

    def _call(self, line: bytes) -> None:
        try:
            frame = json.loads(line)
        except ValueError as exc:  # UnicodeDecodeError included
            return self._refuse(0, 422, ErrorCode.INVALID_REQUEST, f"frame is not valid JSON: {exc}")
        except RecursionError:  # nesting deeper than the parser's recursion limit: refused, not a crash
            message = "frame is not valid JSON: nested too deeply"
            return self._refuse(0, 422, ErrorCode.INVALID_REQUEST, message)
        call_id = frame.get("id") if type(frame) is dict else None
        if type(call_id) is not int or call_id < 1:
            message = 'a frame is a JSON object with an integer "id" of at least 1'
            return self._refuse(0, 422, ErrorCode.INVALID_REQUEST, message)
        if call_id in self._pending:
            message = f"call id {call_id} is already pending on this stream"
            return self._refuse(0, 422, ErrorCode.INVALID_REQUEST, message)
        name = frame.get("op")
        op = self._ops.get(name) if type(name) is str else None
        if op is None:
            message = f"no operation {repr(name)[:80]}; the stream's are {', '.join(self._ops)}"
            return self._refuse(call_id, 404, ErrorCode.NOT_FOUND, message)
        if self._closing:
            message = f"master {self.service.master_id} is shutting down; ask another master"
            return self._refuse(call_id, 503, ErrorCode.NOT_LEADER, message)
        if len(self._pending) >= self.endpoint.max_pending:
            message = f"{self.endpoint.max_pending} calls are pending on this stream; retry later"
            return self._refuse(call_id, 429, ErrorCode.BUSY, message)
        try:
            secret, query = frame.get("secret"), frame.get("query")
            if secret is not None and type(secret) is not str:
                raise _invalid("secret: Input should be a valid string")
            if query is not None and type(query) is not dict:
                raise _invalid("query: Input should be a valid dictionary")
            op(call_id, secret, query or {}, frame.get("body"))
        except Exception as exc:  # each error becomes the call's reply (_error_reply)
            self._send(call_id, *self._error_reply(exc))

    def _error_reply(self, exc: Exception) -> tuple[int, bytes]:
        """The status and error body an exception of a call is answered with: as the HTTP route's."""
        if isinstance(exc, JobError):
            return http_status(exc), _error(exc.code, str(exc))
        if isinstance(exc, ApiError):
            return exc.status, _error(exc.code, exc.message)
        log.error("stream call failed", exc_info=exc)  # a bug: HTTP would answer 500 too
        return 500, _error(
            ErrorCode.INTERNAL_ERROR, f"the master failed to serve the call: {type(exc).__name__}"
        )

    def _dump(self, reply: BaseModel) -> bytes:
        out = for_client(reply, self.revision)
        return out.model_dump_json().encode() if isinstance(out, BaseModel) else bytes(out.body)

    def _dump_command(self, reply: BaseModel) -> bytes:
        """:meth:`_dump` of a heartbeat's reply. Replies are frozen and the job shares one per (command,
        round, term) among its nodes: the bytes of the last one per protocol revision are kept (with the
        reply itself, so that its id is not reused), and a steady heartbeat encodes nothing."""
        cache = self.endpoint.dumped
        held = cache.get(self.revision)
        if held is not None and held[0] is reply:
            return held[1]
        data = self._dump(reply)
        cache[self.revision] = (reply, data)
        return data

    def _spawn(
        self,
        call_id: int,
        serve: Callable[[], Awaitable[BaseModel]],
        node_id: str | None = None,
        secret: str | None = None,
    ) -> None:
        """Serve a call in a task, answered when it completes; ``node_id`` for a long-poll."""
        task = asyncio.get_running_loop().create_task(self._serve(call_id, serve))
        self._pending[call_id] = _Pending(task, node_id, secret)

    async def _serve(self, call_id: int, serve: Callable[[], Awaitable[BaseModel]]) -> None:
        try:
            status, body = 200, self._dump(await serve())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # each error becomes the call's reply
            status, body = self._error_reply(exc)
        self._pending.pop(call_id, None)
        self._send(call_id, status, body)
        if self._closing and not self._pending:
            self.transport.close()

    # -- the operations (the same names, validation and replies as the HTTP routes) ------------------------
    def _info(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        self._spawn(call_id, lambda: api_ops.info(self.service))

    def _join(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        req = _validate(JoinRequest, body)
        self._spawn(call_id, lambda: api_ops.join(self.service, req, secret))

    def _round(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        q = _validate(api_ops.RoundQuery, query, "query")
        self._spawn(call_id, lambda: api_ops.next_round(self.service, q, secret), q.node_id, secret)

    def _heartbeat(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        service = self.service
        if service.holds_calls():  # a standby: held until it leads, or briefly (master.service.waiting)
            req = _validate(HeartbeatRequest, body)
            return self._spawn(call_id, lambda: api_ops.heartbeat(service, req, secret))
        if not service.admission.admit():  # over this loop pass's budget: shed (master.service.overload)
            return self._shed(call_id, secret, body)
        req = _validate(HeartbeatRequest, body)
        reply = api_ops.beat(service, req, secret)
        if service.holds_current_state():  # the steady case: answered here, no task
            self._send(call_id, 200, self._dump_command(reply))
        else:  # write-ahead: the reply waits until the store holds what it may reveal
            self._spawn(call_id, lambda: api_ops.stored(service, reply))

    def _shed(self, call_id: int, secret: str | None, body: Any) -> None:
        """Answer a heartbeat the master has no time for now ``429 busy`` with ``retry_after_s``, having
        counted it as a sign of life of its node when it carries the node's secret (liveness judged against
        receipt: master.service.overload); nothing else of it is read."""
        node_id = body.get("node_id") if type(body) is dict else None
        if type(node_id) is str and type(secret) is str:
            self.service.heard(node_id, secret)
        self._send(call_id, 429, self.endpoint.shed_reply)

    def _watch(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        q = _validate(api_ops.WatchQuery, query, "query")
        self._spawn(call_id, lambda: api_ops.watch(self.service, q, secret), q.node_id, secret)

    def _leave(self, call_id: int, secret: str | None, query: dict, body: Any) -> None:
        req = _validate(LeaveRequest, body)
        self._spawn(call_id, lambda: api_ops.leave(self.service, req, secret))


def _invalid(message: str) -> ApiError:
    """The 422 ``invalid_request`` of a call; ``message`` names the field."""
    return ApiError(422, ErrorCode.INVALID_REQUEST, message)


def _validate(model: type[Any], data: Any, where: str = "") -> Any:
    """``data`` as ``model``, or a 422 naming the fields as the HTTP routes' 422 does."""
    if data is None and not where:
        raise _invalid("body: Field required")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(api_ops.describe_errors(exc.errors(), where)) from None
