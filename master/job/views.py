"""The job as others see it: ``/v1/info`` and ``/v1/status``, a node's assignment and replication peers
(with their keys), and why the job is where it is. Pure reads of a :class:`~master.job.job.Job` at
``now``: nothing here changes the job.

The waiting reason is the sentence ``/v1/status``, ``elastic-master status`` and the status page show. The
rendezvous decides with its reason (:meth:`master.job.rendezvous.Rendezvous.decide`); the job adds what only
it knows: the outcome, a node-check round waiting for results, a round whose members are finishing. The
master logs the sentence when it changes (:class:`ReasonLog`).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import re
import weakref
from typing import Any

from elastic.control.protocol import (
    Assignment,
    JobInfo,
    JobPhase,
    JobStatus,
    NodeStatus,
    NodeView,
    RoundOpening,
    RoundReply,
    RoundStatus,
    StatusEvent,
)
from elastic.text import printable
from master.job.accounting import Goodput, goodput_of
from master.job.events import Cause, EventKind
from master.job.rendezvous import Phase, Slot, name_list

#: A :class:`master.job.job.Job` (not imported: the job imports this module).
Job = Any

#: Events ``/v1/status`` lists (the newest ones).
STATUS_EVENTS = 20


def job_goodput(job: Job, now: float) -> Goodput:
    """The job's goodput and badput buckets now (master.job.accounting.goodput_of)."""
    until = job.goodput.ended_at if job.goodput.ended_at is not None else now
    return goodput_of(job.goodput, job.stats, job.recovery, job.rdzv.waiting_time(until), now)


def job_status(job: Job, now: float) -> JobStatus:
    """``GET /v1/status``: the job, each node (excluded ones included) and the newest events."""
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
                state=NodeView.EXCLUDED if excluded else NodeView(node.state.value),
                heartbeat_age_s=job.heartbeat_age(node.node_id, now),
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
                state=NodeView.EXCLUDED,
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
        phase = JobPhase.SUCCEEDED if job.outcome.succeeded else JobPhase.FAILED
    else:
        phase = JobPhase.TRAINING if active else JobPhase.RENDEZVOUS
    figures = job_goodput(job, now)
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
        goodput_ratio=figures.ratio,
        badput_s={k: round(v, 3) for k, v in figures.badput_s.items()},
        waiting_reason=waiting_reason(job, now),
        events=recent_events(job, now),
        crash_loop=job.budget.crash_loop.verdict,
        spares=job.rdzv.spares,
    )


def job_info(job: Job) -> JobInfo:
    """``GET /v1/info``: the job's settings an agent checks before it joins."""
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


def assignment(job: Job, slot: Slot) -> Assignment:
    """A member's assignment in the current (closed) round."""
    current = job.rdzv.current
    assert current is not None  # a slot is one of the current round's
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
        check=job.is_check_round(current.number),
        term=job.round_term,
        job_incarnation=job.incarnation,
        opening=round_opening(job),
    )


def replica_targets(job: Job, node_id: str, replicas: int) -> list[tuple[str, str]]:
    """``(node id, HOST:PORT)`` of a node's ring successors in the current round (O(replicas)): those of
    :func:`elastic.checkpoint.shard_layout.ring_targets`, found from the node's rank instead of a search;
    the endpoint is '' while the successor has not reported its replication port.

    Hot spares are replication targets too: spare ``j`` (in join order) receives from the member of node
    rank ``j mod members`` as well, so that each spare already holds a copy of a peer's newest shards
    when it takes a lost member's place (its restore reads its own replicas first). A member thus has
    its ring successors and, after them, the spares it feeds (O(spares / members))."""
    current = job.rdzv.current
    slot = current.slot(node_id) if current is not None else None
    if current is None or slot is None or replicas <= 0:
        return []
    members = current.members
    count = min(replicas, len(members) - 1)
    ring = [members[(slot.node_rank + i) % len(members)] for i in range(1, count + 1)]
    spares = job.rdzv.spares if job.rdzv.spares_count else []
    fed = spares[slot.node_rank :: len(members)]
    peers = []
    for peer in [*ring, *fed]:
        info = job.nodes.get(peer)
        port = info.replication_port if info is not None else None
        host = info.host if info is not None else ""
        peers.append((peer, f"[{host}]:{port}" if ":" in host and port else f"{host}:{port}" if port else ""))
    return peers


