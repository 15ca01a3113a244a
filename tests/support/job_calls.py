"""Calls of :class:`master.job.job.Job` made the way one agent per node id makes them, for unit tests of the
job state machine: a node's join sends the secret its previous join returned (a rejoin of the same
incarnation), and every later call for the node sends it too (``X-Elastic-Node-Secret`` on the wire).

Tests about credentials themselves call the job directly with the secrets they choose.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from elastic.control.protocol import CommandReply, HeartbeatRequest, JoinReply, JoinRequest, RoundReply
from master.job.job import Job

_SECRETS: WeakKeyDictionary[Job, dict[str, str]] = WeakKeyDictionary()


def secrets_of(job: Job) -> dict[str, str]:
    """Node id -> the secret its last join returned (the agents' memory)."""
    return _SECRETS.setdefault(job, {})


def join(job: Job, req: JoinRequest, now: float) -> JoinReply:
    held = secrets_of(job)
    reply = job.join(req, now, held.get(req.node_id))
    if reply.node_secret:
        held[req.node_id] = reply.node_secret
    return reply


def next_round(job: Job, node_id: str, after: int) -> RoundReply | None:
    return job.next_round(node_id, after, secrets_of(job).get(node_id))


def heartbeat(job: Job, req: HeartbeatRequest, now: float) -> CommandReply:
    return job.heartbeat(req, now, secrets_of(job).get(req.node_id))


def watch(job: Job, node_id: str, node_round: int) -> CommandReply:
    return job.watch(node_id, node_round, secrets_of(job).get(node_id))


def leave(job: Job, node_id: str, reason: str, now: float) -> None:
    job.leave(node_id, reason, now, secrets_of(job).get(node_id))


def connection_lost(job: Job, node_id: str, now: float) -> None:
    job.connection_lost(node_id, now, secrets_of(job).get(node_id))


def restored(original: Job, restored_job: Job) -> Job:
    """``restored_job`` (a :meth:`Job.restore` of ``original``'s snapshot) with the agents' secrets carried
    over: the agents keep theirs across a master takeover."""
    secrets_of(restored_job).update(secrets_of(original))
    return restored_job
