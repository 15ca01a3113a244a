"""HTTP shell over :class:`master.job.Job`: FastAPI routes, auth, long-polls, and the tick loop.

The same code serves the ``elastic-master`` daemon and the master embedded in ``elastic-run``.
All job state is touched only from the event loop thread, so no lock is needed.

Stopping (SIGTERM/SIGINT, or a failed task): the master first steps down (:meth:`MasterService.step_down`:
no more ticks, pending long-polls answer 503 ``not_leader``, a last save, the lease revoked so that a
standby leads at once), and only then drains its connections, for at most :data:`DRAIN_GRACE_S`.
Background tasks are supervised (master.supervision): a crash resigns the leadership and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Annotated, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from elastic.protocol import (
    API_PREFIX,
    JOB_HEADER,
    LONG_POLL_CAP_S,
    MAX_BODY_BYTES,
    NODE_SECRET_HEADER,
    CommandReply,
    ErrorBody,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    RoundReply,
)
from elastic.text import printable
from elastic.tls import server_context
from master.clock import unix_monotonic
from master.event_log import EventLog
from master.fault_hook import InjectedFault
from master.job import Job, JobError
from master.master_health import MasterHealth
from master.metrics import MetricsPortOnly, add_metrics_route
from master.openapi import install as install_openapi
from master.settings import ServerSettings
from master.state_schema import describe as describe_unreadable
from master.store import MemoryStore, StateFormatError, StateStore, StoreError
from master.supervision import MasterFailure, Supervisor
from master.ui import install_ui
from master.wait_reason import ReasonLog

log = logging.getLogger("elastic.master")
T = TypeVar("T")

#: Longest wait for open connections after stepping down (long-polls answer at once by then).
DRAIN_GRACE_S = 5
#: Longest wait for the last save of a master that steps down (etcd slow or gone: the lease still goes).
FINAL_SAVE_S = 2.0

#: The secret of the node incarnation a request acts for (master.credentials); the job checks it. At module
#: level: FastAPI resolves the routes' (postponed) annotations in the module's namespace.
NodeSecret = Annotated[
    str | None,
    Header(
        alias=NODE_SECRET_HEADER,
        description="The node's secret from its join reply; required for a node that has joined.",
    ),
]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Notifier:
    """Wakes every waiter (a broadcast, unlike a single asyncio.Event); notified only when a long-poll's
    answer may have changed (:meth:`master.job.Job.long_poll_key`).

    A waiter takes a :meth:`ticket` *before* it checks the state and then waits on that ticket, so that a
    notify between its check and its wait is not lost (it would otherwise sleep until its timeout: with
    notifies only on real changes, nothing else would wake it)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def ticket(self) -> asyncio.Event:
        """Set by the next :meth:`notify`."""
        return self._event


async def _wait_for(ticket: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):  # not the builtin TimeoutError before 3.11
        await asyncio.wait_for(ticket.wait(), timeout)