def replication_fields(job: Job, node_id: str, replicas: int) -> dict[str, Any]:
    """What a member's heartbeat reply says about peer replication (``CommandReply.peers``, ``peer_keys``,
    ``replication_key``): its successors' endpoints, the pair key for each, and its own receiver key.

    The keys (the formulas of agent.checkpoints.replication_wire): ``R(n) = HMAC-SHA256(secret,
    ["replicate", incarnation, n])`` for node ``n``, and ``K(n→t) = HMAC-SHA256(R(t), ["push", n])``. A
    node learns ``R`` of itself and ``K`` of its own pushes only, so it cannot prove another node's
    identity; the receiver derives ``K`` from its ``R``."""
    targets = replica_targets(job, node_id, replicas)
    return {
        "peers": [endpoint for _, endpoint in targets],
        "peer_keys": [
            pair_key(job.replication_secret, job.incarnation, node_id, t).hex() for t, _ in targets
        ],
        "replication_key": receiver_key(job.replication_secret, job.incarnation, node_id).hex(),
    }


@functools.lru_cache(maxsize=1 << 16)
def receiver_key(secret: str, incarnation: str, node_id: str) -> bytes:
    """``R(node_id)`` (see :func:`replication_fields`); cached: a heartbeat asks for the same keys each
    time, and an HMAC costs microseconds that 10,000 nodes' heartbeats would repeat."""
    message = json.dumps(["replicate", incarnation, node_id], separators=(",", ":")).encode()
    return hmac.digest(bytes.fromhex(secret), message, "sha256")


@functools.lru_cache(maxsize=1 << 16)
def pair_key(secret: str, incarnation: str, sender: str, receiver: str) -> bytes:
    """``K(sender→receiver)`` (see :func:`replication_fields`)."""
    message = json.dumps(["push", sender], separators=(",", ":")).encode()
    return hmac.digest(receiver_key(secret, incarnation, receiver), message, "sha256")


def waiting_reply(job: Job, now: float) -> RoundReply:
    """The reply of a round long-poll that found no round for its node: how the rendezvous stands, for the
    agent's waiting line. O(1) (every waiting node polls about once per agent line interval)."""
    rdzv, s = job.rdzv, job.settings
    standing = rdzv.standing()
    end = standing.last_call_ends_at
    forming = rdzv.phase is Phase.OPEN
    return RoundReply(
        status=RoundStatus.WAITING,
        round=rdzv.round,
        joined=standing.joined,
        min_nodes=s.min_nodes,
        max_nodes=s.max_nodes,
        expected_back=standing.expected_back if forming else None,
        running_nodes=standing.running,
        last_call_ends_in_s=None if end is None else round(max(0.0, end - now), 3),
        opening=round_opening(job) if forming else None,
    )


#: ``round 4 opened (restart: WHY); restarts 1/3``: the message of a round_opened event recorded by a master
#: that did not yet put ``why`` and ``charged`` in its data (read from a store it left).
_OPENED = re.compile(r"^round \d+ opened \((restart|membership change): (.*)\); restarts \d+/\d+$", re.S)
#: The longest ``why`` of a :class:`RoundOpening` (a worker's message may be a whole traceback).
WHY_MAX = 200
#: Per job, the newest :func:`round_opening` and what it was computed from: (event count, round).
_openings: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], RoundOpening | None]] = (
    weakref.WeakKeyDictionary()
)


