"""The job state machine: rendezvous + liveness + restarts + outcome. Pure: no I/O, time is ``now``.

The HTTP server is a thin shell: it calls these methods, and wakes long-polls whenever
:attr:`Job.version` changes. Every state change appends one :class:`Event`, which the server logs as
one line and the status view reads.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field

from elastic.job_settings import JobSettings
from elastic.protocol import (
    NODE_SECRET_HEADER,
    Assignment,
    Command,
    CommandReply,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    NodeCheckResult,
    NodeState,
    NodeStatus,
    Outcome,
    RoundReply,
    WorkerFailure,
    WorkerProgress,
)
from elastic.shard_layout import ring_targets
from master.credentials import JoinKind, hash_secret, judge_join, matches, new_secret
from master.goodput import GoodputAccount
from master.job_effects import Effects, EffectsBuffer
from master.job_events import HANG, NODE_LOSS, SCALE_UP, WORKER_FAILURE, Event, restore_events
from master.job_stats import JobStats
from master.liveness import Liveness
from master.node_check import NodeCheck
from master.recovery_phases import PHASES, RecoveryTracker
from master.rendezvous import Candidate, Phase, Rendezvous
from master.state_schema import SCHEMA_KEY, SCHEMA_VERSION, UnreadableStateError, check_version
from master.stragglers import StragglerTracker, node_pace
from master.wait_reason import recent_events, waiting_reason

EXIT_FAILED = 1
#: Seconds between two computations of the job-wide aggregates (committed step, stragglers) in tick().
AGGREGATE_PERIOD_S = 0.5


class JobError(Exception):
    """Base of the errors a request can cause; ``code`` names it on the wire."""

    code = "job_error"
    http_status = 400


class UnknownNodeError(JobError):
    code = "unknown_node"
    http_status = 404


class SettingsMismatchError(JobError):
    code = "settings_mismatch"
    http_status = 409


class NodeExcludedError(JobError):
    code = "node_excluded"
    http_status = 409


class BadNodeSecretError(JobError):
    """A request for a known node without that node's current secret (master.credentials)."""

    code = "bad_node_secret"
    http_status = 403


class DuplicateNodeError(JobError):
    """A join under the id of a node whose agent is alive, without that agent's secret."""

    code = "duplicate_node"
    http_status = 409


@dataclass(frozen=True)
class _PendingFailure:
    """A worker failure whose restart is charged provisionally until the restart round closes."""

    round: int
    members: frozenset[str]
    cause: str
    counted: bool  # False when the budget was already spent: the job fails at the close


@dataclass
class NodeInfo:
    node_id: str
    host: str
    nproc: int
    state: NodeState = NodeState.WAITING
    round: int = 0
    failures: int = 0
    workers: list[WorkerProgress] = field(default_factory=list)
    ckpt_step: int | None = None
    #: Hash of the current incarnation's secret (durable; master.credentials); never the secret itself.
    secret_hash: str = ""
    # Soft state from heartbeats (never stored): the node's durable checkpoint and its persist trouble.
    persisted_step: int | None = None
    persist_error: str = ""
    # Soft state: peer replication of its memory checkpoints (agent.replication).
    replication_port: int | None = None
    replicated_step: int | None = None
    replication_lag: int | None = None
    replication_error: str = ""
    joined_at: float | None = None  # when it last joined (a scale-up's detection starts there)

    @property
    def step(self) -> int | None:
        steps = [w.step for w in self.workers if w.step is not None]
        return min(steps) if steps else None

    @property
    def step_time_s(self) -> float | None:
        times = [w.step_time_s for w in self.workers if w.step_time_s is not None]
        return max(times) if times else None  # the node is as slow as its slowest worker


def _describe_failure(node_id: str, failure: WorkerFailure) -> str:
    text = f"rank {failure.rank} (local rank {failure.local_rank} on node {node_id})"
    if failure.kind == "hang":
        text += " hung"  # the message says how (no step for ..., process stopped ...)
    else:
        how = f"signal {failure.signal}" if failure.signal else f"exit code {failure.exit_code}"
        text += f" failed with {how}"
    if failure.message:
        text += f": {failure.message.strip()}"
    return text


