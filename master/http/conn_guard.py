"""The master's guard against running out of file descriptors and against slow or hostile clients
(docs/operations.md, "Open files and connections"; docs/security.md, "Slow and hostile clients"):

- :func:`raise_open_file_limit`: at start, the soft ``RLIMIT_NOFILE`` goes up to the hard limit.
- A connection cap, :func:`connection_cap` (the soft limit less :data:`RESERVED_FDS`): a connection beyond
  it first evicts the oldest connection that has not presented a valid token yet (nor finished the agent
  stream's upgrade), whatever it is doing; when every connection is authenticated, the new one is answered
  ``503 busy`` and closed at once (agents retry 5xx), so connections never pile up unaccepted.
- A per-address cap on unauthenticated connections (``--max-unauthenticated-per-address``, default
  :data:`DEFAULT_UNAUTHENTICATED_PER_ADDRESS`): one more from an address that holds that many is answered
  ``503 busy``. Authenticated connections (an agent's stream, a request with the job's token, a signed-in
  status page) are never counted per address: many agents behind one NAT share an address.
- A cap on unauthenticated connections from all addresses together (``--max-unauthenticated``, default
  :data:`DEFAULT_MAX_UNAUTHENTICATED`): a new connection beyond it closes the oldest of them, as at the
  connection cap. What connections without the token cost the master is bounded by it, however many
  addresses they come from (an IPv6 prefix is billions); authenticated connections are never counted.
- Deadlines (kept by master.http.connection): every request head must be complete within
  ``header_timeout_s`` of its first byte (of the connection's opening, for the first request), and every
  request body within ``header_timeout_s`` of its head; a connection that misses one is closed. Between two
  requests the keep-alive timeout applies; a request in flight (a long-poll, whose head and body arrived) is
  never cut. Under TLS the handshake, before any request, gets the same time (``ssl_handshake_timeout`` of
  the listener, master.http.serving; asyncio's default is 60 s).
- Out-of-descriptor errors (``accept()`` failing with EMFILE, an application error with EMFILE) are logged
  at most once per :data:`master.http.rate_limits.LOG_INTERVAL_S`, with the count of suppressed ones.

:class:`ConnectionGuard` holds the caps; the master's own connection protocol
(master.http.connection.HttpConnection) calls it when a connection is made, when a request proves the token
(:func:`mark_authenticated`, through the request's scope), when a deadline passes and when it closes. An
agent stream (master.http.stream) takes its connection's place (:meth:`ConnectionGuard.hand_over`): it
stays counted (and under the cap) until it closes, authenticated, and is never closed as idle."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import ErrorBody
from master.http.rate_limits import LogLimiter
from master.service.settings import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_UNAUTHENTICATED_PER_ADDRESS,
)

log = logging.getLogger(__name__)

#: Descriptors kept out of the connection cap for the master itself: listeners, the store's connections,
#: log files, the event loop.
RESERVED_FDS = 64
#: The kernel's queue of connections waiting to be accepted (``listen()``), as :func:`bind_socket` sets it.
LISTEN_BACKLOG = 2048
#: asyncio accepts up to its ``backlog`` connections per wake-up, each holding a descriptor until its
#: protocol is made (two loop turns later) and admits or refuses it: that many accepts, on two listeners
#: (API and metrics), are also kept out of the cap.
ACCEPTS_IN_FLIGHT = 4
#: The smallest cap, whatever the limit (a master must answer a few agents to be of any use).
MIN_CONNECTIONS = 16
#: Connections one agent holds to the master: its stream (master.http.stream) carries every call.
CONNECTIONS_PER_AGENT = 1
#: Below this hard open-file limit the start-up line is a warning that says how few agents fit.
LOW_FD_LIMIT = 4096
#: Used when the hard limit is unlimited (Linux refuses more than ``fs.nr_open``, 1048576 by default).
UNLIMITED_TARGET = 1 << 20
#: errno values that mean "out of descriptors or kernel memory": logged by :func:`resource_exhausted`.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
DOCS_HINT = "docs/operations.md, 'Open files and connections'"
#: The request scope's key whose value, called, marks the request's connection authenticated
#: (:func:`mark_authenticated`); set by master.http.connection.
AUTHENTICATED_SCOPE_KEY = "elastic.authenticated"


def release_transport(transport: asyncio.BaseTransport | None) -> None:
    """Break the reference cycle a closed asyncio socket transport keeps with itself before Python 3.12
    (CPython gh-100348: it stores its own bound read callback, ``_read_ready_cb``; 3.12's ``close()`` drops
    it). Called from a protocol's ``connection_lost``, after which the transport reads nothing more.

    Why it matters here: a connection lives seconds, so its transport is in the oldest generation by the
    time it closes, and the daemon collects that generation only every 10 minutes
    (master.service.gc_pacing). A flood of short connections (20,000 slots reconnecting for a minute) left
    every transport it ever had, ~2.5 KiB each with its socket and dicts, until then: most of the master's
    RSS growth under bench/slow_clients.py. Freed by reference counting now."""
    # The one private attribute this project touches: CPython's own, probed first, so that where it is gone
    # (3.12+, or another event loop) this is a no-op; tests/integration/test_conn_guard.py measures it.
    if sys.version_info < (3, 12) and getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None  # type: ignore[union-attr]  # probed just above


def mark_authenticated(scope: Any) -> None:
    """The request of ``scope`` presented the job's token (or a valid status-page session): its
    connection is no longer evicted first nor counted against its address (a no-op outside this master's
    own listener, e.g. under a test client)."""
    mark = scope.get(AUTHENTICATED_SCOPE_KEY)
    if mark is not None:
        mark()


@dataclass(frozen=True)
class FileLimit:
    """The open-file limits after :func:`raise_open_file_limit` (``before``: the soft limit found)."""

    soft: int
    hard: int
    before: int


def raise_open_file_limit() -> FileLimit:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (an unprivileged process may); the
    limits as they are then. A refusal leaves the soft limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
            return FileLimit(soft, hard, soft)
        return FileLimit(target, hard, soft)
    return FileLimit(soft, hard, soft)


def accept_batch(soft_limit: int) -> int:
    """Connections asyncio accepts per wake-up of a listener: 1/32 of the open-file limit, 16 to 2048."""
    return min(LISTEN_BACKLOG, max(16, soft_limit // 32))


def connection_cap(soft_limit: int) -> int:
    """The connections a master with this soft open-file limit serves at once: the limit less
    :data:`RESERVED_FDS` and :data:`ACCEPTS_IN_FLIGHT` accept batches, at least :data:`MIN_CONNECTIONS`."""
    return max(soft_limit - RESERVED_FDS - ACCEPTS_IN_FLIGHT * accept_batch(soft_limit), MIN_CONNECTIONS)


def resolve_cap(limit: FileLimit, max_connections: int | None) -> int:
    """The cap to serve with (``--max-connections`` when given, at most what the descriptors allow), after
    logging the limits once: a warning, with the way out, when they hold few agents."""
    allowed = connection_cap(limit.soft)
    cap = allowed if max_connections is None else min(max_connections, allowed)
    if max_connections is not None and max_connections > allowed:
        log.warning(
            "--max-connections %d exceeds what %d open files allow; serving at most %d (%s)",
            max_connections,
            limit.soft,
            allowed,
            DOCS_HINT,
        )
    agents = cap // CONNECTIONS_PER_AGENT
    raised = f" (raised from {limit.before})" if limit.soft != limit.before else ""
    if limit.hard < LOW_FD_LIMIT:
        log.warning(
            "open-file limit %d%s, hard limit %d: at most %d connections, about %d agents; raise the hard "
            "limit (LimitNOFILE= for systemd, --ulimit nofile= for containers; %s)",
            limit.soft,
            raised,
            limit.hard,
            cap,
            agents,
            DOCS_HINT,
        )
    else:
        log.info(
            "open-file limit %d%s: at most %d connections, about %d agents", limit.soft, raised, cap, agents
        )
    return cap


def fleet_warning(cap: int, min_nodes: int, max_nodes: int) -> str | None:
    """What to tell an operator whose job's ``--nnodes`` holds more agents than ``cap`` connections do;
    None when it fits. Agents beyond the cap are refused (503 busy), so the master never hears them and
    declares them dead: a round of ``min_nodes`` never forms, and one of ``max_nodes`` never grows past
    the cap."""
    agents = cap // CONNECTIONS_PER_AGENT
    if max_nodes <= agents:
        return None
    what = "the job cannot form" if min_nodes > agents else f"nodes beyond {agents} are refused"
    return (
        f"--nnodes {min_nodes}:{max_nodes} exceeds the {agents} agents this master can serve at once "
        f"({cap} connections): {what}, and refused nodes are declared dead; raise the open-file limit "
        f"(ulimit -n, LimitNOFILE= for systemd, --ulimit nofile= for containers; {DOCS_HINT})"
    )


def _busy_reply(message: str) -> bytes:
    body = ErrorBody(error=ErrorCode.BUSY, message=message).model_dump_json()
    return (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}"
    ).encode()


class GuardedConnection(Protocol):
    """What the guard needs of a connection it counts: an HTTP connection (master.http.connection) or an
    agent stream after its upgrade (master.http.stream)."""

    def close(self) -> None:
        """Close the connection now (evicted, or no request in time)."""

    def shutdown(self) -> None:
        """The server stops: close once what is in flight is answered."""


class ConnectionGuard:
    """The state shared by a server's connections: the connections served now (under the cap), the
    deadlines' length, and the connections not authenticated yet, oldest first, with their count per
    address (at most ``per_address``) and in all (at most ``max_unauthenticated``)."""

    def __init__(
        self,
        cap: int,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        per_address: int = DEFAULT_UNAUTHENTICATED_PER_ADDRESS,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
    ) -> None:
        self.cap, self.header_timeout_s, self.per_address = cap, header_timeout_s, per_address
        self.max_unauthenticated = max_unauthenticated
        #: Every connection served now, an agent stream included (the server shuts each down).
        self.connections: set[GuardedConnection] = set()
        #: Connections that have not presented a valid token, oldest first, with their peer's address.
        self._unauthenticated: OrderedDict[GuardedConnection, str] = OrderedDict()
        self._by_address: dict[str, int] = {}
        self._busy = _busy_reply(f"the master serves its maximum of {cap} connections; retry later")
        self._busy_address = _busy_reply(
            f"this address holds {per_address} connections that presented no valid token yet "
            "(--max-unauthenticated-per-address); retry later"
        )
        self._log_limiter = LogLimiter()
        self._emptied: asyncio.Future[None] | None = None
        #: How many connections the guard closed, by reason (``/metrics``).
        self.closed: dict[str, int] = {"evicted": 0, "refused": 0, "timed_out": 0}

    @property
    def open(self) -> int:
        """Connections served now (``/metrics``)."""
        return len(self.connections)

    @property
    def unauthenticated(self) -> int:
        """Connections that have not presented a valid token yet (``/metrics``)."""
        return len(self._unauthenticated)

    def admit(self, connection: GuardedConnection, peer: str = "") -> bool:
        """Whether a new connection from address ``peer`` may be served: its address holds fewer than
        ``per_address`` unauthenticated connections, and the server is under the cap and under
        ``max_unauthenticated``, or the oldest unauthenticated connection is closed to make room. Otherwise
        it is to be answered 503 ``busy`` (:meth:`refuse`)."""
        if self._by_address.get(peer, 0) >= self.per_address:
            self.closed["refused"] += 1
            self._note(
                f"answered 503 busy a connection from {peer}, which holds {self.per_address} "
                "unauthenticated connections (--max-unauthenticated-per-address)"
            )
            return False
        if len(self._unauthenticated) >= self.max_unauthenticated:
            self._evict_oldest(
                f"{self.max_unauthenticated} connections had presented no valid token (--max-unauthenticated)"
            )
            return True
        if len(self.connections) < self.cap:
            return True
        if self._unauthenticated:
            self._evict_oldest("at the connection cap")
            return True
        self.closed["refused"] += 1
        self._note("answered a new connection 503 busy")
        return False

    def refuse(self, transport: asyncio.BaseTransport, peer: str = "") -> None:
        """Answer a connection from ``peer`` that :meth:`admit` refused 503 ``busy`` and close it (never
        counted)."""
        if isinstance(transport, asyncio.WriteTransport):
            at_address_cap = self._by_address.get(peer, 0) >= self.per_address
            transport.write(self._busy_address if at_address_cap else self._busy)
        transport.close()

    def opened(self, connection: GuardedConnection, peer: str = "") -> None:
        """Count an admitted connection from ``peer``: unauthenticated until :meth:`authenticated`."""
        self.connections.add(connection)
        self._unauthenticated[connection] = peer
        self._by_address[peer] = self._by_address.get(peer, 0) + 1

    def authenticated(self, connection: GuardedConnection) -> None:
        """``connection`` presented the job's token: never evicted first, not counted per address."""
        self._forget(connection)

    def timed_out(self, connection: GuardedConnection) -> None:
        """A deadline of ``connection`` (a request head or body not complete in time) passed: close it."""
        self.closed["timed_out"] += 1
        connection.close()

    def hand_over(self, old: GuardedConnection, new: GuardedConnection) -> None:
        """``new`` serves the connection ``old`` served (the agent stream's upgrade, which checked the
        token): counted once, authenticated."""
        self._forget(old)
        self.connections.discard(old)
        self.connections.add(new)

    def release(self, connection: GuardedConnection) -> None:
        """``connection`` closed: no longer counted."""
        self._forget(connection)
        self.connections.discard(connection)
        if not self.connections and self._emptied is not None and not self._emptied.done():
            self._emptied.set_result(None)

    async def all_closed(self) -> None:
        """Return once no connection is open (the server's drain)."""
        while self.connections:
            self._emptied = asyncio.get_running_loop().create_future()
            await self._emptied

    def _evict_oldest(self, why: str) -> None:
        oldest = next(iter(self._unauthenticated))
        self._forget(oldest)
        oldest.close()
        self.closed["evicted"] += 1
        self._note(f"evicted the oldest connection that had presented no valid token: {why}")

    def _forget(self, connection: GuardedConnection) -> None:
        peer = self._unauthenticated.pop(connection, None)
        if peer is not None:
            left = self._by_address[peer] - 1
            if left:
                self._by_address[peer] = left
            else:
                del self._by_address[peer]

    def _note(self, what: str) -> None:
        suppressed = self._log_limiter.admit()
        if suppressed is not None:
            more = f"; {suppressed} more such events since the last line" if suppressed else ""
            log.warning("at a connection cap (%d in all): %s (%s%s)", self.cap, what, DOCS_HINT, more)


