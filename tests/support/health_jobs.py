"""A real ``master.job.job.Job`` on a fake clock for the health tests (stragglers, node check, status table):
nodes joined, heartbeats with worker progress, node-check results."""

from __future__ import annotations

import job_calls as calls

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeCheckResult, NodeState, WorkerProgress
from master.job.job import Job
from master.job.rendezvous import Phase


def make_job(**overrides) -> Job:
    values: dict = dict(
        job_id="job-1",
        min_nodes=2,
        max_nodes=3,
        last_call_s=1.0,
        join_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=4.0,
    )
    values.update(overrides)
    return Job(JobSettings(**values), now=0.0)


def join_all(job: Job, now: float, *node_ids: str) -> None:
    for i, node_id in enumerate(node_ids):
        calls.join(
            job,
            JoinRequest(
                node_id=node_id,
                host=f"10.0.0.{i + 1}",
                nproc=1,
                store_port=29500 + i,
                min_nodes=job.settings.min_nodes,
                max_nodes=job.settings.max_nodes,
            ),
            now,
        )
    job.tick(now)
    assert job.rdzv.phase is Phase.ACTIVE


def beat(job: Job, node_id: str, now: float, **fields):
    values: dict = dict(node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING)
    values.update(fields)
    return calls.heartbeat(job, HeartbeatRequest(**values), now)


def progress(step_time: float, compute: float | None = None) -> list[WorkerProgress]:
    return [WorkerProgress(local_rank=0, step=5, step_time_s=step_time, compute_time_s=compute)]


def check(ok: bool = True, matmul: float | None = 0.01, allreduce: float | None = 0.002, **fields):
    return NodeCheckResult(ok=ok, matmul_s=matmul, allreduce_s=allreduce, device="cpu", **fields)
