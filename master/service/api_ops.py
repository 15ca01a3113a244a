"""The node API's operations (info, join, round, heartbeat, watch, leave) as plain async functions over
:class:`master.service.service.MasterService`, shared by the HTTP routes (master.http.app) and the agent
stream (master.http.stream), so that a call answers the same on either: same logic, same write-ahead, same
errors.

The caller validates the request models and the query (:class:`RoundQuery`, :class:`WatchQuery` say the
limits both use) and turns the exceptions into replies: :class:`master.job.errors.JobError` (status from
:func:`master.http.errors.http_status`; :class:`master.service.service.NotLeaderError` is 503 ``not_leader``).
A long-poll takes ``client_gone``, an awaitable done when its client disconnected (see
:meth:`MasterService.long_poll`). Replies are the full models: the caller applies
:mod:`master.http.wire_compat` for the client's revision."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from elastic.control.protocol import (
    LONG_POLL_CAP_S,
    Command,
    CommandReply,
    HeartbeatRequest,
    JobInfo,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    RoundReply,
)
from master.job.errors import JobError
from master.job.views import waiting_reply
from master.service.service import MasterService

T = TypeVar("T")

#: The limits of the query parameters, shared by the HTTP routes' ``Query(...)`` and the stream's models.
NODE_ID_LIMITS: dict[str, Any] = {"min_length": 1, "max_length": 128}
TIMEOUT_LIMITS: dict[str, Any] = {"ge": 0, "le": LONG_POLL_CAP_S}
#: A long-poll's timeout when the client names none (seconds).
DEFAULT_POLL_TIMEOUT_S = 10.0


class _Query(BaseModel):
    # Unknown query parameters are ignored, as the HTTP routes ignore them.
    model_config = ConfigDict(extra="ignore", frozen=True)


class RoundQuery(_Query):
    """The query of ``round`` (``GET /v1/round``)."""

    node_id: Annotated[str, Field(**NODE_ID_LIMITS)]
    after: int = Field(default=0, ge=0)
    timeout: Annotated[float, Field(**TIMEOUT_LIMITS)] = DEFAULT_POLL_TIMEOUT_S


class WatchQuery(_Query):
    """The query of ``watch`` (``GET /v1/watch``)."""

    node_id: Annotated[str, Field(**NODE_ID_LIMITS)]
    round: int = Field(ge=0)
    timeout: Annotated[float, Field(**TIMEOUT_LIMITS)] = DEFAULT_POLL_TIMEOUT_S
    term: int | None = Field(default=None, ge=0)


def describe_errors(errors: Sequence[Any], prefix: str = "") -> str:
    """One line naming each invalid field (at most five) of pydantic's ``errors()``: ``nproc: Input should
    be ...``; ``prefix`` (``query``) goes before a location that names no part of the request itself."""
    parts = []
    for err in list(errors)[:5]:
        if err.get("type") == "json_invalid":  # loc holds a character position, not a field
            detail = (err.get("ctx") or {}).get("error", "invalid JSON")
            parts.append(f"body is not valid JSON (at character {err['loc'][-1]}): {detail}")
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if prefix and loc:
            loc.insert(0, prefix)
        parts.append(f"{'.'.join(loc) or prefix or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "malformed request"


def mutate(service: MasterService, action: Callable[[], T]) -> T:
    """Run a mutation of the job, then carry out its effects (:meth:`MasterService.changed`)."""
    try:
        return action()
    finally:
        service.changed()


def lost(service: MasterService, node_id: str, node_secret: str | None) -> None:
    """A node's long-poll connection closed before the answer (see Job.connection_lost)."""
    if service.job is not None and service.store.leading:
        job = service.job
        mutate(service, lambda: job.connection_lost(node_id, service.clock(), node_secret))


async def stored(service: MasterService, reply: T) -> T:
    """Write-ahead: return ``reply`` once the store holds every durable fact it may reveal (the node's
    credential, a round and its assignment, a verdict); a 503 if leadership is lost first."""
    await service.stored()
    return reply


async def info(service: MasterService) -> JobInfo:
    """``GET /v1/info``."""
    return service.leading_job().info()


async def join(service: MasterService, req: JoinRequest, node_secret: str | None) -> JoinReply:
    """``POST /v1/join``: answered once the store holds the node's credential."""
    try:
        reply = mutate(service, lambda: service.leading_job().join(req, service.clock(), node_secret))
    except JobError:
        await service.stored()  # a refusal may reveal durable state too (an exclusion for flapping)
        raise
    return await stored(service, reply)


async def next_round(
    service: MasterService,
    query: RoundQuery,
    node_secret: str | None,
    client_gone: Awaitable[object] | None = None,
) -> RoundReply:
    """``GET /v1/round``: long-poll for the node's assignment in a round newer than ``query.after``."""
    node_id = query.node_id
    await held(service)
    reply = await service.long_poll(
        lambda: service.leading_job().next_round(node_id, query.after, node_secret),
        query.timeout,
        client_gone,
        lambda: lost(service, node_id, node_secret),
        key=node_id,
    )
    if reply is not None:
        return reply
    # Built only here, once the poll timed out: how the rendezvous stands for the agent's waiting line. The
    # agent asks again after its line interval (shorter polls), so a change is never pushed to every
    # waiting poll: at 10,000 nodes, each join would wake 10,000 polls.
    return await stored(service, waiting_reply(service.leading_job(), service.clock()))


def beat(service: MasterService, req: HeartbeatRequest, node_secret: str | None) -> CommandReply:
    """The synchronous part of a heartbeat: record it and say what the node must do. The reply may be
    sent once :meth:`MasterService.stored` returns (at once when ``service.holds_current_state()``)."""
    now = service.clock()
    service.health.heartbeat(now)
    return mutate(service, lambda: service.leading_job().heartbeat(req, now, node_secret))


async def heartbeat(service: MasterService, req: HeartbeatRequest, node_secret: str | None) -> CommandReply:
    """``POST /v1/heartbeat``."""
    await held(service)
    return await stored(service, beat(service, req, node_secret))


async def held(service: MasterService) -> None:
    """A standby holds a joined node's call until it leads, or briefly (master.service.waiting)."""
    if service.holds_calls():
        await service.standby_hold.wait()


async def watch(
    service: MasterService,
    query: WatchQuery,
    node_secret: str | None,
    client_gone: Awaitable[object] | None = None,
) -> CommandReply:
    """``GET /v1/watch``: long-poll that returns as soon as the node must do something other than
    continue. ``query.term``: the term of the node's round (its assignment's); omitted by agents that
    predate terms."""
    node_id, round_, term = query.node_id, query.round, query.term
    await held(service)

    def probe() -> CommandReply | None:
        reply = service.leading_job().watch(node_id, round_, node_secret, term)
        return None if reply.command is Command.CONTINUE else reply

    reply = await service.long_poll(
        probe, query.timeout, client_gone, lambda: lost(service, node_id, node_secret), key=node_id
    )
    if reply is not None:
        return reply
    return await stored(service, service.leading_job().watch(node_id, round_, node_secret, term))


async def leave(service: MasterService, req: LeaveRequest, node_secret: str | None) -> CommandReply:
    """``POST /v1/leave``: an orderly departure; the reply is the node's command after it."""
    job = service.leading_job()
    mutate(service, lambda: job.leave(req.node_id, req.reason, service.clock(), node_secret))
    return await stored(service, service.leading_job().command_for(req.node_id, 0))