def round_opening(job: Job) -> RoundOpening | None:
    """Why the master opened its current round (None for the first one), from the job's newest
    ``round_opened`` event and any ``failure_not_counted`` after it (a failure that followed a lost node).
    Remembered per job until an event is recorded: a round's N assignments and the waiting replies read it,
    and finding the event walks back through the events since."""
    number = job.rdzv.round
    if number <= 1:
        return None  # the first round is not opened by an event
    key = (job.event_count, number)
    memo = _openings.get(job)
    if memo is not None and memo[0] == key:
        return memo[1]
    opening = _find_opening(job, number)
    _openings[job] = (key, opening)
    return opening


def _find_opening(job: Job, number: int) -> RoundOpening | None:
    lost_node: str | None = None  # the node whose loss explained the failure (failure_not_counted)
    for event in reversed(job.events):
        if event.kind == EventKind.FAILURE_NOT_COUNTED and lost_node is None:
            lost_node = event.node or "?"
        elif event.kind == EventKind.ROUND_CLOSED and event.round is not None and event.round < number:
            return None  # an earlier round's close: no event opened this one (restored from a store)
        elif event.kind == EventKind.ROUND_OPENED:
            if event.round != number:
                return None
            cause = str(event.cause or "")
            data = event.data or {}
            matched = _OPENED.match(event.message)
            if "why" in data and "charged" in data:
                counted, why = bool(data["charged"]), str(data["why"])
            elif matched is not None:  # recorded by an earlier master, without the data: its wording says
                counted, why = matched.group(1) == "restart", matched.group(2)
            else:  # worded otherwise: its cause says
                counted, why = cause in (Cause.WORKER_FAILURE, Cause.HANG), event.message
            why = _short(why)
            if lost_node is not None:
                counted, cause = False, str(Cause.NODE_LOSS)
                why += f"; it followed the loss of node {lost_node}"
            pending = job.budget.pending
            if pending is not None and not pending.counted:
                counted = False  # the budget was spent: the job fails at the close (master.job.accounting)
            return RoundOpening(
                round=number,
                cause=cause,
                why=why,
                charged=counted,
                restart_count=job.restart_count,
                max_restarts=job.settings.max_restarts,
            )
    return None


def _short(text: str) -> str:
    """The first line of ``text``, at most :data:`WHY_MAX` characters."""
    line = printable(text.strip().splitlines()[0] if text.strip() else "")
    return line if len(line) <= WHY_MAX else line[: WHY_MAX - 3] + "..."


def waiting_reason(job: Job, now: float) -> str:
    """One sentence: what the job waits for (with its deadline) or why it is in its current round."""
    if job.outcome is not None:
        result = "succeeded" if job.outcome.succeeded else "failed"
        return f"finished: the job {result}" + (f" ({job.outcome.summary})" if job.outcome.summary else "")
    rdzv = job.rdzv
    current = rdzv.current
    if rdzv.phase is Phase.ACTIVE and current is not None:
        check = job.node_check
        if current.number in check.rounds and not check.done:
            pending = [m for m in current.members if m not in check.results]
            return f"node check: waiting for the results of {name_list(pending)}"
        if job.succeeded:  # members of this round only; counted, not listed: this runs at every tick
            return f"finishing: {len(job.succeeded)} of {len(current.members)} nodes are done"
    return rdzv.decide(now).reason


def recent_events(job: Job, now: float, limit: int = STATUS_EVENTS) -> list[StatusEvent]:
    """The job's newest ``limit`` events, oldest first, numbered from the job's first event."""
    events = list(job.events)[-limit:]
    first = job.event_count - len(events) + 1
    return [
        StatusEvent(seq=first + i, age_s=max(now - e.at, 0.0), kind=str(e.kind), message=e.message)
        for i, e in enumerate(events)
    ]


class ReasonLog:
    """Logs the job's waiting reason when it changes (not at every tick)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last = ""

    def note(self, job: Job, now: float) -> None:
        reason = waiting_reason(job, now)
        if reason != self._last:
            self._last = reason
            self._log.info("round %d: %s", job.rdzv.round, printable(reason))
