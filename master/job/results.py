"""What a node's report of its result does to the job: a worker failure charges one restart of the world
(provisionally, refunded when a node loss explains it), a success may finish the job, a node-check result may
exclude nodes."""

from __future__ import annotations

from elastic.control.protocol import (
    NodeCheckResult,
    Outcome,
    WorkerFailure,
)
from master.job.events import HANG, NODE_LOSS, WORKER_FAILURE
from master.job.node_info import NodeInfo, describe_failure
from master.job.rendezvous import Phase
from master.job.round_flow import advance, open_round
from master.job.state import EXIT_FAILED, JobState, PendingFailure


def on_failure(job: JobState, node: NodeInfo, failure: WorkerFailure | None, now: float) -> None:
    round_number = job.rdzv.round
    if round_number in job.round_failed:
        return  # already counted: one failure costs one restart of the world
    job.round_failed.add(round_number)
    node.failures += 1
    cause = describe_failure(node.node_id, failure) if failure else f"node {node.node_id} reported a failure"
    # When the agent saw it (its report says how long ago): detection ends now, at the verdict.
    failed_at = now - failure.age_s if failure is not None and failure.age_s is not None else now
    verdict = HANG if failure is not None and failure.kind == "hang" else WORKER_FAILURE
    job.record(
        now,
        "worker_failed",
        f"round {round_number}: {cause}",
        round=round_number,
        node=node.node_id,
        cause=verdict,
        durations={"detect": now - failed_at},
    )
    if job.succeeded:
        job.finish(
            Outcome(
                succeeded=False,
                exit_code=EXIT_FAILED,
                summary=f"{cause} after other nodes had finished; cannot restart",
            ),
            now,
        )
        return
    # The verdict is provisional until the restart round closes: when a peer node dies, the
    # survivors' collectives fail *before* the heartbeat timeout declares it dead, and that is a
    # membership change, not a failure. A member lost before the close refunds the restart (and
    # an exhausted budget fails the job only at the close, when no such loss explains it).
    over_budget = job.restart_count >= job.settings.max_restarts
    if not over_budget:
        job.restart_count += 1
    job.pending_failure = PendingFailure(
        round_number, frozenset(job.rdzv.current.members), cause, not over_budget, node.node_id
    )
    open_round(job, now, cause, counted=True, cause=verdict, began_at=failed_at)
    advance(job, now)


def corroborate(job: JobState, reporter: str, now: float) -> None:
    """``reporter``'s failure report corroborates the suspicion of every other member whose connection
    to the master closed (DESIGN.md, liveness corroboration): each is dead now, not after two more
    heartbeat intervals. A report alone, with no closed connection, stays a suspicion of nobody."""
    pending = job.pending_failure
    members = pending.members if pending is not None else job.rdzv.current.members
    for member in members:
        if member != reporter and job.liveness.suspected(member):
            job.liveness.suspect(member, now, 0.0)
            job.record(
                now,
                "node_suspect",
                f"node {member} closed its connection to the master and node {reporter} reported a failure: "
                "declared dead now",
                node=member,
            )


def attribute_failure_to_loss(job: JobState, node_id: str, now: float, last_seen: float) -> None:
    """The pending failure followed the loss of ``node_id`` (last seen alive at ``last_seen``): a free
    membership change, whose recovery and lost training time start at that last sign of life."""
    pending = job.pending_failure
    if pending is None or node_id not in pending.members or job.rdzv.phase is not Phase.OPEN:
        return
    if pending.counted:
        job.restart_count -= 1
    job.pending_failure = None
    job.recovery.reattribute(NODE_LOSS, broke_at=last_seen)
    stopped = job.goodput.stop_earlier(last_seen)
    job.record(
        now,
        "failure_not_counted",
        f"the failure in round {pending.round} followed the loss of node {node_id}: a membership "
        f"change, not counted (restarts {job.restart_count}/{job.settings.max_restarts})",
        node=node_id,
        cause=NODE_LOSS,
        data={"training": "stopped", "training_at": stopped} if stopped is not None else {},
    )


def on_success(job: JobState, node: NodeInfo, now: float) -> None:
    job.succeeded.add(node.node_id)
    # A finished node stops heartbeating; that is not death.
    job.liveness.forget(node.node_id)
    job.record(
        now,
        "node_succeeded",
        f"node {node.node_id} finished round {job.rdzv.round}",
        round=job.rdzv.round,
        node=node.node_id,
    )
    members = job.rdzv.current.members
    # Counted first: a job of N nodes would otherwise compare N ids at each of its N successes.
    if len(job.succeeded) >= len(members) and job.succeeded.issuperset(members):
        job.finish(Outcome(succeeded=True, exit_code=0, summary="all workers succeeded"), now)


def on_node_check(
    job: JobState, node_id: str, round_number: int, result: NodeCheckResult, now: float
) -> None:
    """A member's node-check result; once every member has one, judge them and open the real round."""
    if not job.node_check.record(node_id, round_number, result):
        return
    job.version += 1
    members = job.rdzv.current.members
    if not job.node_check.complete(members):
        return
    for kind, message in job.node_check.decide(members):
        job.record(now, kind, message)
    for excluded in [m for m in members if m in job.node_check.excluded]:
        job.liveness.forget(excluded)
        job.rdzv.remove(excluded, now)
        job.excluded_nodes[excluded] = job.nodes.pop(excluded)
        job.wake_long_polls(excluded)
    left = [m for m in members if m not in job.node_check.excluded]
    if len(left) < job.settings.min_nodes:
        summary = (
            f"the node check excluded {len(members) - len(left)} of {len(members)} node(s); "
            f"{len(left)} left, at least {job.settings.min_nodes} needed (--nnodes)"
        )
        job.finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary), now)
        return
    open_round(job, now, "node check done", counted=False)
    advance(job, now)
