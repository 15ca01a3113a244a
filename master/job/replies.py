"""What the job answers a node: its command, its assignment, its replication peers."""

from __future__ import annotations

from elastic.control.protocol import (
    Assignment,
    Command,
    CommandReply,
    Outcome,
)
from master.job.rendezvous import Phase
from master.job.state import EXIT_FAILED, JobState


def command_reply(job: JobState, command: Command) -> CommandReply:
    """The reply naming ``command`` and the job's round. Replies are frozen, so one object per (command,
    round, term) serves every node while the job runs (a steady heartbeat builds no model)."""
    if job.outcome is not None:
        return _build(job, command)
    key = (command, job.rdzv.round, job.round_term)
    reply = job.replies.get(key)
    if reply is None:
        if len(job.replies) >= 16:  # only the current round's few commands are asked for
            job.replies.clear()
        reply = job.replies[key] = _build(job, command)
    return reply


def _build(job: JobState, command: Command) -> CommandReply:
    return CommandReply(
        command=command,
        round=job.rdzv.round,
        term=job.round_term,
        outcome=job.outcome,
        master_id=job.master_id,
    )


def assignment(job: JobState, slot) -> Assignment:
    current = job.rdzv.current
    # Built from the job's own checked values, without validation: validating the member list (one entry
    # per node) for each of N nodes made a round's assignments cost O(N^2) (84 us each at 10,000 nodes).
    return Assignment.model_construct(
        round=current.number,
        node_rank=slot.node_rank,
        nnodes=len(current.slots),
        rank_offset=slot.rank_offset,
        world_size=current.world_size,
        master_addr=current.master_addr,
        master_port=current.master_port,
        restart_count=job.restart_count,
        max_restarts=job.settings.max_restarts,
        members=current.members,
        committed_step=job.committed_step,
        check=job.node_check.covers(current.number),
        term=job.round_term,
    )


def exclude_reply(job: JobState, node_id: str) -> CommandReply:
    """Tell an excluded node's agent to stop, with the line it exits with (:meth:`JobState.exclusion`)."""
    summary = job.exclusion(node_id) or f"node {node_id} was excluded from the job"
    return CommandReply(
        command=Command.EXCLUDE,
        round=job.rdzv.round,
        outcome=Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary),
        master_id=job.master_id,
    )


def replica_targets(job: JobState, node_id: str, replicas: int) -> list[str]:
    """The replication endpoints of a node's ring successors in the current round (O(replicas)): those of
    :func:`elastic.checkpoint.shard_layout.ring_targets`, found from the node's rank instead of a search."""
    current = job.rdzv.current
    slot = current.slot(node_id) if current is not None else None
    if slot is None or replicas <= 0:
        return []
    members = current.members
    count = min(replicas, len(members) - 1)
    peers = []
    for peer in (members[(slot.node_rank + i) % len(members)] for i in range(1, count + 1)):
        info = job.nodes.get(peer)
        port = info.replication_port if info is not None else None
        host = info.host if info is not None else ""
        peers.append(f"[{host}]:{port}" if ":" in host and port else f"{host}:{port}" if port else "")
    return peers


def command_for(job: JobState, node_id: str, node_round: int, node_term: int | None = None) -> CommandReply:
    """What a node whose workers run in round ``(node_term, node_round)`` must do now (heartbeat and
    watch). ``node_term`` None (an agent without terms) compares round numbers alone."""
    if job.outcome is not None:
        return command_reply(job, Command.STOP)
    if job.exclusion(node_id) is not None:
        return exclude_reply(job, node_id)
    if node_round and (node_round != job.rdzv.round or job.rdzv.phase is Phase.OPEN):
        return command_reply(job, Command.REJOIN)
    if node_round and not job.rdzv.is_member(node_id):
        return command_reply(job, Command.REJOIN)
    if node_round and node_term is not None and node_term != job.round_term:
        # The same number under another term is another world (a leader that never stored it).
        return command_reply(job, Command.REJOIN)
    return command_reply(job, Command.CONTINUE)
