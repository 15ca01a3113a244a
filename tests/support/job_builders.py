"""Builders of real ``master.job.job.Job`` instances on a fake clock, shared by the job's unit tests: a job
with short timeouts, join requests, running rounds, heartbeats, crashes and the event kinds it emitted."""

from __future__ import annotations

import job_calls as calls

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    Command,
    HeartbeatRequest,
    JoinRequest,
    NodeState,
    WorkerFailure,
)
from master.job.job import Job
from master.job.rendezvous import Phase

HB_TIMEOUT = 4.0
LAST_CALL = 2.0


def make_job(**overrides: object) -> Job:
    values: dict = dict(
        job_id="job-1",
        min_nodes=2,
        max_nodes=2,
        node_unit=1,
        last_call_s=LAST_CALL,
        join_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=HB_TIMEOUT,
        max_restarts=2,
    )
    values.update(overrides)
    return Job(JobSettings(**values), now=0.0)


def join_req(job: Job, node_id: str, nproc: int = 2, **overrides: object) -> JoinRequest:
    index = ord(node_id[0]) - ord("a")
    values: dict = dict(
        node_id=node_id,
        host=f"10.0.0.{index + 1}",
        nproc=nproc,
        store_port=29500 + index,
        min_nodes=job.settings.min_nodes,
        max_nodes=job.settings.max_nodes,
    )
    values.update(overrides)
    return JoinRequest(**values)


def join(job: Job, now: float, *node_ids: str, nproc: int = 2) -> None:
    for node_id in node_ids:
        reply = calls.join(job, join_req(job, node_id, nproc), now)
        assert reply.master_id == job.master_id
        assert reply.round == job.rdzv.round


def beat(
    job: Job,
    node_id: str,
    now: float,
    round_: int | None = None,
    state: NodeState = NodeState.RUNNING,
    failure: WorkerFailure | None = None,
):
    round_ = job.rdzv.round if round_ is None else round_
    req = HeartbeatRequest(node_id=node_id, round=round_, state=state, failure=failure)
    return calls.heartbeat(job, req, now)


def crash(
    rank: int = 0,
    local_rank: int = 0,
    exit_code: int | None = 1,
    signal: str | None = None,
    message: str = "RuntimeError: boom",
    kind: str = "crash",
) -> WorkerFailure:
    return WorkerFailure(
        rank=rank, local_rank=local_rank, exit_code=exit_code, signal=signal, message=message, kind=kind
    )


def kinds(job: Job) -> list[str]:
    """Kinds of the recorded events after the job's own ``job_started``."""
    return [event.kind for event in job.events if event.kind != "job_started"]


def new_kinds(job: Job, mark: int) -> list[str]:
    """Kinds of the events recorded since ``mark`` (a previous ``job.event_count``)."""
    return [event.kind for event in job.events][len(job.events) - (job.event_count - mark) :]


def running(job: Job, now: float, *node_ids: str, nproc: int = 2) -> None:
    """Join ``node_ids`` (the whole world) and report them running; the round must close."""
    join(job, now, *node_ids, nproc=nproc)
    job.tick(now)
    assert job.rdzv.phase is Phase.ACTIVE, f"round {job.rdzv.round} did not close"
    for node_id in node_ids:
        assert beat(job, node_id, now).command is Command.CONTINUE


def assigned(job: Job, node_id: str, after: int = 0):
    reply = calls.next_round(job, node_id, after)
    assert reply is not None and reply.status == "assigned", reply
    return reply.assignment