def resource_exhausted(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the process is out of descriptors (or the kernel out of buffers)."""
    return isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS


class ResourceLogFilter(logging.Filter):
    """Lets through one record about descriptor exhaustion per interval, without its traceback and with the
    count of suppressed ones; other records pass unchanged. Installed on the loggers that report them."""

    def __init__(self, limiter: LogLimiter | None = None) -> None:
        super().__init__()
        self.limiter = limiter or LogLimiter()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not resource_exhausted(exc):
            return True
        suppressed = self.limiter.admit()
        if suppressed is None:
            return False
        more = f"; {suppressed} more such errors since the last line" if suppressed else ""
        record.msg = f"{record.getMessage()}: {exc} ({DOCS_HINT}{more})"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


#: One filter per process, shared by every master in it (an embedded master and tests start several).
_FILTER = ResourceLogFilter()
#: asyncio logs a failed accept(); master.http.connection an application's unexpected error.
_FILTERED_LOGGERS = (
    "asyncio",
    "master.http.connection",
    __name__,
    "master.http.serving",
    "master.service.service",
)


def install_log_filter() -> None:
    """Rate-limit descriptor-exhaustion records of the loggers that report them (idempotent)."""
    for name in _FILTERED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler: descriptor exhaustion (a failed ``accept()``) goes through the
    rate-limited filter as one line; anything else to asyncio's default handler."""
    exc = context.get("exception")
    if resource_exhausted(exc):
        logging.getLogger("asyncio").error(context.get("message", "out of resources"), exc_info=exc)
        return
    loop.default_exception_handler(context)
