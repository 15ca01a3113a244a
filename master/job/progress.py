"""Soft state from heartbeats: the committed and persisted steps, stragglers, persist trouble, and the
recovery phases a round goes through until every member steps. Nothing here is a reason to write the store."""

from __future__ import annotations

from elastic.control.protocol import (
    HeartbeatRequest,
    NodeState,
)
from master.job.node_info import NodeInfo
from master.job.recovery_phases import PHASES
from master.job.rendezvous import Phase
from master.job.state import JobState


def refresh_aggregates(job: JobState, now: float) -> None:
    """The committed step, the persisted count and the straggler flags, computed from tick() every
    AGGREGATE_PERIOD_S (and the committed step before a round opens and before a removal). The first two
    cost O(1) (kept per report); the stragglers' median costs O(members) (paces are kept per heartbeat),
    which is why this is periodic, never per heartbeat: that would make a heartbeat interval of N nodes
    cost O(N^2)."""
    job.aggregates_at = now
    update_committed_step(job)
    update_persisted_count(job, now)
    update_stragglers(job, now)


def note_persist(job: JobState, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
    """Record a node's persist status (soft state); an event only when persisting starts failing or
    recovers, never per step, so that a failing disk does not write the store at every heartbeat."""
    if req.persisted_step is not None:
        node.persisted_step = req.persisted_step
        if job.persisted_newest is None or req.persisted_step > job.persisted_newest:
            job.persisted_newest = req.persisted_step
    if req.persist_error and not node.persist_error:
        job.record(
            now,
            "persist_failed",
            f"node {node.node_id}: checkpoint persist failed: {req.persist_error}",
            node=node.node_id,
        )
    elif node.persist_error and not req.persist_error:
        job.record(
            now,
            "persist_recovered",
            f"node {node.node_id}: checkpoints persist again (persisted step {node.persisted_step})",
            node=node.node_id,
        )
    node.persist_error = req.persist_error


def update_stragglers(job: JobState, now: float) -> None:
    """Re-judge the paces of the running round's members; an event per node that changed."""
    current = job.rdzv.current
    members = current.members if current is not None and job.rdzv.phase is Phase.ACTIVE else []
    nodes, running = job.nodes, NodeState.RUNNING
    paces = {n: node.pace for n in members if (node := nodes.get(n)) is not None and node.state is running}
    for kind, message in job.stragglers.update(paces):
        job.record(now, kind, message)


def note_checkpoint(job: JobState, node: NodeInfo, step: int) -> None:
    """A node of the current round holds checkpoint ``step`` (the committed step follows in tick())."""
    node.ckpt_step = step
    job.ckpt_floor.report(node.node_id, step)


def update_committed_step(job: JobState) -> None:
    """The committed step only moves forward, and only when every member of the round holds it. O(1):
    :class:`master.job.step_floor.StepFloor` follows the members' reports as they come."""
    if job.rdzv.current is None or job.rdzv.phase is not Phase.ACTIVE:
        return
    newest = job.ckpt_floor.floor()
    if newest is not None and (job.committed_step is None or newest > job.committed_step):
        # Soft state (rebuilt from heartbeats after a failover): no store write per step.
        job.committed_step = newest
        job.stats.checkpoints_committed += 1


def update_persisted_count(job: JobState, now: float) -> None:
    """Count the times the newest step some node made durable moved forward (soft state: counted with
    the next save, never a store write of its own)."""
    newest = job.persisted_newest
    if newest is not None and (job.persisted_high is None or newest > job.persisted_high):
        if job.persisted_high is not None:
            job.stats.checkpoints_persisted += 1
        job.persisted_high, job.persisted_at = newest, now


def note_round_progress(job: JobState, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
    """A member's workers started or first stepped in the current round (recovery phases, goodput):
    one event when the last member's did, never one per node."""
    if req.round != job.rdzv.round or not job.rdzv.is_member(node.node_id):
        return
    if req.workers_started_age_s is not None:
        started = job.recovery.node_started(node.node_id, req.round, now - req.workers_started_age_s)
        if started is not None:
            job.record(
                now,
                "workers_started",
                f"round {req.round}: every member started its workers",
                round=req.round,
                data={"at": started},
            )
    if req.first_step_age_s is not None:
        stepped = job.recovery.node_stepped(node.node_id, req.round, now - req.first_step_age_s)
        if stepped is not None:
            at, recovery = stepped
            training = job.training_started(at)
            if recovery is None:
                job.record(
                    now,
                    "first_step",
                    f"round {req.round}: every member stepped; training",
                    round=req.round,
                    data=training,
                )
                return
            phases = ", ".join(f"{p} {recovery.seconds[p]:.2f}s" for p in PHASES)
            job.record(
                now,
                "first_step",
                f"round {req.round}: every member stepped; recovered from {recovery.cause} in "
                f"{recovery.total:.2f}s ({phases})",
                round=req.round,
                cause=recovery.cause,
                durations={**recovery.seconds, "total": recovery.total},
                # The restart phase's end, as the later heartbeats refined it (RecoveryTracker).
                data={**training, "workers_started_at": job.recovery.round.all_started_at},
            )
