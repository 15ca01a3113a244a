"""The master's HTTP API: FastAPI routes over :class:`master.service.MasterService`, error replies, and the
guards in front of them (master.gatekeeper, master.metrics, master.ui). The same app serves the
``elastic-master`` daemon and the master embedded in ``elastic-run`` (master.serving)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from elastic.master_errors import ErrorCode
from elastic.protocol import (
    API_PREFIX,
    JOB_HEADER,
    LONG_POLL_CAP_S,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
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
from master.gatekeeper import Gatekeeper, bearer_token
from master.http_errors import ApiError, http_status
from master.job_errors import JobError
from master.metrics import MetricsPortOnly, add_metrics_route
from master.openapi import install as install_openapi
from master.service import MasterService
from master.ui import install_ui
from master.wire_compat import for_client, revision

log = logging.getLogger(__name__)
T = TypeVar("T")


#: The secret of the node incarnation a request acts for (master.credentials); the job checks it. At module
#: level: FastAPI resolves the routes' (postponed) annotations in the module's namespace.
NodeSecret = Annotated[
    str | None,
    Header(
        alias=NODE_SECRET_HEADER,
        description="The node's secret from its join reply; required for a node that has joined.",
    ),
]
#: The protocol revision of the client (``X-Elastic-Protocol``; absent: 1): master.wire_compat.
ClientProtocol = Annotated[
    str | None,
    Header(
        alias=PROTOCOL_HEADER,
        description=f"The client's protocol revision (absent: 1; this release: {PROTOCOL_VERSION}). A "
        "master leaves out of its replies the fields an older revision does not know.",
    ),
]


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
        return _error(http_status(exc), exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, ErrorCode.INVALID_REQUEST, _describe_validation(exc))

    @app.exception_handler(HTTPException)
    async def _undecodable(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI answers a JSON body that is not UTF-8 with a bare 400: it is malformed JSON like any other.
        if exc.status_code == 400:
            return _error(422, ErrorCode.INVALID_REQUEST, "body is not valid JSON: it is not UTF-8 text")
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
        try:
            reply = mutate(lambda: job().join(req, service.clock(), node_secret))
        except JobError:
            await service.stored()  # a refusal may reveal durable state too (an exclusion for flapping)
            raise
        return await stored(reply)

    @app.get(f"{API_PREFIX}/round")
    async def next_round(
        request: Request,
        node_id: Annotated[str, Query(min_length=1, max_length=128)],
        after: Annotated[int, Query(ge=0)] = 0,
        timeout: Annotated[float, Query(ge=0, le=LONG_POLL_CAP_S)] = 10.0,
        node_secret: NodeSecret = None,
        protocol: ClientProtocol = None,
    ) -> RoundReply:
        reply = await service.long_poll(
            lambda: job().next_round(node_id, after, node_secret),
            timeout,
            request,
            lambda: lost(node_id, node_secret),
        )
        reply = reply or await stored(RoundReply(status="waiting", round=job().rdzv.round))
        return for_client(reply, revision(protocol))

    @app.post(f"{API_PREFIX}/heartbeat")
    async def heartbeat(
        req: HeartbeatRequest, node_secret: NodeSecret = None, protocol: ClientProtocol = None
    ) -> CommandReply:
        service.health.heartbeat(service.clock())
        reply = await stored(mutate(lambda: job().heartbeat(req, service.clock(), node_secret)))
        return for_client(reply, revision(protocol))

    @app.get(f"{API_PREFIX}/watch")
    async def watch(
        request: Request,
        node_id: Annotated[str, Query(min_length=1, max_length=128)],
        round: Annotated[int, Query(ge=0)],
        timeout: Annotated[float, Query(ge=0, le=LONG_POLL_CAP_S)] = 10.0,
        term: Annotated[int | None, Query(ge=0)] = None,
        node_secret: NodeSecret = None,
        protocol: ClientProtocol = None,
    ) -> CommandReply:
        """Long-poll: returns as soon as the node must do something other than continue. ``term``: the
        term of the node's round (its assignment's); omitted by agents that predate terms."""

        def probe() -> CommandReply | None:
            reply = job().watch(node_id, round, node_secret, term)
            return None if reply.command.value == "continue" else reply

        reply = await service.long_poll(probe, timeout, request, lambda: lost(node_id, node_secret))
        reply = reply or await stored(job().watch(node_id, round, node_secret, term))
        return for_client(reply, revision(protocol))

    @app.post(f"{API_PREFIX}/leave")
    async def leave(
        req: LeaveRequest, node_secret: NodeSecret = None, protocol: ClientProtocol = None
    ) -> CommandReply:
        mutate(lambda: job().leave(req.node_id, req.reason, service.clock(), node_secret))
        return for_client(await stored(job().command_for(req.node_id, 0)), revision(protocol))

    @app.get(f"{API_PREFIX}/status")
    async def status(protocol: ClientProtocol = None) -> JobStatus:
        return for_client(job().status(service.clock()), revision(protocol))

    @app.post(f"{API_PREFIX}/nodes/{{node_id}}/readmit")
    async def readmit(node_id: Annotated[str, Path(min_length=1, max_length=128)]) -> ReadmitReply:
        """The operator lifts a node's exclusion for flapping before its cool-down ends."""
        mutate(lambda: job().readmit(node_id, service.clock()))
        return await stored(ReadmitReply(node_id=node_id, message=f"node {node_id} re-admitted"))

    add_metrics_route(app, service, bearer_token)  # GET /metrics, behind the token (master/metrics.py)
    install_ui(app, service)  # GET /ui: the status page, behind a login form (master/ui.py)
    if service.settings.metrics_port is not None:
        app.add_middleware(MetricsPortOnly, port=service.settings.metrics_port)
    app.add_middleware(Gatekeeper, token=token, job_id=job_id)
    install_openapi(app)  # every status each route can return, the bearer scheme (master/openapi.py)
    return app
