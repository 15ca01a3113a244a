"""The job's durable state as plain data (the snapshot the store keeps) and back."""

from __future__ import annotations

from elastic.control.protocol import (
    NodeState,
    Outcome,
)
from master.job.events import restore_events
from master.job.goodput import GoodputAccount
from master.job.node_info import NodeInfo
from master.job.rendezvous import Phase
from master.job.state import JobState
from master.job.stats import JobStats
from master.store.state_schema import SCHEMA_KEY, SCHEMA_VERSION, UnreadableStateError, check_version


def snapshot_of(job: JobState) -> dict:
    """Everything a master taking over needs; plain JSON-able data."""
    return {
        SCHEMA_KEY: SCHEMA_VERSION,
        "job_id": job.settings.job_id,
        "master_id": job.master_id,
        "rendezvous": job.rdzv.snapshot(),
        "nodes": [
            {
                "node_id": n.node_id,
                "host": n.host,
                "nproc": n.nproc,
                "failures": n.failures,
                "secret_hash": n.secret_hash,
            }
            for n in job.nodes.values()
        ],
        "restart_count": job.restart_count,
        "round_term": job.round_term,
        # Soft (not a reason to write), but kept when written: a new leader's first assignments
        # then name a step to restore before heartbeats have reported one.
        "committed_step": job.committed_step,
        "outcome": None if job.outcome is None else job.outcome.model_dump(),
        "round_failed": sorted(job.round_failed),
        "succeeded": sorted(job.succeeded),
        "event_count": job.event_count,
        "events": [e.record() for e in list(job.events)[-100:]],
        "node_check": job.node_check.snapshot(),
        "flapping": job.flapping.snapshot(),
        "goodput": job.goodput.snapshot(),
        "stats": job.stats.snapshot(),
        "recovery": job.recovery.snapshot(),
    }


def restore_into(job: JobState, data: dict, now: float) -> None:
    """Load :func:`snapshot_of` output into a fresh ``job`` of a (new) master. Every known node gets a full
    heartbeat timeout of grace, so that the handover itself never causes a dead-node verdict.

    Raises ValueError, KeyError or TypeError for a state it cannot read (master.store.state_schema)."""
    check_version(data)
    settings, term = job.settings, job.term
    if data.get("job_id") != settings.job_id:
        raise UnreadableStateError(
            f"stored state belongs to job {data.get('job_id')!r}, not {settings.job_id!r}"
        )
    job.rdzv.restore(data["rendezvous"], now)
    for n in data.get("nodes", []):
        job.nodes[n["node_id"]] = NodeInfo(n["node_id"], n["host"], n["nproc"], failures=n["failures"])
        # State written before node credentials has no hash: such a node's requests are refused (403)
        # and its agent says so; one never takes over a node by its id alone.
        job.nodes[n["node_id"]].secret_hash = n.get("secret_hash", "")
    job.rdzv.restrict_expected(job.nodes)  # a forming round expects the previous members still known
    job.restart_count = int(data.get("restart_count", 0))
    job.round_term = int(data.get("round_term", 0))
    job.committed_step = data.get("committed_step")
    job.outcome = Outcome(**data["outcome"]) if data.get("outcome") else None
    job.round_failed = set(data.get("round_failed", []))
    job.succeeded = set(data.get("succeeded", []))
    stored = data.get("events", [])
    job.event_count = int(data.get("event_count", len(stored)))
    job.events.clear()  # the stored events replace this object's own job_started
    job.events.extend(restore_events(stored, job.event_count, now))
    job.forget_effects()  # stored events are not new; the takeover event below is
    job.goodput = GoodputAccount.restore(data.get("goodput"), now)
    job.stats = JobStats.restore(data.get("stats"))
    current = job.rdzv.current
    active = job.rdzv.phase is Phase.ACTIVE and current is not None
    job.recovery.restore(
        data.get("recovery"), current.number if active else None, current.members if active else []
    )
    job.node_check.restore(data.get("node_check"))
    job.ckpt_floor.reset(current.members if active else ())  # the members' reports come with heartbeats
    for node_id, node in job.nodes.items():  # soft state: the first heartbeat tells; until then, the round
        if active and current.has(node_id):
            node.round = current.number
            node.state = NodeState.SUCCEEDED if node_id in job.succeeded else NodeState.RUNNING
    job.flapping.restore(data.get("flapping"))
    for node_id in job.nodes:
        if node_id not in job.succeeded:
            job.liveness.beat(node_id, now)
    job.liveness.grant_grace(now)
    job.record(
        now,
        "master_takeover",
        f"master {job.master_id} took over job {settings.job_id} in round "
        f"{job.rdzv.round} (term {term}, restarts {job.restart_count})",
        data={"term": term, "previous_master": data.get("master_id", "")},
    )
