"""The job as ``/v1/info`` and ``/v1/status`` show it."""

from __future__ import annotations

from elastic.control.protocol import (
    JobInfo,
    JobStatus,
    NodeStatus,
)
from master.job.rendezvous import Phase
from master.job.state import JobState
from master.job.wait_reason import recent_events, waiting_reason


def job_status(job: JobState, now: float) -> JobStatus:
    current = job.rdzv.current
    active = job.rdzv.phase is Phase.ACTIVE and current is not None
    rows = []
    for node in [*job.nodes.values(), *job.excluded_nodes.values()]:
        slot = current.slot(node.node_id) if active else None
        excluded = node.node_id in job.excluded_nodes
        verdict = job.node_check.verdicts.get(node.node_id)
        rows.append(
            NodeStatus(
                node_id=node.node_id,
                rank=slot.node_rank if slot and not excluded else None,
                state="excluded" if excluded else node.state.value,
                heartbeat_age_s=job.liveness.age(node.node_id, now),
                restarts=node.failures,
                round=node.round,
                host=node.host,
                nproc=node.nproc,
                step=node.step,
                step_time_s=node.step_time_s,
                compute_time_s=node.pace.compute_time_s,
                straggler=node.node_id in job.stragglers.flagged,
                node_check=job.node_check.results.get(node.node_id),
                node_check_verdict=verdict.describe() if verdict else "",
                persisted_step=node.persisted_step,
                persist_error=node.persist_error,
                replicated_step=node.replicated_step,
                replication_lag=node.replication_lag,
                replication_error=node.replication_error,
                excluded_reason=verdict.describe() if excluded and verdict else "",
            )
        )
    for flapped in job.flapping.excluded.values():
        rows.append(
            NodeStatus(
                node_id=flapped.node_id,
                rank=None,
                state="excluded",
                heartbeat_age_s=None,
                restarts=0,
                round=0,
                host=flapped.host,
                nproc=flapped.nproc,
                excluded_reason=flapped.reason(),
                readmit_in_s=max(0.0, flapped.until - now),
            )
        )
    if job.outcome is not None:
        phase = "succeeded" if job.outcome.succeeded else "failed"
    else:
        phase = "training" if active else "rendezvous"
    return JobStatus(
        job_id=job.settings.job_id,
        master_id=job.master_id,
        phase=phase,
        round=job.rdzv.round,
        world_size=current.world_size if active else 0,
        nnodes=len(current.slots) if active else 0,
        restart_count=job.restart_count,
        max_restarts=job.settings.max_restarts,
        outcome=job.outcome,
        committed_step=job.committed_step,
        persisted_step=max((r.persisted_step for r in rows if r.persisted_step is not None), default=None),
        nodes=rows,
        goodput_ratio=job.goodput.ratio(now),
        waiting_reason=waiting_reason(job, now),
        events=recent_events(job, now),
    )


def job_info(job: JobState) -> JobInfo:
    s = job.settings
    return JobInfo(
        job_id=s.job_id,
        master_id=job.master_id,
        min_nodes=s.min_nodes,
        max_nodes=s.max_nodes,
        node_unit=s.node_unit,
        max_restarts=s.max_restarts,
        heartbeat_interval_s=s.heartbeat_interval_s,
        heartbeat_timeout_s=s.heartbeat_timeout_s,
        last_call_s=s.last_call_s,
        join_timeout_s=s.join_timeout_s,
        node_check=s.node_check,
    )
