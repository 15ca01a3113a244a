"""The master's HTTP API: FastAPI routes over :class:`master.service.service.MasterService`, error replies,
and the guards in front of them (master.http.gatekeeper, master.http.metrics, master.http.ui). The same app
serves the
``elastic-master`` daemon and the master embedded in ``elastic-run`` (master.http.serving)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STREAM_PATH,
    STREAM_UPGRADE,
    CommandReply,
    ErrorBody,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    ReadmitReply,
    RoundReply,
)
from master.http.errors import ApiError, http_status
from master.http.gatekeeper import Gatekeeper
from master.http.metrics import MetricsPortOnly, add_metrics_route
from master.http.openapi import install as install_openapi
from master.http.rate_limits import PeerFailureLimiter
from master.http.stream import StreamEndpoint
from master.http.ui import install_ui
from master.http.wire_compat import for_client, revision
from master.job.errors import JobError
from master.service import api_ops
from master.service.api_ops import (
    DEFAULT_POLL_TIMEOUT_S,
    NODE_ID_LIMITS,
    TIMEOUT_LIMITS,
    RoundQuery,
    WatchQuery,
    describe_errors,
)
from master.service.service import MasterService

log = logging.getLogger(__name__)
T = TypeVar("T")


#: The secret of the node incarnation a request acts for (master.job.liveness); the job checks it. At
#: module level: FastAPI resolves the routes' (postponed) annotations in the module's namespace.
NodeSecret = Annotated[
    str | None,
    Header(
        alias=NODE_SECRET_HEADER,
        description="The node's secret from its join reply; required for a node that has joined.",
    ),
]
#: The protocol revision of the client (``X-Elastic-Protocol``; absent: 1): master.http.wire_compat.
ClientProtocol = Annotated[
    str | None,
    Header(
        alias=PROTOCOL_HEADER,
        description=f"The client's protocol revision (absent: 1; this release: {PROTOCOL_VERSION}). A "
        "master leaves out of its replies the fields an older revision does not know.",
    ),
]


def _why(cause: BaseException | None) -> str:
    """Why a body could not be parsed, in a few words (the cause of FastAPI's 400)."""
    if isinstance(cause, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(cause, RecursionError):
        return "it is nested too deeply"
    return f"{type(cause).__name__}: {cause}"[:200] if cause is not None else "it could not be parsed"


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorBody(error=code, message=message).model_dump())


def create_app(service: MasterService) -> FastAPI:
    """Build the FastAPI application for one job."""
    job_id = service.settings.job.job_id

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
        return _error(http_status(exc), exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, ErrorCode.INVALID_REQUEST, describe_errors(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _undecodable(request: Request, exc: HTTPException) -> Response:
        # FastAPI answers a body its JSON parser failed on other than by a syntax error (bytes that are not
        # UTF-8, nesting too deep for the parser) with a bare 400: it is malformed JSON like any other.
        if exc.status_code == 400:
            return _error(422, ErrorCode.INVALID_REQUEST, f"body is not valid JSON: {_why(exc.__cause__)}")
        return await http_exception_handler(request, exc)  # unknown path or method: FastAPI's answer

    job = service.leading_job

    def mutate(action: Callable[[], T]) -> T:
        return api_ops.mutate(service, action)

    @app.get(f"{API_PREFIX}/info")
    async def info() -> JobInfo:
        return await api_ops.info(service)

    @app.post(f"{API_PREFIX}/join")
    async def join(req: JoinRequest, node_secret: NodeSecret = None) -> JoinReply:
        return await api_ops.join(service, req, node_secret)

    @app.get(f"{API_PREFIX}/round", response_model=RoundReply)
    async def next_round(
        request: Request,
        node_id: Annotated[str, Query(**NODE_ID_LIMITS)],
        after: Annotated[int, Query(ge=0)] = 0,
        timeout: Annotated[float, Query(**TIMEOUT_LIMITS)] = DEFAULT_POLL_TIMEOUT_S,
        node_secret: NodeSecret = None,
        protocol: ClientProtocol = None,
    ) -> RoundReply | Response:
        query = RoundQuery.model_construct(node_id=node_id, after=after, timeout=timeout)
        reply = await api_ops.next_round(service, query, node_secret, disconnected(request))
        return for_client(reply, revision(protocol))

    @app.post(f"{API_PREFIX}/heartbeat", response_model=CommandReply)
    async def heartbeat(
        req: HeartbeatRequest, node_secret: NodeSecret = None, protocol: ClientProtocol = None
    ) -> CommandReply | Response:
        return for_client(await api_ops.heartbeat(service, req, node_secret), revision(protocol))

    @app.get(f"{API_PREFIX}/watch", response_model=CommandReply)
    async def watch(
        request: Request,
        node_id: Annotated[str, Query(**NODE_ID_LIMITS)],
        round: Annotated[int, Query(ge=0)],
        timeout: Annotated[float, Query(**TIMEOUT_LIMITS)] = DEFAULT_POLL_TIMEOUT_S,
        term: Annotated[int | None, Query(ge=0)] = None,
        node_secret: NodeSecret = None,
        protocol: ClientProtocol = None,
    ) -> CommandReply | Response:
        """Long-poll: returns as soon as the node must do something other than continue. ``term``: the
        term of the node's round (its assignment's); omitted by agents that predate terms."""
        query = WatchQuery.model_construct(node_id=node_id, round=round, timeout=timeout, term=term)
        reply = await api_ops.watch(service, query, node_secret, disconnected(request))
        return for_client(reply, revision(protocol))

    @app.post(f"{API_PREFIX}/leave", response_model=CommandReply)
    async def leave(
        req: LeaveRequest, node_secret: NodeSecret = None, protocol: ClientProtocol = None
    ) -> CommandReply | Response:
        return for_client(await api_ops.leave(service, req, node_secret), revision(protocol))

    @app.get(STREAM_PATH)
    async def agent_stream() -> None:
        """One connection per agent: this request with ``Connection: Upgrade`` and ``Upgrade:
        elastic-stream/1`` switches the connection (101) to newline-delimited JSON frames that carry the
        node API's calls (info, join, round, heartbeat, watch, leave) and their replies, multiplexed, with
        the routes' validation, statuses and error bodies (docs/protocol.md, "The agent stream"). Without
        the upgrade: 426."""
        raise ApiError(
            426,
            ErrorCode.UPGRADE_REQUIRED,
            f"{STREAM_PATH} needs the headers 'Connection: Upgrade' and 'Upgrade: {STREAM_UPGRADE}' "
            "(and no body)",
        )

    @app.get(f"{API_PREFIX}/status", response_model=JobStatus)
    async def status(protocol: ClientProtocol = None) -> JobStatus | Response:
        return for_client(job().status(service.clock()), revision(protocol))

    @app.post(f"{API_PREFIX}/nodes/{{node_id}}/readmit")
    async def readmit(node_id: Annotated[str, Path(min_length=1, max_length=128)]) -> ReadmitReply:
        """The operator lifts a node's exclusion for flapping before its cool-down ends."""
        mutate(lambda: job().readmit(node_id, service.clock()))
        reply = ReadmitReply(node_id=node_id, message=f"node {node_id} re-admitted")
        return await api_ops.stored(service, reply)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        """Liveness, for probes: 200 while this process serves (a failed master exits), else 503. No token
        and no job data (docs/security.md)."""
        alive = service.failure is None
        return Response(b"ok\n" if alive else b"failed\n", 200 if alive else 503, media_type="text/plain")

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        """Readiness, for probes: 200 when this master leads the job or stands by ready to take over
        (:meth:`MasterService.ready`), else 503. No token and no job data (docs/security.md)."""
        ready = service.ready()
        return Response(
            b"ready\n" if ready else b"not ready\n", 200 if ready else 503, media_type="text/plain"
        )

    # Wrong tokens per address, counted alike by the gate, the stream, /metrics and /ui/login.
    failures = PeerFailureLimiter()
    add_metrics_route(app, service, failures)  # GET /metrics, behind the token (master/http/metrics.py)
    install_ui(app, service, failures)  # GET /ui: the status page, behind a login form (master/http/ui.py)
    if service.settings.metrics_port is not None:
        app.add_middleware(MetricsPortOnly, port=service.settings.metrics_port)
    app.add_middleware(Gatekeeper, token=service.tokens, job_id=job_id, failures=failures)
    # The agent stream's endpoint, for the connection protocol (master.http.serving gives it to
    # master.http.conn_guard).
    app.state.agent_stream = StreamEndpoint(service, service.tokens, failures)
    install_openapi(app)  # every status each route can return, the bearer scheme (master/http/openapi.py)
    return app


async def disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected: a long-poll's
    ``client_gone`` (:meth:`master.service.service.MasterService.long_poll`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