class MasterService:
    """Owns the job (while this master leads), the clock, the tick loop, persistence and wake-ups."""

    def __init__(
        self,
        settings: ServerSettings,
        clock: Callable[[], float] | None = None,
        store: StateStore | None = None,
        tick_fault_s: float | None = None,
    ) -> None:
        """``tick_fault_s``: the test hook of master.fault_hook (the tick fails after leading that long)."""
        self.settings = settings
        self.clock = clock or unix_monotonic()  # event times read as Unix times (master.clock)
        self.health = MasterHealth()  # this process's own figures, for /metrics
        self.event_log = (
            EventLog(settings.event_log, settings.event_log_max_bytes, settings.event_log_backups)
            if settings.event_log
            else None
        )
        self.store = store or MemoryStore()
        self.master_id = uuid.uuid4().hex[:12]
        self.job: Job | None = None  # None while standing by
        self._notifier: Notifier | None = None
        self._dirty: asyncio.Event | None = None
        self._lost: asyncio.Event | None = None
        self._saved_version = -1  # the current job's version that the store holds (see stored())
        self._saved: asyncio.Event | None = None  # set (and replaced) after each save
        self._reasons = ReasonLog(log)  # the round's waiting reason, logged when it changes
        self._tick_fault_s = tick_fault_s
        self._led_since = 0.0
        self._term_tasks: list[asyncio.Task] = []
        self._run_task: asyncio.Task | None = None
        self._stepping_down: asyncio.Task | None = None
        #: Called once when a supervised task failed (the server then exits); see :attr:`failure`.
        self.on_failure: Callable[[], None] | None = None
        self.supervisor = Supervisor(self._failed)

    @property
    def failure(self) -> MasterFailure | None:
        """Why the master must exit non-zero, once a supervised task failed."""
        return self.supervisor.failure

    @property
    def stopping(self) -> bool:
        return self._stepping_down is not None

    def start(self) -> None:
        """Start the (supervised) run loop; call inside the running event loop."""
        self._run_task = self.supervisor.spawn(self.run(), "run")

    def step_down(self) -> asyncio.Task:
        """Stop leading for good, before any draining: cancel the tick and persist loops, answer every
        pending long-poll with 503 ``not_leader`` (agents ask another master), save the job once more if
        it changed, and revoke the lease (the store's ``close``) so that a standby is elected at once.
        Idempotent; the returned task completes when the lease is gone."""
        if self._stepping_down is None:
            self._stepping_down = asyncio.ensure_future(self._step_down())
        return self._stepping_down

    async def _step_down(self) -> None:
        for task in [*self._term_tasks, *([self._run_task] if self._run_task is not None else [])]:
            task.cancel()
        job = self.job
        self.notifier.notify()  # pending long-polls probe again and meet leading_job()'s 503
        if (
            job is not None
            and self.store.durable
            and self.store.leading
            and self._saved_version < job.version
        ):
            try:  # what a request changed since the last save (the tick is stopped: nothing changes now)
                await asyncio.wait_for(self.store.save(job.snapshot()), FINAL_SAVE_S)
            except (StoreError, asyncio.TimeoutError) as exc:
                log.warning("last save before stepping down failed (%s)", exc or "timed out")
        self.job = None
        await self.store.close()
        if job is not None:
            log.info("master %s stepped down from job %s", self.master_id, self.settings.job.job_id)

    def _failed(self, failure: MasterFailure) -> None:
        async def resign_and_exit() -> None:
            await self.step_down()
            if self.on_failure is not None:
                self.on_failure()

        asyncio.ensure_future(resign_and_exit())

    @property
    def notifier(self) -> Notifier:
        if self._notifier is None:  # created lazily inside the running loop
            self._notifier = Notifier()
        return self._notifier

    def leading_job(self) -> Job:
        """The job, or a 503 that sends the client to another master."""
        # ``store.leading`` turns false as soon as the lease may have expired, before the store's lease
        # task notices: a leader frozen past its lease serves nothing stale once it runs again.
        if self.job is None or not self.store.leading or self.stopping:
            raise ApiError(503, "not_leader", f"master {self.master_id} is a standby; ask another master")
        return self.job

    def changed(self) -> None:
        """Call after every mutation: carry out its effects (master.job_effects): log its events, have
        durable changes persisted, wake the long-polls whose answer may have changed."""
        job = self.job
        if job is None:
            return
        effects = job.take_effects()
        for event in effects.events:
            log.info("%s: %s", event.kind, printable(event.message))  # messages quote nodes' own words
        if effects.persist and self._dirty is not None:
            self._dirty.set()
        if effects.wake:
            self.notifier.notify()  # only then can a pending long-poll's answer have changed

    def tick(self) -> None:
        # No verdicts from a term that may be over (e.g. "every node dead" right after a freeze).
        if self.job is not None and self.store.leading and not self.stopping:
            if self._tick_fault_s is not None and self.clock() - self._led_since >= self._tick_fault_s:
                raise InjectedFault(
                    f"ELASTIC_MASTER_TICK_FAULT_S={self._tick_fault_s:g}: tick failure injected"
                )
            self.job.tick(self.clock())
            self.changed()
            self._reasons.note(self.job, self.clock())

    async def run(self) -> None:
        """Lead the job whenever elected; tick and persist while leading; stand by otherwise."""
        self._dirty = asyncio.Event()
        while True:
            self._lost = asyncio.Event()
            await self.store.campaign(self.master_id, self._lost.set)
            try:
                snapshot = await self.store.load()
            except StateFormatError:
                raise  # it does not pass by retrying: the supervisor resigns and exits with this line
            except StoreError as exc:
                # Never start a fresh job over state that exists but could not be read: campaign again.
                log.error("elected, but cannot read the job state (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            now = self.clock()
            job_settings = self.settings.job
            term = self.store.term
            self.job = (
                self._restore(snapshot, now, term)
                if snapshot
                else Job(job_settings, now, self.master_id, term)
            )
            self._led_since = now
            if self.event_log is not None:
                self.event_log.resume()  # continue the file past what a previous leader wrote
            self._saved_version = -1
            log.info(
                "master %s leads job %s (store %s)",
                self.master_id,
                job_settings.job_id,
                self.settings.store_url,
            )
            self.changed()
            spawn = self.supervisor.spawn
            self._term_tasks = [
                spawn(self._tick_forever(), "tick"),
                spawn(self._persist_forever(), "persist"),
            ]
            await self._lost.wait()
            for task in self._term_tasks:
                task.cancel()
            log.warning(
                "master %s lost the leadership of job %s; standing by", self.master_id, job_settings.job_id
            )
            self.job = None
            self.notifier.notify()

    def _restore(self, snapshot: dict, now: float, term: int) -> Job:
        """The job continued from the stored state; :class:`StateFormatError` (one line naming the key)
        when this master cannot read it."""
        try:
            return Job.restore(self.settings.job, snapshot, now, self.master_id, term)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            where, job_id = self.store.state_location, self.settings.job.job_id
            raise StateFormatError(
                f"cannot continue job {job_id}: its stored state ({where}) cannot be read: "
                f"{describe_unreadable(exc)}; fix or delete that key"
            ) from None

    async def _tick_forever(self) -> None:
        period = min(0.1, self.settings.job.heartbeat_interval_s / 4)
        while True:
            self.tick()
            await asyncio.sleep(period)

    async def _persist_forever(self) -> None:
        """Write the newest snapshot after changes (coalesced: bursts cost one write)."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self.job is None:
                continue
            job, version = self.job, self.job.version  # the version of the snapshot taken just below
            snapshot, began = job.snapshot(), time.perf_counter()
            try:
                await self.store.save(snapshot)
            except StoreError as exc:
                log.error(
                    "cannot persist job state (%s); stepping down so that no master serves stale state", exc
                )
                self._lost.set()
                continue
            self.health.store_write(time.perf_counter() - began)
            if self.event_log is not None:  # only events the store holds: a successor never repeats one
                self.event_log.write(e for e in job.events if e.seq <= snapshot["event_count"])
            if job is self.job:
                self._saved_version = max(self._saved_version, version)
            self._saved_ticket().set()
            self._saved = None

    def _saved_ticket(self) -> asyncio.Event:
        if self._saved is None:  # created lazily inside the running loop
            self._saved = asyncio.Event()
        return self._saved

    async def stored(self) -> None:
        """Return once the store holds the job state as it is now. A reply that reveals durable state a
        client keeps (a node's new secret) waits for this, so that a master taking over knows what the
        reply said; a 503 (the client asks another master) when this master stops leading first."""
        if not self.store.durable:
            return
        job = self.leading_job()
        target = job.version
        while self._saved_version < target:
            if self.job is not job or not self.store.leading:
                why = f"master {self.master_id} stopped leading; ask another master"
                raise ApiError(503, "not_leader", why)
            await _wait_for(self._saved_ticket(), 1.0)  # bounded: a lost leadership sets no ticket

    async def long_poll(
        self,
        probe: Callable[[], T | None],
        timeout: float,
        request: Request | None = None,
        on_client_gone: Callable[[], None] | None = None,
    ) -> T | None:
        """Return ``probe()`` as soon as it is not None, or None after ``timeout`` (capped). With
        ``request``, a client that disconnects ends the poll at once and ``on_client_gone`` is called."""
        deadline = self.clock() + min(max(timeout, 0.0), LONG_POLL_CAP_S)
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        self.health.long_polls_open += 1
        try:
            while True:
                ticket = self.notifier.ticket()  # before the check: a change after it sets the ticket
                result = probe()
                remaining = deadline - self.clock()
                if result is not None:
                    await self.stored()  # write-ahead: an answer never reveals a state not stored yet
                    return result
                if remaining <= 0:
                    return None
                change = asyncio.ensure_future(_wait_for(ticket, remaining))
                await asyncio.wait({change, gone} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if gone is not None and gone.done():
                    change.cancel()
                    if on_client_gone is not None:
                        on_client_gone()
                    return None
        finally:
            self.health.long_polls_open -= 1
            if gone is not None:
                gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Gatekeeper:
    """ASGI middleware in front of ``/v1``: token and job id first (401/409), then the body size (413).

    It runs before routing, so an unauthenticated client learns nothing about request validation, and
    the body is read here (at most ``limit`` bytes, also for chunked requests) before the app parses it.
    """

    def __init__(self, app, token: str, job_id: str, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.token, self.job_id, self.limit = app, token.encode(), job_id, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not secrets.compare_digest(bearer_token(headers.get(b"authorization", b"")), self.token):
            return await _reply(
                send,
                401,
                "unauthorized",
                "missing or wrong bearer token; check --token-file",
                extra_headers=[(b"www-authenticate", b'Bearer realm="elastic-master"')],
            )
        job = headers.get(JOB_HEADER.lower().encode(), b"").decode(errors="replace")
        if job != self.job_id:
            return await _reply(
                send, 409, "wrong_job", f"this master serves job {self.job_id!r}, not {job!r}"
            )
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await _reply(send, 413, "body_too_large", f"request body exceeds {self.limit} bytes")
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(message, receive), send)  # client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await _reply(send, 413, "body_too_large", f"request body exceeds {self.limit} bytes")
        return await self.app(scope, _replay({"type": "http.request", "body": bytes(body)}, receive), send)


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme is case-insensitive,
    RFC 7235); empty when the header is missing or uses another scheme."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


def _replay(first: dict, receive):
    """An ASGI ``receive`` that yields ``first`` once, then the server's own messages (the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


async def _reply(
    send, status: int, code: str, message: str, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = ErrorBody(error=code, message=message).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorBody(error=code, message=message).model_dump())


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":  # loc holds a character position, not a field
            detail = (err.get("ctx") or {}).get("error", "invalid JSON")
            parts.append(f"body is not valid JSON (at character {err['loc'][-1]}): {detail}")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "malformed request"


def create_app(service: MasterService) -> FastAPI:
    """Build the FastAPI application for one job."""
    job_id, token = service.settings.job.job_id, service.settings.token

    def authorize(
        authorization: Annotated[str | None, Header()] = None,
        x_elastic_job: Annotated[str | None, Header(alias=JOB_HEADER)] = None,
    ) -> None:
        """Documents the two headers in the OpenAPI schema; :class:`Gatekeeper` enforces them."""

    async def lifespan(app: FastAPI):
        s = service.settings.job
        log.info(
            "master %s for job %s: nnodes %d:%d, node unit %d, last call %gs, heartbeat %gs/%gs, "
            "max restarts %d",
            service.master_id,
            job_id,
            s.min_nodes,
            s.max_nodes,
            s.node_unit,
            s.last_call_s,
            s.heartbeat_interval_s,
            s.heartbeat_timeout_s,
            s.max_restarts,
        )
        await service.store.start()
        service.start()
        try:
            yield
        finally:
            await service.step_down()  # a no-op when a signal or a failure stepped down already
            await service.store.close()

    app = FastAPI(
        title="elastic-run job master",
        version="1",
        lifespan=lifespan,
        dependencies=[Depends(authorize)],
        docs_url=None,
        redoc_url=None,
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message)

    @app.exception_handler(JobError)
    async def _job_error(request: Request, exc: JobError) -> JSONResponse:
        return _error(exc.http_status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", _describe_validation(exc))

    @app.exception_handler(HTTPException)
    async def _undecodable(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI answers a JSON body that is not UTF-8 with a bare 400: it is malformed JSON like any other.
        if exc.status_code == 400:
            return _error(422, "invalid_request", "body is not valid JSON: it is not UTF-8 text")
        return await http_exception_handler(request, exc)  # unknown path or method: FastAPI's answer

    job = service.leading_job

    def mutate(action: Callable[[], T]) -> T:
        try:
            return action()
        finally:
            service.changed()

    def lost(node_id: str, node_secret: str | None) -> None:
        """A node's long-poll connection closed before the answer (see Job.connection_lost)."""
        if service.job is not None and service.store.leading:
            mutate(lambda: service.job.connection_lost(node_id, service.clock(), node_secret))

    @app.get(f"{API_PREFIX}/info")
    async def info() -> JobInfo:
        return job().info()

    async def stored(reply: T) -> T:
        """Write-ahead: return ``reply`` once the store holds every durable fact it may reveal (the
        node's credential, a round and its assignment, a verdict); a 503 if leadership is lost first."""
        await service.stored()
        return reply

    @app.post(f"{API_PREFIX}/join")
    async def join(req: JoinRequest, node_secret: NodeSecret = None) -> JoinReply:
        return await stored(mutate(lambda: job().join(req, service.clock(), node_secret)))

    @app.get(f"{API_PREFIX}/round")
    async def next_round(
        request: Request,
        node_id: Annotated[str, Query(min_length=1, max_length=128)],
        after: Annotated[int, Query(ge=0)] = 0,
        timeout: Annotated[float, Query(ge=0, le=LONG_POLL_CAP_S)] = 10.0,
        node_secret: NodeSecret = None,
    ) -> RoundReply:
        reply = await service.long_poll(
            lambda: job().next_round(node_id, after, node_secret),
            timeout,
            request,
            lambda: lost(node_id, node_secret),
        )
        return reply or await stored(RoundReply(status="waiting", round=job().rdzv.round))

    @app.post(f"{API_PREFIX}/heartbeat")
    async def heartbeat(req: HeartbeatRequest, node_secret: NodeSecret = None) -> CommandReply:
        service.health.heartbeat(service.clock())
        return await stored(mutate(lambda: job().heartbeat(req, service.clock(), node_secret)))

    @app.get(f"{API_PREFIX}/watch")
    async def watch(
        request: Request,
        node_id: Annotated[str, Query(min_length=1, max_length=128)],
        round: Annotated[int, Query(ge=0)],
        timeout: Annotated[float, Query(ge=0, le=LONG_POLL_CAP_S)] = 10.0,
        term: Annotated[int | None, Query(ge=0)] = None,
        node_secret: NodeSecret = None,
    ) -> CommandReply:
        """Long-poll: returns as soon as the node must do something other than continue. ``term``: the
        term of the node's round (its assignment's); omitted by agents that predate terms."""

        def probe() -> CommandReply | None:
            reply = job().watch(node_id, round, node_secret, term)
            return None if reply.command.value == "continue" else reply

        reply = await service.long_poll(probe, timeout, request, lambda: lost(node_id, node_secret))
        return reply or await stored(job().watch(node_id, round, node_secret, term))

    @app.post(f"{API_PREFIX}/leave")
    async def leave(req: LeaveRequest, node_secret: NodeSecret = None) -> CommandReply:
        mutate(lambda: job().leave(req.node_id, req.reason, service.clock(), node_secret))
        return await stored(job().command_for(req.node_id, 0))

    @app.get(f"{API_PREFIX}/status")
    async def status() -> JobStatus:
        return job().status(service.clock())

    add_metrics_route(app, service, bearer_token)  # GET /metrics, behind the token (master/metrics.py)
    install_ui(app, service)  # GET /ui: the status page, behind a login form (master/ui.py)
    if service.settings.metrics_port is not None:
        app.add_middleware(MetricsPortOnly, port=service.settings.metrics_port)
    app.add_middleware(Gatekeeper, token=token, job_id=job_id)
    install_openapi(app)  # every status each route can return, the bearer scheme (master/openapi.py)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front so that a busy port fails fast and port 0 is resolved."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP. Without
    # it a reply's body waits for the ACK of its headers (Nagle vs delayed ACK): ~40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class _MasterServer(uvicorn.Server):
    """uvicorn, stepping down before it drains: on the first SIGTERM/SIGINT the service steps down
    (:meth:`MasterService.step_down`), and only once the lease is revoked does uvicorn close the listener
    and drain (bounded by ``timeout_graceful_shutdown``). A second signal exits at once as usual; a failed
    supervised task makes it exit too (``service.on_failure``)."""

    def __init__(self, config: uvicorn.Config, service: MasterService) -> None:
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        service.on_failure = self._exit

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        loop = self._loop
        if self.should_exit or self.service.stopping or loop is None or not self.started:
            return super().handle_exit(sig, frame)  # a second signal, or before serving: uvicorn's way
        self._captured_signals.append(sig)  # uvicorn raises it again once served (the exit status)
        log.info("signal %d: stepping down before draining", sig)

        def step_down() -> None:  # in the loop, not in the signal handler
            if not self.service.stopping:
                self.service.step_down().add_done_callback(lambda _: self._exit())

        loop.call_soon_threadsafe(step_down)


def _uvicorn_server(app: FastAPI, settings: ServerSettings, service: MasterService) -> uvicorn.Server:
    """A uvicorn server for ``app``; https when ``settings`` name a certificate and key.

    Raises :class:`elastic.tls.TLSConfigError` when they cannot be used."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=int(LONG_POLL_CAP_S) + 5,
        timeout_graceful_shutdown=DRAIN_GRACE_S,
        ws="none",
    )
    if settings.tls_cert and settings.tls_key:
        # Our own context (TLS 1.2+ whatever the uvicorn version, a one-line error for a bad file) instead
        # of uvicorn's ssl_* options: load the config now and swap the context in; uvicorn does not load a
        # loaded config again, and serves with ``config.ssl``.
        context = server_context(settings.tls_cert, settings.tls_key)
        config.load()
        config.ssl = context
    return _MasterServer(config, service)


def serve_forever(
    settings: ServerSettings,
    sock: socket.socket,
    store: StateStore | None = None,
    metrics_sock: socket.socket | None = None,
    tick_fault_s: float | None = None,
) -> None:
    """Run the master in this (main) thread until SIGINT/SIGTERM; ``metrics_sock``: the bound
    ``--metrics-port`` listener (it serves ``/metrics`` only); ``tick_fault_s``: master.fault_hook.

    Raises :class:`MasterFailure` when a supervised task failed (the master resigned first)."""
    service = MasterService(settings, store=store, tick_fault_s=tick_fault_s)
    server = _uvicorn_server(create_app(service), settings, service)
    server.run(sockets=[sock] + ([metrics_sock] if metrics_sock is not None else []))
    if service.failure is not None:
        raise service.failure


class EmbeddedMaster:
    """A master running in a background thread of another process (``elastic-run --standalone``)."""

    def __init__(
        self, settings: ServerSettings, sock: socket.socket | None = None, store: StateStore | None = None
    ) -> None:
        self.settings = settings
        self._sock = sock or bind_socket(settings.host, settings.port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.service = MasterService(settings, store=store)
        try:
            self._server = _uvicorn_server(create_app(self.service), settings, self.service)
        except Exception:
            self._sock.close()
            raise
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="elastic-master", daemon=True
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedMaster:
        self._thread.start()
        deadline = time.monotonic() + timeout
        # A non-durable store elects at once: wait for the job too, so the first request is served.
        while not self._server.started or (self.service.job is None and not self.service.store.durable):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded master failed to start on {self.address}")
            time.sleep(0.005)  # start-up handshake only; uvicorn exposes no event for it
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