class Job:
    """All master-side state of one job."""

    def __init__(
        self, settings: JobSettings, now: float, master_id: str | None = None, term: int = 0
    ) -> None:
        self.settings = settings
        self.master_id = master_id or uuid.uuid4().hex[:12]
        self.rdzv = Rendezvous(settings)
        self.liveness = Liveness(settings.heartbeat_timeout_s)
        self.nodes: dict[str, NodeInfo] = {}
        self.restart_count = 0
        self.committed_step: int | None = None  # newest checkpoint step every rank holds
        self.outcome: Outcome | None = None
        self.events: deque[Event] = deque(maxlen=1000)
        self.event_count = 0  # events ever recorded (the deque keeps the newest)
        #: Bumped by every change of durable state (master.job_effects): what the store must hold before a
        #: reply reveals it. Soft state (steps, committed step, heartbeat ages) never bumps it.
        self.version = 0
        #: The leader's term (master.store.StateStore.term), set by the server when it leads.
        self.term = term
        #: The term in which the current round number was opened: a round is ``(round_term, number)``.
        self.round_term = 0
        self._effects = EffectsBuffer()
        self._round_failed: set[int] = set()  # rounds whose failure was already counted
        self._pending_failure: _PendingFailure | None = None
        self._succeeded: set[str] = set()  # members of the current round that finished
        self.started_at = now
        self.stragglers = StragglerTracker(settings.straggler_factor)
        self.node_check = NodeCheck(settings.node_check, settings.node_check_factor)
        self.excluded_nodes: dict[str, NodeInfo] = {}  # by the node check; kept for the status view
        self.removed_count = 0  # nodes ever removed (dead, left, excluded): part of long_poll_key()
        self._aggregates_at = float("-inf")  # when _refresh_aggregates() last ran
        self.goodput = GoodputAccount(started_at=now)
        self.recovery = RecoveryTracker()
        self.stats = JobStats()
        self._persisted_high: int | None = None  # newest persisted step seen (counts persisted checkpoints)
        self.persisted_at: float | None = None  # when it last moved forward (soft state)
        self._event(now, "job_started", f"job {settings.job_id} started (master {self.master_id})")

    # -- requests ---------------------------------------------------------------------------------
    def info(self) -> JobInfo:
        s = self.settings
        return JobInfo(
            job_id=s.job_id,
            master_id=self.master_id,
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

    def join(self, req: JoinRequest, now: float, node_secret: str | None = None) -> JoinReply:
        """A node asks to take part in the next round. ``node_secret``: the secret the join carries, if
        any. A join for an id whose agent is alive must carry that agent's secret (a rejoin, which keeps
        it); without it, it is a duplicate (:class:`DuplicateNodeError`). Any other join starts a new
        incarnation of the id with a new secret (:func:`master.credentials.judge_join`)."""
        s = self.settings
        if (req.min_nodes, req.max_nodes) != (s.min_nodes, s.max_nodes):
            raise SettingsMismatchError(
                f"node {req.node_id} asks for --nnodes {req.min_nodes}:{req.max_nodes} but job "
                f"{s.job_id} runs with {s.min_nodes}:{s.max_nodes}; start every agent with the same --nnodes"
            )
        if req.node_id in self.node_check.excluded:
            raise NodeExcludedError(self.node_check.excluded[req.node_id])
        if self.outcome is not None:
            # Nothing left to take part in, so no credential: the agent learns the outcome from /v1/round.
            return JoinReply(round=self.rdzv.round, master_id=self.master_id, node_secret="")
        node = self.nodes.get(req.node_id)
        kind = judge_join(node.secret_hash if node else None, self._alive(req.node_id, now), node_secret)
        if kind is JoinKind.DUPLICATE:
            raise DuplicateNodeError(
                f"node id {req.node_id} is in use by another live agent of job {self.settings.job_id}; give "
                f"every agent its own --node-id (a restarted agent is let in once the master declares the "
                f"previous one dead, within {self.settings.heartbeat_timeout_s:g}s of its last heartbeat)"
            )
        secret = node_secret if kind is JoinKind.REJOIN and node_secret else new_secret()
        if kind is JoinKind.REPLACE:
            closed = self.liveness.suspected(req.node_id)
            why = "its connection to the master closed" if closed else "it stopped heartbeating"
            self._event(
                now, "node_replaced", f"node {req.node_id}: a new agent replaced the previous one ({why})"
            )
        was_member = self.rdzv.is_member(req.node_id)
        if node is None:
            node = self.nodes[req.node_id] = NodeInfo(req.node_id, req.host, req.nproc)
        node.host, node.nproc, node.state = req.host, req.nproc, NodeState.WAITING
        node.joined_at = now
        node.secret_hash = hash_secret(secret)
        self.liveness.beat(req.node_id, now)
        self.rdzv.join(Candidate(req.node_id, req.host, req.nproc, req.store_port, now), now)
        joined = f"node {req.node_id} ({req.host}, {req.nproc} workers) joined"
        self._event(now, "node_joined", joined, node=req.node_id)
        if was_member and self._succeeded:
            why = f"member {req.node_id} restarted after other nodes had finished; cannot restart"
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=why), now)
        elif was_member:
            # A member joining a running round means its agent restarted: a membership change.
            self._open_round(now, f"member {req.node_id} rejoined", counted=False, cause=NODE_LOSS)
        self._advance(now)
        return JoinReply(round=self.rdzv.round, master_id=self.master_id, node_secret=secret)

    def next_round(self, node_id: str, after: int, node_secret: str | None) -> RoundReply | None:
        """The node's assignment in a round newer than ``after``; None while there is none yet. A finished
        job's outcome is answered to any caller (``GET /v1/status`` shows it too); anything else needs the
        node's secret."""
        if self.outcome is not None:
            return RoundReply(status="finished", outcome=self.outcome, round=self.rdzv.round)
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} has not joined job {self.settings.job_id}")
        self._authenticate(self.nodes[node_id], node_secret)
        current = self.rdzv.current
        if self.rdzv.phase is Phase.ACTIVE and current and current.number > after:
            slot = current.slot(node_id)
            if slot is not None:
                return RoundReply(status="assigned", assignment=self._assignment(slot), round=current.number)
        if not self.rdzv.has_joined(node_id) and not self.rdzv.is_member(node_id):
            raise UnknownNodeError(f"node {node_id} is not waiting for a round; join first")
        return None

    def heartbeat(self, req: HeartbeatRequest, now: float, node_secret: str | None) -> CommandReply:
        """Record a node's state; act on a failure or success; say what the node must do. Raises
        :class:`BadNodeSecretError`, having changed nothing, when ``node_secret`` is not the node's."""
        node = self.nodes.get(req.node_id)
        if node is None:
            if self.outcome is not None:
                return self._reply(Command.STOP)
            if req.node_id in self.node_check.excluded:
                return self._exclude_reply(req.node_id)
            raise UnknownNodeError(
                f"node {req.node_id} is not part of job {self.settings.job_id}; join first"
            )
        self._authenticate(node, node_secret)
        if req.node_id not in self._succeeded:  # a finished node is no longer watched for liveness
            self.liveness.beat(req.node_id, now)
        node.workers = list(req.workers)
        self._note_persist(node, req, now)
        node.replication_port, node.replicated_step = req.replication_port, req.replicated_step
        node.replication_lag, node.replication_error = req.replication_lag, req.replication_error
        self._note_round_progress(node, req, now)
        if req.ckpt_step is not None and req.round == self.rdzv.round:
            node.ckpt_step = req.ckpt_step  # the committed step follows in tick() (_refresh_aggregates)
        current_round = (
            req.round == self.rdzv.round
            and (req.term is None or req.term == self.round_term)
            and self.rdzv.is_member(req.node_id)
        )
        if current_round and node.state != req.state:
            node.state, node.round = req.state, req.round
            self.version += 1
        if current_round and req.state is NodeState.FAILED and self.outcome is None:
            self._on_failure(node, req.failure, now)
        elif current_round and req.node_check is not None and self.outcome is None:
            self._on_node_check(req.node_id, req.round, req.node_check, now)
        elif (
            current_round
            and req.state is NodeState.SUCCEEDED
            and self.outcome is None
            and node.node_id not in self._succeeded  # repeated reports are not new transitions
        ):
            self._on_success(node, now)
        reply = self.command_for(req.node_id, req.round, req.term)
        if req.replicas and reply.command is Command.CONTINUE and self.rdzv.is_member(req.node_id):
            reply = reply.model_copy(update={"peers": self._replica_targets(req.node_id, req.replicas)})
        return reply

    def _replica_targets(self, node_id: str, replicas: int) -> list[str]:
        """The replication endpoints of a node's ring successors in the current round (O(replicas))."""
        peers = []
        for peer in ring_targets(self.rdzv.current.members, node_id, replicas):
            info = self.nodes.get(peer)
            port = info.replication_port if info is not None else None
            host = info.host if info is not None else ""
            peers.append(f"[{host}]:{port}" if ":" in host and port else f"{host}:{port}" if port else "")
        return peers

    def leave(self, node_id: str, reason: str, now: float, node_secret: str | None) -> None:
        """Orderly departure (the agent was told to stop, e.g. preemption): a membership change."""
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}")
        self._authenticate(self.nodes[node_id], node_secret)
        self._remove(node_id, f"node {node_id} left" + (f" ({reason})" if reason else ""), "node_left", now)
        self._advance(now)

    def connection_lost(self, node_id: str, now: float, node_secret: str | None) -> None:
        """A node's agent closed a long-poll before the answer. Its process most likely died (the kernel
        closes a dead process's connections): unless it heartbeats within two heartbeat intervals it is
        declared dead then, not only after the whole heartbeat timeout. A machine that vanishes closes
        nothing; the heartbeat timeout still covers it. Only the connection of a request that carried the
        node's current secret counts (not one of a replaced incarnation, nor anybody else's)."""
        node = self.nodes.get(node_id)
        if self.outcome is not None or node is None or node_id in self._succeeded:
            return
        if not matches(node.secret_hash, node_secret):
            return
        s = self.settings
        within = min(2 * s.heartbeat_interval_s, s.heartbeat_timeout_s)
        self.liveness.suspect(node_id, now, within)
        self._event(
            now,
            "node_suspect",
            f"node {node_id} closed its connection to the master; declared dead unless it heartbeats "
            f"within {within:g}s",
            node=node_id,
        )

    def watch(
        self, node_id: str, node_round: int, node_secret: str | None, node_term: int | None = None
    ) -> CommandReply:
        """:meth:`command_for` for a node's watch long-poll. A node this master does not know gets
        :class:`UnknownNodeError`, as its heartbeat does: a master restarted without a durable store (or
        one that declared the node dead) must say so, not answer "rejoin" as if it had opened a round. A
        known node's secret is checked while the job runs (a finished job's outcome is no secret)."""
        if self.outcome is None and node_id in self.node_check.excluded:
            return self._exclude_reply(node_id)
        if self.outcome is None and node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}; join first")
        if self.outcome is None:
            self._authenticate(self.nodes[node_id], node_secret)
        return self.command_for(node_id, node_round, node_term)

    def command_for(self, node_id: str, node_round: int, node_term: int | None = None) -> CommandReply:
        """What a node whose workers run in round ``(node_term, node_round)`` must do now (heartbeat and
        watch). ``node_term`` None (an agent without terms) compares round numbers alone."""
        if self.outcome is not None:
            return self._reply(Command.STOP)
        if node_id in self.node_check.excluded:
            return self._exclude_reply(node_id)
        if node_round and (node_round != self.rdzv.round or self.rdzv.phase is Phase.OPEN):
            return self._reply(Command.REJOIN)
        if node_round and not self.rdzv.is_member(node_id):
            return self._reply(Command.REJOIN)
        if node_round and node_term is not None and node_term != self.round_term:
            # The same number under another term is another world (a leader that never stored it).
            return self._reply(Command.REJOIN)
        return self._reply(Command.CONTINUE)

    # -- time -------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply every time-driven transition: dead nodes, round close, growth, join timeout."""
        if self.outcome is not None:
            return
        if now - self._aggregates_at >= AGGREGATE_PERIOD_S:
            self._refresh_aggregates(now)
        for node_id in self.liveness.dead(now):
            age = self.liveness.age(node_id, now)
            why = " after closing its connection" if self.liveness.suspected(node_id) else ""
            self._remove(
                node_id,
                f"node {node_id} declared dead (no heartbeat for {age:.1f}s{why})",
                "node_dead",
                now,
                began_at=now - age if age is not None else now,  # its last heartbeat
            )
            if self.outcome is not None:
                return
        self._advance(now)

    # -- effects ----------------------------------------------------------------------------------
    def take_effects(self) -> Effects:
        """What the mutations since the last call did: the events they recorded, whether durable state
        changed (the store must hold :attr:`version` before a reply reveals it) and whether a pending
        long-poll may now answer differently. The server calls this after every request and tick."""
        return self._effects.take(self.version)

    # -- views ------------------------------------------------------------------------------------
    def long_poll_key(self) -> tuple:
        """A value that changes whenever :meth:`next_round` or :meth:`watch` may answer differently for
        some node: a round opened or closed, a node removed or excluded, the job finished. Joins of
        nodes that wait and heartbeats that only report progress leave it alone, so that the master does
        not wake every pending long-poll of a large job on each of them (O(N^2) wake-ups)."""
        return (
            self.outcome is not None,
            self.rdzv.round,
            self.rdzv.phase,
            self.removed_count,
            len(self.node_check.excluded),
        )

    def status(self, now: float) -> JobStatus:
        current = self.rdzv.current
        active = self.rdzv.phase is Phase.ACTIVE and current is not None
        rows = []
        for node in [*self.nodes.values(), *self.excluded_nodes.values()]:
            slot = current.slot(node.node_id) if active else None
            excluded = node.node_id in self.excluded_nodes
            verdict = self.node_check.verdicts.get(node.node_id)
            rows.append(
                NodeStatus(
                    node_id=node.node_id,
                    rank=slot.node_rank if slot and not excluded else None,
                    state="excluded" if excluded else node.state.value,
                    heartbeat_age_s=self.liveness.age(node.node_id, now),
                    restarts=node.failures,
                    round=node.round,
                    host=node.host,
                    nproc=node.nproc,
                    step=node.step,
                    step_time_s=node.step_time_s,
                    compute_time_s=node_pace(node.workers).compute_time_s,
                    straggler=node.node_id in self.stragglers.flagged,
                    node_check=self.node_check.results.get(node.node_id),
                    node_check_verdict=verdict.describe() if verdict else "",
                    persisted_step=node.persisted_step,
                    persist_error=node.persist_error,
                    replicated_step=node.replicated_step,
                    replication_lag=node.replication_lag,
                    replication_error=node.replication_error,
                )
            )
        if self.outcome is not None:
            phase = "succeeded" if self.outcome.succeeded else "failed"
        else:
            phase = "training" if active else "rendezvous"
        return JobStatus(
            job_id=self.settings.job_id,
            master_id=self.master_id,
            phase=phase,
            round=self.rdzv.round,
            world_size=current.world_size if active else 0,
            nnodes=len(current.slots) if active else 0,
            restart_count=self.restart_count,
            max_restarts=self.settings.max_restarts,
            outcome=self.outcome,
            committed_step=self.committed_step,
            persisted_step=max(
                (r.persisted_step for r in rows if r.persisted_step is not None), default=None
            ),
            nodes=rows,
            goodput_ratio=self.goodput.ratio(now),
            waiting_reason=waiting_reason(self, now),
            events=recent_events(self, now),
        )

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything a master taking over needs; plain JSON-able data."""
        return {
            SCHEMA_KEY: SCHEMA_VERSION,
            "job_id": self.settings.job_id,
            "master_id": self.master_id,
            "rendezvous": self.rdzv.snapshot(),
            "nodes": [
                {
                    "node_id": n.node_id,
                    "host": n.host,
                    "nproc": n.nproc,
                    "state": n.state.value,
                    "round": n.round,
                    "failures": n.failures,
                    "secret_hash": n.secret_hash,
                }
                for n in self.nodes.values()
            ],
            "restart_count": self.restart_count,
            "round_term": self.round_term,
            # Soft (not a reason to write), but kept when written: a new leader's first assignments
            # then name a step to restore before heartbeats have reported one.
            "committed_step": self.committed_step,
            "outcome": None if self.outcome is None else self.outcome.model_dump(),
            "round_failed": sorted(self._round_failed),
            "succeeded": sorted(self._succeeded),
            "event_count": self.event_count,
            "events": [e.record() for e in list(self.events)[-100:]],
            "node_check": self.node_check.snapshot(),
            "goodput": self.goodput.snapshot(),
            "stats": self.stats.snapshot(),
            "recovery": self.recovery.snapshot(),
        }

    @classmethod
    def restore(
        cls, settings: JobSettings, data: dict, now: float, master_id: str | None = None, term: int = 0
    ) -> Job:
        """A job continued from :meth:`snapshot` by a (new) master. Every known node gets a full
        heartbeat timeout of grace, so that the handover itself never causes a dead-node verdict.

        Raises ValueError, KeyError or TypeError for a state it cannot read (master.state_schema)."""
        check_version(data)
        if data.get("job_id") != settings.job_id:
            raise UnreadableStateError(
                f"stored state belongs to job {data.get('job_id')!r}, not {settings.job_id!r}"
            )
        job = cls(settings, now, master_id, term)
        job.rdzv.restore(data["rendezvous"], now)
        for n in data.get("nodes", []):
            job.nodes[n["node_id"]] = NodeInfo(
                n["node_id"], n["host"], n["nproc"], NodeState(n["state"]), n["round"], n["failures"]
            )
            # State written before node credentials has no hash: such a node's requests are refused (403)
            # and its agent says so; one never takes over a node by its id alone.
            job.nodes[n["node_id"]].secret_hash = n.get("secret_hash", "")
        job.restart_count = int(data.get("restart_count", 0))
        job.round_term = int(data.get("round_term", 0))
        job.committed_step = data.get("committed_step")
        job.outcome = Outcome(**data["outcome"]) if data.get("outcome") else None
        job._round_failed = set(data.get("round_failed", []))
        job._succeeded = set(data.get("succeeded", []))
        stored = data.get("events", [])
        job.event_count = int(data.get("event_count", len(stored)))
        job.events.clear()  # the stored events replace this object's own job_started
        job.events.extend(restore_events(stored, job.event_count, now))
        job._effects = EffectsBuffer()  # stored events are not new; the takeover event below is
        job.goodput = GoodputAccount.restore(data.get("goodput"), now)
        job.stats = JobStats.restore(data.get("stats"))
        current = job.rdzv.current
        active = job.rdzv.phase is Phase.ACTIVE and current is not None
        job.recovery.restore(
            data.get("recovery"), current.number if active else None, current.members if active else []
        )
        job.node_check.restore(data.get("node_check"))
        for node_id in job.nodes:
            if node_id not in job._succeeded:
                job.liveness.beat(node_id, now)
        job.liveness.grant_grace(now)
        job._event(
            now,
            "master_takeover",
            f"master {job.master_id} took over job {settings.job_id} in round "
            f"{job.rdzv.round} (term {term}, restarts {job.restart_count})",
            data={"term": term, "previous_master": data.get("master_id", "")},
        )
        return job

    # -- internals --------------------------------------------------------------------------------
    def _alive(self, node_id: str, now: float) -> bool:
        """Whether the id's current incarnation is alive: joined, not dead, left or excluded (those leave
        :attr:`nodes`), heard from within the heartbeat timeout with no closed connection since, or
        finished (its agent may still wait for the job's outcome)."""
        if node_id not in self.nodes:
            return False
        return node_id in self._succeeded or self.liveness.alive(node_id, now)

    def _authenticate(self, node: NodeInfo, node_secret: str | None) -> None:
        """Raise :class:`BadNodeSecretError` unless ``node_secret`` is the node's current secret."""
        if matches(node.secret_hash, node_secret):
            return
        if not node_secret:
            raise BadNodeSecretError(
                f"request for node {node.node_id} carries no node secret ({NODE_SECRET_HEADER}); only the "
                f"agent that joined as {node.node_id} may act for it"
            )
        raise BadNodeSecretError(
            f"wrong node secret for node {node.node_id}: another agent joined as {node.node_id} since "
            f"(give every agent its own --node-id), or the request does not come from its agent"
        )

    def _reply(self, command: Command) -> CommandReply:
        return CommandReply(
            command=command,
            round=self.rdzv.round,
            term=self.round_term,
            outcome=self.outcome,
            master_id=self.master_id,
        )

    def _assignment(self, slot) -> Assignment:
        current = self.rdzv.current
        return Assignment(
            round=current.number,
            node_rank=slot.node_rank,
            nnodes=len(current.slots),
            rank_offset=slot.rank_offset,
            world_size=current.world_size,
            master_addr=current.master_addr,
            master_port=current.master_port,
            restart_count=self.restart_count,
            max_restarts=self.settings.max_restarts,
            members=current.members,
            committed_step=self.committed_step,
            check=self.node_check.covers(current.number),
            term=self.round_term,
        )

    def _exclude_reply(self, node_id: str) -> CommandReply:
        summary = self.node_check.excluded[node_id]
        return CommandReply(
            command=Command.EXCLUDE,
            round=self.rdzv.round,
            outcome=Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary),
            master_id=self.master_id,
        )

    def _refresh_aggregates(self, now: float) -> None:
        """The committed step and the straggler flags. Each costs O(members), so they are computed from
        tick() every AGGREGATE_PERIOD_S (and the committed step before a round opens), never per heartbeat:
        that would make a heartbeat interval of N nodes cost O(N^2)."""
        self._aggregates_at = now
        self._update_committed_step()
        self._update_persisted_count(now)
        self._update_stragglers(now)

    def _note_persist(self, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
        """Record a node's persist status (soft state); an event only when persisting starts failing or
        recovers, never per step, so that a failing disk does not write the store at every heartbeat."""
        if req.persisted_step is not None:
            node.persisted_step = req.persisted_step
        if req.persist_error and not node.persist_error:
            self._event(
                now,
                "persist_failed",
                f"node {node.node_id}: checkpoint persist failed: {req.persist_error}",
                node=node.node_id,
            )
        elif node.persist_error and not req.persist_error:
            self._event(
                now,
                "persist_recovered",
                f"node {node.node_id}: checkpoints persist again (persisted step {node.persisted_step})",
                node=node.node_id,
            )
        node.persist_error = req.persist_error

    def _update_stragglers(self, now: float) -> None:
        """Re-judge the paces of the running round's members; an event per node that changed."""
        current = self.rdzv.current
        members = current.members if current is not None and self.rdzv.phase is Phase.ACTIVE else []
        paces = {
            n: node_pace(self.nodes[n].workers)
            for n in members
            if n in self.nodes and self.nodes[n].state is NodeState.RUNNING
        }
        for kind, message in self.stragglers.update(paces):
            self._event(now, kind, message)

    def _on_node_check(self, node_id: str, round_number: int, result: NodeCheckResult, now: float) -> None:
        """A member's node-check result; once every member has one, judge them and open the real round."""
        if not self.node_check.record(node_id, round_number, result):
            return
        self.version += 1
        members = self.rdzv.current.members
        if not self.node_check.complete(members):
            return
        for kind, message in self.node_check.decide(members):
            self._event(now, kind, message)
        for excluded in [m for m in members if m in self.node_check.excluded]:
            self.liveness.forget(excluded)
            self.rdzv.remove(excluded, now)
            self.excluded_nodes[excluded] = self.nodes.pop(excluded)
            self._effects.wake = True
        left = [m for m in members if m not in self.node_check.excluded]
        if len(left) < self.settings.min_nodes:
            summary = (
                f"the node check excluded {len(members) - len(left)} of {len(members)} node(s); "
                f"{len(left)} left, at least {self.settings.min_nodes} needed (--nnodes)"
            )
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary), now)
            return
        self._open_round(now, "node check done", counted=False)
        self._advance(now)

    def _update_committed_step(self) -> None:
        """The committed step only moves forward, and only when every member of the round holds it."""
        current = self.rdzv.current
        if current is None or self.rdzv.phase is not Phase.ACTIVE:
            return
        steps = [self.nodes[n].ckpt_step if n in self.nodes else None for n in current.members]
        if steps and all(s is not None for s in steps):
            newest = min(steps)
            if self.committed_step is None or newest > self.committed_step:
                # Soft state (rebuilt from heartbeats after a failover): no store write per step.
                self.committed_step = newest
                self.stats.checkpoints_committed += 1

    def _update_persisted_count(self, now: float) -> None:
        """Count the times the newest step some node made durable moved forward (soft state: counted with
        the next save, never a store write of its own)."""
        steps = [n.persisted_step for n in self.nodes.values() if n.persisted_step is not None]
        newest = max(steps, default=None)
        if newest is not None and (self._persisted_high is None or newest > self._persisted_high):
            if self._persisted_high is not None:
                self.stats.checkpoints_persisted += 1
            self._persisted_high, self.persisted_at = newest, now

    def _is_check_round(self, number: int) -> bool:
        """Whether round ``number`` is (or, closing while the check is pending, becomes) a node-check
        round, which trains nothing (read-only, unlike NodeCheck.covers)."""
        check = self.node_check
        return check.mode != "off" and (number in check.rounds or not check.done)

    def _note_round_progress(self, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
        """A member's workers started or first stepped in the current round (recovery phases, goodput):
        one event when the last member's did, never one per node."""
        if req.round != self.rdzv.round or not self.rdzv.is_member(node.node_id):
            return
        if req.workers_started_age_s is not None:
            started = self.recovery.node_started(node.node_id, req.round, now - req.workers_started_age_s)
            if started is not None:
                self._event(
                    now,
                    "workers_started",
                    f"round {req.round}: every member started its workers",
                    round=req.round,
                    data={"at": started},
                )
        if req.first_step_age_s is not None:
            stepped = self.recovery.node_stepped(node.node_id, req.round, now - req.first_step_age_s)
            if stepped is not None:
                at, recovery = stepped
                training = self._training_started(at)
                if recovery is None:
                    self._event(
                        now,
                        "first_step",
                        f"round {req.round}: every member stepped; training",
                        round=req.round,
                        data=training,
                    )
                    return
                phases = ", ".join(f"{p} {recovery.seconds[p]:.2f}s" for p in PHASES)
                self._event(
                    now,
                    "first_step",
                    f"round {req.round}: every member stepped; recovered from {recovery.cause} in "
                    f"{recovery.total:.2f}s ({phases})",
                    round=req.round,
                    cause=recovery.cause,
                    durations={**recovery.seconds, "total": recovery.total},
                    # The restart phase's end, as the later heartbeats refined it (RecoveryTracker).
                    data={**training, "workers_started_at": self.recovery.round.all_started_at},
                )

    def _training_started(self, at: float) -> dict:
        return {"training": "started", "training_at": at} if self.goodput.start(at) else {}

    def _training_stopped(self, at: float) -> dict:
        """Stop goodput's training clock at ``at``; the data to put on the event that stopped it."""
        return {"training": "stopped", "training_at": at} if self.goodput.stop(at) else {}

    def _event(self, now: float, kind: str, message: str, **fields) -> None:
        """Record one state change (``fields``: round, node, cause, durations, data of :class:`Event`)."""
        self.event_count += 1
        event = Event(now, kind, message, seq=self.event_count, **fields)
        self.events.append(event)
        self.stats.apply(event)
        self._effects.events.append(event)
        self.version += 1

    def _finish(self, outcome: Outcome, now: float) -> None:
        self.outcome = outcome
        self._effects.wake = True
        training = self._training_stopped(now)
        self.goodput.end(now)
        self._event(
            now, "job_succeeded" if outcome.succeeded else "job_failed", outcome.summary, data=training
        )

    def _open_round(
        self,
        now: float,
        why: str,
        *,
        counted: bool,
        cause: str | None = None,
        began_at: float | None = None,
        stopped_at: float | None = None,
    ) -> None:
        """Open the next round. ``cause`` (a running world broke: a recovery begins) comes with when it
        broke (``began_at``, where detection starts) and when training stopped (``stopped_at``, by default
        the same moment)."""
        self._update_committed_step()  # the closing round's last word, before its reports are reset
        current = self.rdzv.current
        running = self.rdzv.phase is Phase.ACTIVE and current is not None
        cause = cause if running and not self._is_check_round(current.number) else None
        expected = set(current.members) if current else set()
        expected &= set(self.nodes)
        steps = [self.nodes[n].step for n in expected if self.nodes[n].step is not None]
        steps_lost = max(0, max(steps) - (self.committed_step or 0)) if steps and cause else 0
        self._succeeded.clear()
        for node in self.nodes.values():
            node.ckpt_step = None  # checkpoint reports count per round; the committed step stays
        number = self.rdzv.open_round(now, expected)
        self._effects.wake = True  # members' watches answer "rejoin"
        data: dict = {}
        if cause is not None:
            began = now if began_at is None else min(began_at, now)
            self.recovery.verdict(cause, began, now)
            stopped = self._training_stopped(began if stopped_at is None else stopped_at)
            data = {"steps_lost": steps_lost, **stopped}
        kind = "restart" if counted else "membership change"
        self._event(
            now,
            "round_opened",
            f"round {number} opened ({kind}: {why}); restarts {self.restart_count}"
            f"/{self.settings.max_restarts}",
            round=number,
            cause=cause,
            data=data,
        )

    def _on_failure(self, node: NodeInfo, failure: WorkerFailure | None, now: float) -> None:
        round_number = self.rdzv.round
        if round_number in self._round_failed:
            return  # already counted: one failure costs one restart of the world
        self._round_failed.add(round_number)
        node.failures += 1
        cause = (
            _describe_failure(node.node_id, failure) if failure else f"node {node.node_id} reported a failure"
        )
        # When the agent saw it (its report says how long ago): detection ends now, at the verdict.
        failed_at = now - failure.age_s if failure is not None and failure.age_s is not None else now
        verdict = HANG if failure is not None and failure.kind == "hang" else WORKER_FAILURE
        self._event(
            now,
            "worker_failed",
            f"round {round_number}: {cause}",
            round=round_number,
            node=node.node_id,
            cause=verdict,
            durations={"detect": now - failed_at},
        )
        if self._succeeded:
            self._finish(
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
        over_budget = self.restart_count >= self.settings.max_restarts
        if not over_budget:
            self.restart_count += 1
        self._pending_failure = _PendingFailure(
            round_number, frozenset(self.rdzv.current.members), cause, counted=not over_budget
        )
        self._open_round(now, cause, counted=True, cause=verdict, began_at=failed_at)
        self._advance(now)

    def _attribute_failure_to_loss(self, node_id: str, now: float, last_seen: float) -> None:
        """The pending failure followed the loss of ``node_id`` (last seen alive at ``last_seen``): a free
        membership change, whose recovery and lost training time start at that last sign of life."""
        pending = self._pending_failure
        if pending is None or node_id not in pending.members or self.rdzv.phase is not Phase.OPEN:
            return
        if pending.counted:
            self.restart_count -= 1
        self._pending_failure = None
        self.recovery.reattribute(NODE_LOSS, broke_at=last_seen)
        stopped = self.goodput.stop_earlier(last_seen)
        self._event(
            now,
            "failure_not_counted",
            f"the failure in round {pending.round} followed the loss of node {node_id}: a membership "
            f"change, not counted (restarts {self.restart_count}/{self.settings.max_restarts})",
            node=node_id,
            cause=NODE_LOSS,
            data={"training": "stopped", "training_at": stopped} if stopped is not None else {},
        )

    def _on_success(self, node: NodeInfo, now: float) -> None:
        self._succeeded.add(node.node_id)
        # A finished node stops heartbeating; that is not death.
        self.liveness.forget(node.node_id)
        self._event(
            now,
            "node_succeeded",
            f"node {node.node_id} finished round {self.rdzv.round}",
            round=self.rdzv.round,
            node=node.node_id,
        )
        if set(self.rdzv.current.members) <= self._succeeded:
            self._finish(Outcome(succeeded=True, exit_code=0, summary="all workers succeeded"), now)

    def _remove(self, node_id: str, why: str, kind: str, now: float, began_at: float | None = None) -> None:
        """Drop a node (``began_at``: when it was last seen alive, where detecting its loss started)."""
        self._update_committed_step()  # while the node's report still counts
        was_member = self.rdzv.is_member(node_id) and node_id not in self._succeeded
        self.liveness.forget(node_id)
        self.rdzv.remove(node_id, now)
        node = self.nodes.pop(node_id, None)
        if node is None:
            return
        self.removed_count += 1
        self._effects.wake = True  # the removed node's own long-polls answer differently now
        began = now if began_at is None else began_at
        self._event(now, kind, why, node=node_id, cause=NODE_LOSS, durations={"detect": now - began})
        self._attribute_failure_to_loss(node_id, now, began)
        if not was_member or self.outcome is not None:
            return
        if self._succeeded:
            self._finish(
                Outcome(
                    succeeded=False,
                    exit_code=EXIT_FAILED,
                    summary=f"{why} after other nodes had finished; cannot restart",
                ),
                now,
            )
            return
        self._open_round(now, why, counted=False, cause=NODE_LOSS, began_at=began)
        self._advance(now)

    def _advance(self, now: float) -> None:
        """Close the open round, start growth, or time out the rendezvous, as due."""
        rdzv = self.rdzv
        # Once a member has finished, its agent is gone: the world can no longer be re-formed.
        if rdzv.phase is Phase.ACTIVE and not self._succeeded and rdzv.growth_due(now):
            joined = [self.nodes[n].joined_at for n in rdzv.waiting if n in self.nodes]
            self._open_round(
                now,
                f"admitting waiting nodes {', '.join(rdzv.waiting)}",
                counted=False,
                cause=SCALE_UP,
                began_at=min((t for t in joined if t is not None), default=now),
                stopped_at=now,  # the world trained until this verdict
            )
        if rdzv.phase is Phase.OPEN:
            closed = rdzv.try_close(now)
            pending, self._pending_failure = self._pending_failure, None
            if closed is not None and pending is not None and not pending.counted:
                attempts = self.restart_count + 1
                self._finish(
                    Outcome(
                        succeeded=False,
                        exit_code=EXIT_FAILED,
                        summary=f"job failed after {attempts} attempt(s) "
                        f"(max restarts {self.settings.max_restarts}); root cause: {pending.cause}",
                    ),
                    now,
                )
                return
            if closed is None:
                self._pending_failure = pending
            if closed is not None:
                self.round_term = self.term  # assignments are first revealed now, under this term
                self._effects.wake = True  # waiting nodes get their assignment
                for slot in closed.slots:
                    self.nodes[slot.node_id].state = NodeState.STARTING
                    self.nodes[slot.node_id].round = closed.number
                waiting = f"; waiting: {', '.join(rdzv.waiting)}" if rdzv.waiting else ""
                if not self._is_check_round(closed.number):  # a check round trains nothing
                    self.recovery.round_closed(closed.number, closed.members, now)
                self._event(
                    now,
                    "round_closed",
                    f"round {closed.number} closed: {len(closed.slots)} nodes, world size "
                    f"{closed.world_size}, members {', '.join(closed.members)}{waiting}",
                    round=closed.number,
                    data={"world_size": closed.world_size, "nnodes": len(closed.slots)},
                )
                return
            deadline = rdzv.join_deadline()
            if deadline is not None and now >= deadline:
                have = len(rdzv.waiting)
                self._finish(
                    Outcome(
                        succeeded=False,
                        exit_code=EXIT_FAILED,
                        summary=f"rendezvous timed out after {self.settings.join_timeout_s:g}s: "
                        f"{have} node(s) joined, at least {self.settings.min_nodes} needed "
                        f"(node unit {self.settings.node_unit})",
                    ),
                    now,
                )
