"""The job state machine: rendezvous + liveness + restarts + outcome. Pure: no I/O, time is ``now``.

**The caller's duties, in order** (``master.service`` is the caller). Every request and every tick is one
call of a :class:`Job` method with the current ``now``; afterwards the caller drains
:meth:`Job.take_effects` and carries the effects out: it logs and publishes the events, it has the store
write :meth:`Job.snapshot` when ``persist`` is set, and it wakes the pending long-polls that ``wake`` and
``wake_only`` name. A reply that reveals durable state (a node's secret, a round and its assignment, a
verdict) is sent only once the store holds :attr:`Job.version` as it was when the reply was made: the job
bumps the version with every durable change (:meth:`Job.record` and :meth:`Job.note_durable_change`,
nowhere else), soft state (steps, heartbeat ages, the committed step) never bumps it.

The job owns pure parts, each with its own state: the rendezvous (:mod:`master.job.rendezvous`), liveness
and credentials (:mod:`master.job.liveness`), the restart budget, goodput, recovery phases and lifetime
totals (:mod:`master.job.accounting`), the checkpoint progress and node records (:mod:`master.job.progress`),
flapping, stragglers and the node check. Views that only read the job are in :mod:`master.job.views`.
"""

from __future__ import annotations

import secrets
import uuid
from collections import deque
from typing import Any

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    Command,
    CommandReply,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    NodeCheckResult,
    NodeState,
    Outcome,
    RoundReply,
    RoundStatus,
    WorkerFailure,
)
from elastic.exit_codes import ExitCode
from master.job.accounting import PHASES, GoodputAccount, JobStats, RecoveryTracker, RestartBudget, lost_work
from master.job.errors import (
    BadNodeSecretError,
    DuplicateNodeError,
    NodeExcludedError,
    SettingsMismatchError,
    UnknownNodeError,
)
from master.job.events import Cause, Effects, EffectsBuffer, Event, EventKind, restore_events
from master.job.findings import Findings, fresh, persist_news
from master.job.flapping import Exclusion, FlapCounter, FlapPolicy, flap_key
from master.job.liveness import (
    JoinKind,
    Liveness,
    SelfSuspicion,
    check_secret,
    corroborated,
    hash_secret,
    incarnation_secret,
    judge_join,
    matches,
)
from master.job.node_check import NodeCheck
from master.job.progress import CheckpointProgress, NodeInfo, describe_failure
from master.job.rendezvous import Candidate, Phase, Rendezvous, name_list
from master.job.snapshot import UnreadableStateError, check_version, new_incarnation, snapshot_of
from master.job.stragglers import StragglerPolicy, StragglerTracker
from master.job.views import assignment, job_info, job_status, replication_fields

#: How a failed job ends (a row of the one table, elastic.exit_codes).
EXIT_FAILED = ExitCode.FAILED
#: Seconds between two computations of the job-wide aggregates (committed step, stragglers) in tick().
AGGREGATE_PERIOD_S = 0.5


class Job:
    """One job: the requests of its nodes and the passing of time, as pure transitions."""

    def __init__(
        self, settings: JobSettings, now: float, master_id: str | None = None, term: int = 0
    ) -> None:
        self.settings = settings
        self.master_id = master_id or uuid.uuid4().hex[:12]
        #: This submission of the job (Assignment.job_incarnation): stored, so that a failover keeps it.
        self.incarnation = new_incarnation()
        #: Root of the replication keys (master.job.views.replication_fields): stored, never sent.
        self.replication_secret = secrets.token_hex(32)
        self.rdzv = Rendezvous(settings)
        self.liveness = Liveness(settings.heartbeat_timeout_s)
        self.nodes: dict[str, NodeInfo] = {}
        self.budget = RestartBudget.of(settings)  # with the crash-loop policy (master.job.crash_loop)
        self.checkpoints = CheckpointProgress()
        self.outcome: Outcome | None = None
        self.events: deque[Event] = deque(maxlen=1000)
        self.event_count = 0  # events ever recorded (the deque keeps the newest)
        #: The leader's term (master.store.base.StateStore.term), set by the server when it leads.
        self.term = term
        #: The term in which the current round number was opened: a round is ``(round_term, number)``.
        self.round_term = 0
        self.succeeded: set[str] = set()  # members of the current round that finished
        self.started_at = now
        self.stragglers = StragglerTracker(settings.straggler_factor, StragglerPolicy.of(settings))
        self.node_check = NodeCheck(settings.node_check, settings.node_check_factor)
        self.excluded_nodes: dict[str, NodeInfo] = {}  # by the node check; kept for the status view
        self.flapping = FlapCounter(FlapPolicy.of(settings))  # durable: losses and exclusions
        self.findings = Findings()  # soft: integrity findings recorded lately (recorded once each)
        self.aggregates_at = float("-inf")  # when _refresh_aggregates() last ran
        self.goodput = GoodputAccount(started_at=now)
        self.recovery = RecoveryTracker()
        self.stats = JobStats()
        #: A leader's suspicion of its own network (master.job.liveness.SelfSuspicion; its incident durable).
        self.suspicion = SelfSuspicion()
        self._version = 0
        self._effects = EffectsBuffer()
        #: Replies shared by every node (:meth:`_command_reply`): frozen models, built once.
        self._replies: dict[tuple[Command, int, int], CommandReply] = {}
        self.record(now, EventKind.JOB_STARTED, f"job {settings.job_id} started (master {self.master_id})")

    # -- what the server reads --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Bumped by every change of durable state: what the store must hold before a reply reveals it."""
        return self._version

    @property
    def restart_count(self) -> int:
        """Restarts of the world spent (:class:`master.job.accounting.RestartBudget`)."""
        return self.budget.spent

    @property
    def committed_step(self) -> int | None:
        """Newest checkpoint step every rank holds (soft state)."""
        return self.checkpoints.committed_step

    @property
    def round(self) -> int:
        """The round being formed or running."""
        return self.rdzv.round

    def heartbeat_age(self, node_id: str, now: float) -> float | None:
        """Seconds since the node's last heartbeat; None for a node not watched."""
        return self.liveness.age(node_id, now)

    def take_effects(self) -> Effects:
        """What the mutations since the last call did: the events they recorded, whether durable state
        changed (the store must hold :attr:`version` before a reply reveals it) and whether a pending
        long-poll may now answer differently. The server calls this after every request and tick."""
        return self._effects.take(self._version)

    def record(self, now: float, kind: EventKind, message: str, **fields: Any) -> None:
        """Record one state change (``fields``: round, node, cause, durations, data of :class:`Event`);
        an event is durable state."""
        self.event_count += 1
        event = Event(now, kind, message, seq=self.event_count, **fields)
        self.events.append(event)
        self.stats.apply(event)
        self._effects.events.append(event)
        self.note_durable_change()

    def note_durable_change(self) -> None:
        """Durable state changed (the one place :attr:`version` moves; :meth:`record` calls it too)."""
        self._version += 1

    def is_check_round(self, number: int) -> bool:
        """Whether round ``number`` is (or, closing while the check is pending, becomes) a node-check
        round, which trains nothing (read-only, unlike NodeCheck.covers)."""
        check = self.node_check
        return check.mode != "off" and (number in check.rounds or not check.done)

    def exclusion(self, node_id: str) -> str | None:
        """The line an excluded node's agent exits with (node check or flapping); None if not excluded."""
        if node_id in self.node_check.excluded:
            return self.node_check.excluded[node_id]
        flapped = self.flapping.excluded.get(node_id)
        if flapped is None and (node := self.nodes.get(node_id)) is not None and node.default_id:
            flapped = self.flapping.excluded.get(_flap_key_of(node))  # its host's default-id agents
        return flapped.message(self.settings.job_id) if flapped is not None else None

    def is_alive(self, node_id: str, now: float) -> bool:
        """Whether the id's current incarnation is alive: joined, not dead, left or excluded (those leave
        :attr:`nodes`), heard from within the heartbeat timeout with no closed connection since, or
        finished (its agent may still wait for the job's outcome)."""
        if node_id not in self.nodes:
            return False
        return node_id in self.succeeded or self.liveness.alive(node_id, now)

    def authenticate(self, node: NodeInfo, node_secret: str | None) -> None:
        """Raise :class:`BadNodeSecretError` unless ``node_secret`` is the node's current secret."""
        verified = check_secret(node.secret_hash, node.verified, node_secret)
        if verified is not None:
            node.verified = verified
            return
        raise BadNodeSecretError.for_node(node.node_id, secret_given=bool(node_secret))

    # -- requests ---------------------------------------------------------------------------------
    def join(self, req: JoinRequest, now: float, node_secret: str | None = None) -> JoinReply:
        """A node asks to take part in the next round. ``node_secret``: the secret the join carries, if
        any. A join for an id whose agent is alive must carry that agent's secret (a rejoin, which keeps
        it); without it, it is a duplicate (:class:`DuplicateNodeError`). Any other join starts a new
        incarnation (:func:`~master.job.liveness.judge_join`) with the join's secret (retries: the same)."""
        s = self.settings
        if (req.min_nodes, req.max_nodes) != (s.min_nodes, s.max_nodes):
            raise SettingsMismatchError(
                f"node {req.node_id} asks for --nnodes {req.min_nodes}:{req.max_nodes} but job "
                f"{s.job_id} runs with {s.min_nodes}:{s.max_nodes}; start every agent with the same --nnodes"
            )
        self._readmit_expired(now)
        if (excluded := self.exclusion(req.node_id)) is not None:
            raise NodeExcludedError(excluded)
        if req.default_id and (by_host := self.flapping.excluded.get(flap_key(req.node_id, req.host, True))):
            raise NodeExcludedError(by_host.message(s.job_id))  # a new id of an excluded crash loop
        if self.outcome is not None:
            # Nothing left to take part in, so no credential: the agent learns the outcome from /v1/round.
            return JoinReply(round=self.rdzv.round, master_id=self.master_id, node_secret="")
        node = self.nodes.get(req.node_id)
        kind = judge_join(node.secret_hash if node else None, self.is_alive(req.node_id, now), node_secret)
        if kind is JoinKind.DUPLICATE:
            raise DuplicateNodeError(
                f"node id {req.node_id} is in use by another live agent of job {self.settings.job_id}; give "
                f"every agent its own --node-id (a restarted agent is let in once the master declares the "
                f"previous one dead, within {self.settings.heartbeat_timeout_s:g}s of its last heartbeat)"
            )
        secret = incarnation_secret(kind, node_secret)
        if kind is JoinKind.REPLACE and node is not None:
            closed = self.liveness.suspected(req.node_id)
            why = "its connection to the master closed" if closed else "it stopped heartbeating"
            self.record(
                now,
                EventKind.NODE_REPLACED,
                f"node {req.node_id}: a new agent replaced the previous one ({why})",
            )
            self._wake(req.node_id)  # the previous agent's pending long-polls: its secret is void
            # Its agent restarted before the dead verdict: a loss like that verdict (master.job.flapping).
            if (flapped := self._note_loss(node, now)) is not None:
                self._remove(
                    req.node_id, flapped.event_line(), EventKind.NODE_FLAPPING_EXCLUDED, now, flapped
                )
                self._advance(now)
                raise NodeExcludedError(flapped.message(s.job_id))
        was_member = self.rdzv.is_member(req.node_id)
        if node is None:
            node = self.nodes[req.node_id] = NodeInfo(req.node_id, req.host, req.nproc)
        node.host, node.nproc, node.state = req.host, req.nproc, NodeState.WAITING
        node.default_id = req.default_id
        node.joined_at = now
        node.secret_hash = hash_secret(secret)
        self.liveness.beat(req.node_id, now)
        self.suspicion.heard(req.node_id)
        self.rdzv.join(Candidate(req.node_id, req.host, req.nproc, req.store_port, now), now)
        if kind is not JoinKind.REJOIN or was_member:
            joined = f"node {req.node_id} ({req.host}, {req.nproc} workers) joined"
            self.record(now, EventKind.NODE_JOINED, joined, node=req.node_id)
        # else: the same agent back for the next round (every member, at every membership change). It
        # reveals nothing new (same secret, same round number), so it is neither an event nor a store
        # write: a job of N nodes would write N of each per change (the round's close records who came).
        if was_member and self.succeeded:
            why = f"member {req.node_id} restarted after other nodes had finished; cannot restart"
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=why), now)
        elif was_member:
            # A member joining a running round means its agent restarted: a membership change.
            self._open_round(now, f"member {req.node_id} rejoined", counted=False, cause=Cause.NODE_LOSS)
        self._advance(now)
        return JoinReply(round=self.rdzv.round, master_id=self.master_id, node_secret=secret)

    def next_round(self, node_id: str, after: int, node_secret: str | None) -> RoundReply | None:
        """The node's assignment in a round newer than ``after``; None while there is none yet. A finished
        job's outcome is answered to any caller (``GET /v1/status`` shows it too); anything else needs the
        node's secret."""
        if self.outcome is not None:
            return RoundReply(status=RoundStatus.FINISHED, outcome=self.outcome, round=self.rdzv.round)
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} has not joined job {self.settings.job_id}")
        self.authenticate(self.nodes[node_id], node_secret)
        current = self.rdzv.current
        if self.rdzv.phase is Phase.ACTIVE and current and current.number > after:
            slot = current.slot(node_id)
            if slot is not None:
                return RoundReply(
                    status=RoundStatus.ASSIGNED, assignment=assignment(self, slot), round=current.number
                )
        if not self.rdzv.has_joined(node_id) and not self.rdzv.is_member(node_id):
            raise UnknownNodeError(f"node {node_id} is not waiting for a round; join first")
        return None

    def heartbeat(self, req: HeartbeatRequest, now: float, node_secret: str | None) -> CommandReply:
        """Record a node's state; act on a failure or success; say what the node must do. Raises
        :class:`BadNodeSecretError`, having changed nothing, when ``node_secret`` is not the node's."""
        node = self.nodes.get(req.node_id)
        if node is None:
            if self.outcome is not None:
                return self._command_reply(Command.STOP)
            if self.exclusion(req.node_id) is not None:
                return self._exclude_reply(req.node_id)
            raise UnknownNodeError(
                f"node {req.node_id} is not part of job {self.settings.job_id}; join first"
            )
        self.authenticate(node, node_secret)
        if req.node_id not in self.succeeded:  # a finished node is no longer watched for liveness
            self.liveness.beat(req.node_id, now)
        self.suspicion.heard(req.node_id)
        node.note_workers(req.workers)
        self._note_persist(node, req, now)
        self._note_findings(node, req, now)
        node.replication_port, node.replicated_step = req.replication_port, req.replicated_step
        node.replication_lag, node.replication_error = req.replication_lag, req.replication_error
        self._note_round_progress(node, req, now)
        if req.ckpt_step is not None and req.round == self.rdzv.round:
            node.ckpt_step = req.ckpt_step  # the committed step follows in tick()
            self.checkpoints.floor.report(node.node_id, req.ckpt_step)
        current_round = (
            req.round == self.rdzv.round
            and (req.term is None or req.term == self.round_term)
            and self.rdzv.is_member(req.node_id)
        )
        if current_round:  # soft state: a node's state in its round is never a store write of its own
            node.state, node.round = req.state, req.round
        if current_round and req.state is NodeState.FAILED and self.outcome is None:
            self._on_failure(node, req.failure, now)
            self._corroborate(req.node_id, now)
        elif current_round and req.node_check is not None and self.outcome is None:
            self._on_node_check(req.node_id, req.round, req.node_check, now)
        elif (
            current_round
            and req.state is NodeState.SUCCEEDED
            and self.outcome is None
            and node.node_id not in self.succeeded  # repeated reports are not new transitions
        ):
            self._on_success(node, now)
        reply = self.command_for(req.node_id, req.round, req.term)
        if req.replicas and reply.command is Command.CONTINUE and self.rdzv.is_member_or_spare(req.node_id):
            reply = reply.model_copy(update=replication_fields(self, req.node_id, req.replicas))
        return reply

    def heard(self, node_id: str, node_secret: str, now: float) -> None:
        """A heartbeat of the node arrived but was shed (master.service.overload): alive at its receipt if
        it carries the node's current secret, nothing else learnt. O(1) (the secret check is a comparison
        once the node's heartbeats were checked: :meth:`authenticate`)."""
        node = self.nodes.get(node_id)
        if node is None or node_id in self.succeeded:
            return
        try:
            self.authenticate(node, node_secret)
        except BadNodeSecretError:
            return
        self.liveness.beat(node_id, now)
        self.suspicion.heard(node_id)

    def leave(self, node_id: str, reason: str, now: float, node_secret: str | None) -> None:
        """Orderly departure (the agent was told to stop, e.g. preemption): a membership change."""
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}")
        self.authenticate(self.nodes[node_id], node_secret)
        why = f"node {node_id} left" + (f" ({reason})" if reason else "")
        self._remove(node_id, why, EventKind.NODE_LEFT, now)
        self._advance(now)

    def connection_lost(self, node_id: str, now: float, node_secret: str | None) -> None:
        """A node's agent closed a long-poll before the answer. Its process most likely died (the kernel
        closes a dead process's connections): unless it heartbeats within two heartbeat intervals it is
        declared dead then, not only after the whole heartbeat timeout. A machine that vanishes closes
        nothing; the heartbeat timeout still covers it. Only the connection of a request that carried the
        node's current secret counts (not one of a replaced incarnation, nor anybody else's)."""
        node = self.nodes.get(node_id)
        if self.outcome is not None or node is None or node_id in self.succeeded:
            return
        if not matches(node.secret_hash, node_secret):
            return
        s = self.settings
        pending = self.budget.pending
        if pending is not None and pending.reporter != node_id and node_id in pending.members:
            # Another member's failure report (its collective broke) corroborates it: dead at once.
            self.liveness.suspect(node_id, now, 0.0)
            why = f"after node {pending.reporter} reported a failure; declared dead now"
        else:
            within = min(2 * s.heartbeat_interval_s, s.heartbeat_timeout_s)
            self.liveness.suspect(node_id, now, within)
            why = f"declared dead unless it heartbeats within {within:g}s"
        self.record(
            now,
            EventKind.NODE_SUSPECT,
            f"node {node_id} closed its connection to the master {why}",
            node=node_id,
        )

    def watch(
        self, node_id: str, node_round: int, node_secret: str | None, node_term: int | None = None
    ) -> CommandReply:
        """:meth:`command_for` for a node's watch long-poll. A node this master does not know gets
        :class:`UnknownNodeError`, as its heartbeat does: a master restarted without a durable store (or
        one that declared the node dead) must say so, not answer "rejoin" as if it had opened a round. A
        known node's secret is checked while the job runs (a finished job's outcome is no secret)."""
        if self.outcome is None and self.exclusion(node_id) is not None:
            return self._exclude_reply(node_id)
        if self.outcome is None and node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}; join first")
        if self.outcome is None:
            self.authenticate(self.nodes[node_id], node_secret)
        return self.command_for(node_id, node_round, node_term)

    def command_for(self, node_id: str, node_round: int, node_term: int | None = None) -> CommandReply:
        """What a node whose workers run in round ``(node_term, node_round)`` must do now (heartbeat and
        watch). ``node_term`` None (an agent without terms) compares round numbers alone."""
        if self.outcome is not None:
            return self._command_reply(Command.STOP)
        if self.exclusion(node_id) is not None:
            return self._exclude_reply(node_id)
        rdzv = self.rdzv
        if node_round and (node_round != rdzv.round or rdzv.phase is Phase.OPEN):
            return self._command_reply(Command.REJOIN)
        if node_round and not rdzv.is_member(node_id):
            return self._command_reply(Command.REJOIN)
        if node_round and node_term is not None and node_term != self.round_term:
            # The same number under another term is another world (a leader that never stored it).
            return self._command_reply(Command.REJOIN)
        return self._command_reply(Command.CONTINUE)

    def readmit(self, node_id: str, now: float) -> None:
        """The operator's ``elastic-master readmit``: lift a flapping exclusion before its cool-down ends.
        Raises :class:`UnknownNodeError` when the node is not excluded for flapping."""
        self._readmit_expired(now)
        if self.flapping.readmit(node_id) is None:
            final = (
                " (the node check excluded it: that is final)" if node_id in self.node_check.excluded else ""
            )
            raise UnknownNodeError(
                f"node {node_id} is not excluded for flapping from job {self.settings.job_id}{final}"
            )
        readmitted = f"node {node_id} re-admitted by an operator"
        self.record(now, EventKind.NODE_READMITTED, readmitted, node=node_id)
        self._wake(node_id)

    # -- time -------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply every time-driven transition: dead nodes, round close, growth, join timeout."""
        if self.outcome is not None:
            return
        if now - self.aggregates_at >= AGGREGATE_PERIOD_S:
            self._refresh_aggregates(now)
        self._readmit_expired(now)
        if (pending := self.budget.pending) is not None and pending.stalled:
            self._corroborate(pending.reporter, now, closed=False)  # a member silent since the report
        dead = self.liveness.dead(now)
        active = self.rdzv.current if self.rdzv.phase is Phase.ACTIVE else None
        if dead and (held := self.suspicion.judge(self.liveness, dead, active, self.settings, now)):
            self.record(now, EventKind.MASTER_SUSPECTED, held, data=self.suspicion.data())
            dead = []  # held for one heartbeat timeout; the server resigns where a standby can lead
        for node_id in dead:
            age = self.liveness.age(node_id, now)
            lost = self.nodes.get(node_id)
            why = f" {self.liveness.suspicion(node_id)}" if self.liveness.suspected(node_id) else ""
            self._remove(
                node_id,
                f"node {node_id} declared dead (no heartbeat for {age:.1f}s{why})",
                EventKind.NODE_DEAD,
                now,
                began_at=now - age if age is not None else now,  # its last heartbeat
            )
            if self.outcome is not None:
                return
            if lost is not None and (flapped := self._note_loss(lost, now)):
                self._record_flap_exclusion(flapped, now)
        if self.suspicion.settle(self.liveness):
            self.note_durable_change()  # the incident ended (its nodes heard from, or declared dead)
        self._advance(now)

    def note_overload(self, started: bool, message: str, now: float) -> None:
        """The master started (or stopped) shedding heartbeats it could not serve in time
        (master.service.overload): an event where the operator looks, either way."""
        kind = EventKind.MASTER_OVERLOADED if started else EventKind.MASTER_OVERLOAD_ENDED
        self.record(now, kind, message)

    def excuse_stall(self, seconds: float, now: float) -> None:
        """The master's own loop did not run for ``seconds`` (CPU starved, a long collection, the process
        stopped): the heartbeats of that time waited unread, so no node is declared dead for them (every
        heartbeat age moves that much later); the stall is an event, where the operator looks."""
        self.liveness.excuse(seconds)
        self.record(
            now,
            EventKind.MASTER_STALLED,
            f"master {self.master_id} did not run for {seconds:.1f}s (CPU starved, stopped or paused): "
            "heartbeat ages extended by that much",
        )

    # -- views ------------------------------------------------------------------------------------
    def info(self) -> JobInfo:
        """``GET /v1/info`` (:func:`master.job.views.job_info`)."""
        return job_info(self)

    def status(self, now: float) -> JobStatus:
        """``GET /v1/status`` (:func:`master.job.views.job_status`)."""
        return job_status(self, now)

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a master taking over needs; plain JSON-able data (master.job.snapshot.snapshot_of)."""
        return snapshot_of(self)

    @classmethod
    def restore(
        cls,
        settings: JobSettings,
        data: dict[str, Any],
        now: float,
        master_id: str | None = None,
        term: int = 0,
    ) -> Job:
        """A job continued from :meth:`snapshot` by a (new) master. Every known node gets a full heartbeat
        timeout of grace, so that the handover itself never causes a dead-node verdict.

        Raises ValueError, KeyError or TypeError for a state it cannot read (master.job.snapshot)."""
        job = cls(settings, now, master_id, term)
        job._load(data, now)
        return job

    def _load(self, data: dict[str, Any], now: float) -> None:
        check_version(data)
        settings, term = self.settings, self.term
        if data.get("job_id") != settings.job_id:
            raise UnreadableStateError(
                f"stored state belongs to job {data.get('job_id')!r}, not {settings.job_id!r}"
            )
        self.rdzv.restore(data["rendezvous"], now)
        for n in data.get("nodes", []):
            self.nodes[n["node_id"]] = NodeInfo(n["node_id"], n["host"], n["nproc"], failures=n["failures"])
            # State written before node credentials has no hash: such a node's requests are refused (403)
            # and its agent says so; one never takes over a node by its id alone.
            self.nodes[n["node_id"]].secret_hash = n.get("secret_hash", "")
            self.nodes[n["node_id"]].default_id = bool(n.get("default_id", False))
        self.rdzv.restrict_expected(self.nodes)  # a forming round expects the previous members still known
        self.budget = RestartBudget.of(settings, data)
        self.round_term = int(data.get("round_term", 0))
        # A state stored before incarnations keeps the new one: the next round's persists then supersede
        # the earlier rounds' (which the fence already orders by round), never the other way round.
        self.incarnation = str(data.get("incarnation") or self.incarnation)
        # Stored by an older master without one: the new one (nodes get new keys with their next heartbeat).
        self.replication_secret = str(data.get("replication_secret") or self.replication_secret)
        self.checkpoints = CheckpointProgress(data.get("committed_step"))
        self.outcome = Outcome(**data["outcome"]) if data.get("outcome") else None
        self.succeeded = set(data.get("succeeded", []))
        stored = data.get("events", [])
        self.event_count = int(data.get("event_count", len(stored)))
        self.events.clear()  # the stored events replace this object's own job_started
        self.events.extend(restore_events(stored, self.event_count, now))
        self._effects = EffectsBuffer()  # stored events are not new; the takeover event below is
        self.goodput = GoodputAccount.restore(data.get("goodput"), now)
        self.stats = JobStats.restore(data.get("stats"))
        active = self.rdzv.current if self.rdzv.phase is Phase.ACTIVE else None  # the running round
        self.recovery.restore(
            data.get("recovery"),
            active.number if active is not None else None,
            active.members if active is not None else [],
        )
        self.node_check.restore(data.get("node_check"))
        # The floor's reports come with heartbeats.
        self.checkpoints.floor.reset(active.members if active is not None else ())
        # Soft state: the first heartbeat tells; until then, the round's.
        for node_id, node in self.nodes.items():
            if active is not None and active.has(node_id):
                node.round = active.number
                node.state = NodeState.SUCCEEDED if node_id in self.succeeded else NodeState.RUNNING
        self.flapping.restore(data.get("flapping"))
        self.suspicion.restore(data.get("silent_incident", []), self.nodes)
        for node_id in self.nodes:
            if node_id not in self.succeeded:
                self.liveness.beat(node_id, now)
        self.liveness.grant_grace(now)
        self.record(
            now,
            EventKind.MASTER_TAKEOVER,
            f"master {self.master_id} took over job {settings.job_id} in round "
            f"{self.rdzv.round} (term {term}, restarts {self.restart_count})",
            data={"term": term, "previous_master": data.get("master_id", "")},
        )

    # -- rounds -----------------------------------------------------------------------------------
    def _open_round(
        self,
        now: float,
        why: str,
        *,
        counted: bool,
        cause: Cause | None = None,
        began_at: float | None = None,
        stopped_at: float | None = None,
    ) -> None:
        """Open the next round. ``cause`` (a running world broke: a recovery begins) comes with when it
        broke (``began_at``, where detection starts) and when training stopped (``stopped_at``, by default
        the same moment)."""
        self._update_committed_step()  # the closing round's last word, before its reports are reset
        current = self.rdzv.current
        running = self.rdzv.phase is Phase.ACTIVE and current is not None
        cause = cause if running and current is not None and not self.is_check_round(current.number) else None
        expected = set(current.members) if current else set()
        expected &= set(self.nodes)
        members = [self.nodes[n] for n in expected]
        steps_lost, redone_s = lost_work(members, self.committed_step) if cause else (0, 0.0)
        self.succeeded.clear()
        for node in self.nodes.values():
            node.ckpt_step = None  # checkpoint reports count per round; the committed step stays
        self.checkpoints.floor.reset(())
        number = self.rdzv.open_round(now, expected)
        self._wake()  # members' watches answer "rejoin"
        # Why, and whether it was charged, as data too: agents' restart lines read them (master.job.views).
        data: dict[str, Any] = {"why": why, "charged": counted}
        if cause is not None:
            began = now if began_at is None else min(began_at, now)
            self.recovery.verdict(cause, began, now)
            stopped = self.goodput.stopped_event(began if stopped_at is None else stopped_at)
            data.update(steps_lost=steps_lost, redone_s=round(redone_s, 3), **stopped)
        kind = "restart" if counted else "membership change"
        self.record(
            now,
            EventKind.ROUND_OPENED,
            f"round {number} opened ({kind}: {why}); "
            f"restarts {self.restart_count}/{self.settings.max_restarts}",
            round=number,
            cause=cause,
            data=data,
        )

    def _advance(self, now: float) -> None:
        """Close the open round, start growth, or time out the rendezvous, as due."""
        rdzv = self.rdzv
        # Once a member has finished, its agent is gone: the world can no longer be re-formed.
        if rdzv.phase is Phase.ACTIVE and not self.succeeded and rdzv.growth_due(now):
            joined = [self.nodes[n].joined_at for n in rdzv.waiting if n in self.nodes]
            self._open_round(
                now,
                f"admitting waiting nodes {name_list(rdzv.waiting)}",
                counted=False,
                cause=Cause.SCALE_UP,
                began_at=min((t for t in joined if t is not None), default=now),
                stopped_at=now,  # the world trained until this verdict
            )
        if rdzv.phase is not Phase.OPEN:
            return
        closed = rdzv.try_close(now)
        if closed is not None:
            unpaid = self.budget.settle()
            if unpaid is not None:  # the budget was spent and no loss explained the failure
                self._finish(self.budget.exhausted(unpaid.cause), now)
                return
            self.round_term = self.term  # assignments are first revealed now, under this term
            self._wake()  # waiting nodes get their assignment
            self.checkpoints.floor.reset(closed.members)
            for slot in closed.slots:
                self.nodes[slot.node_id].state = NodeState.STARTING
                self.nodes[slot.node_id].round = closed.number
            waiting = f"; waiting: {name_list(rdzv.waiting)}" if rdzv.waiting else ""
            if not self.node_check.covers(closed.number):  # a check round trains nothing
                self.recovery.round_closed(closed.number, closed.members, now)
            self.record(
                now,
                EventKind.ROUND_CLOSED,
                f"round {closed.number} closed: {len(closed.slots)} nodes, world size "
                f"{closed.world_size}, members {name_list(closed.members)} (term {self.round_term}){waiting}",
                round=closed.number,
                data={"world_size": closed.world_size, "nnodes": len(closed.slots), "term": self.round_term},
            )
            return
        deadline = rdzv.join_deadline()
        if deadline is not None and now >= deadline:
            have = len(rdzv.waiting)
            s = self.settings
            summary = (
                f"rendezvous timed out after {s.join_timeout_s:g}s: {have} node(s) joined, at least "
                f"{s.min_nodes} needed (node unit {s.node_unit})"
            )
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary), now)

    def _finish(self, outcome: Outcome, now: float) -> None:
        self.outcome = outcome
        self._wake()
        training = self.goodput.stopped_event(now)
        self.goodput.end(now)
        kind = EventKind.JOB_SUCCEEDED if outcome.succeeded else EventKind.JOB_FAILED
        self.record(now, kind, outcome.summary, data=training)

    # -- results: failures, successes, node checks ------------------------------------------------
    def _on_failure(self, node: NodeInfo, failure: WorkerFailure | None, now: float) -> None:
        """A member's workers failed in the current round: one restart of the world, charged provisionally
        (:mod:`master.job.accounting`), once per round; or, when deterministic, the job stops (exit 3)."""
        round_number = self.rdzv.round
        if self.budget.charged(round_number):
            return  # already counted: one failure costs one restart of the world
        node.failures += 1
        cause = (
            describe_failure(node.node_id, failure) if failure else f"node {node.node_id} reported a failure"
        )
        # When the agent saw it (its report says how long ago): detection ends now, at the verdict.
        failed_at = now - failure.age_s if failure is not None and failure.age_s is not None else now
        verdict = Cause.HANG if failure is not None and failure.kind == "hang" else Cause.WORKER_FAILURE
        self.record(
            now,
            EventKind.WORKER_FAILED,
            f"round {round_number}: {cause}",
            round=round_number,
            node=node.node_id,
            cause=verdict,
            durations={"detect": now - failed_at},
        )
        if self.succeeded:
            summary = f"{cause} after other nodes had finished; cannot restart"
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary), now)
            return
        members = self.rdzv.current.members if self.rdzv.current else []
        peers = [self.nodes[m] for m in members if m in self.nodes and m != node.node_id]
        stop = self.budget.crash_loop.judge_report(
            node, failure, cause, round_number, now, self.committed_step, peers, self.liveness.suspected
        )
        if stop is not None:  # deterministic: restarting cannot help (master.job.crash_loop), exit 3
            self.record(now, EventKind.CRASH_LOOP, stop.message, **stop.fields)
            self._finish(stop.outcome, now)
            return
        self.budget.charge(round_number, members, cause, node.node_id, now, stalled=verdict is Cause.HANG)
        self._open_round(now, cause, counted=True, cause=verdict, began_at=failed_at)
        self._advance(now)

    def _corroborate(self, reporter: str, now: float, closed: bool = True) -> None:
        """``reporter``'s failure report makes other members dead now, not at their timeout: see
        :func:`~master.job.liveness.corroborated` (``closed``: those whose connection closed, too)."""
        pending = self.budget.pending
        current = self.rdzv.current
        members = pending.members if pending is not None else current.members if current else ()
        interval = self.settings.heartbeat_interval_s if pending and pending.stalled else None
        for member, why in corroborated(self.liveness, members, reporter, now, closed, interval):
            self.liveness.suspect(member, now, 0.0, "while its peers stalled")
            self.record(
                now,
                EventKind.NODE_SUSPECT,
                f"node {member} {why} and node {reporter} reported a failure: declared dead now",
                node=member,
            )

    def _refund_for_loss(self, node_id: str, now: float, last_seen: float) -> None:
        """The pending failure followed the loss of ``node_id`` (last seen alive at ``last_seen``): a free
        membership change, whose recovery and lost training time start at that last sign of life."""
        if self.rdzv.phase is not Phase.OPEN:
            return
        refunded = self.budget.refund(node_id)
        if refunded is None:
            return
        self.recovery.reattribute(Cause.NODE_LOSS, broke_at=last_seen)
        stopped = self.goodput.stop_earlier(last_seen)
        self.record(
            now,
            EventKind.FAILURE_NOT_COUNTED,
            f"{refunded.cause}: explained by the loss of peer node {node_id}"
            f"{refunded.declared_later(now)}: a membership change, not counted "
            f"(restarts {self.restart_count}/{self.settings.max_restarts})",
            node=node_id,
            cause=Cause.NODE_LOSS,
            data={"training": "stopped", "training_at": stopped} if stopped is not None else {},
        )

    def _on_success(self, node: NodeInfo, now: float) -> None:
        self.succeeded.add(node.node_id)
        # A finished node stops heartbeating; that is not death.
        self.liveness.forget(node.node_id)
        self.record(
            now,
            EventKind.NODE_SUCCEEDED,
            f"node {node.node_id} finished round {self.rdzv.round}",
            round=self.rdzv.round,
            node=node.node_id,
        )
        members = self.rdzv.current.members if self.rdzv.current else []
        # Counted first: a job of N nodes would otherwise compare N ids at each of its N successes.
        if len(self.succeeded) >= len(members) and self.succeeded.issuperset(members):
            self._finish(Outcome(succeeded=True, exit_code=0, summary="all workers succeeded"), now)

    def _on_node_check(self, node_id: str, round_number: int, result: NodeCheckResult, now: float) -> None:
        """A member's node-check result; once every member has one, judge them and open the real round."""
        if not self.node_check.record(node_id, round_number, result):
            return
        self.note_durable_change()  # the result is stored (a new leader must not ask for it again)
        members = self.rdzv.current.members if self.rdzv.current else []
        if not self.node_check.complete(members):
            return
        for kind, message in self.node_check.decide(members):
            self.record(now, kind, message)
        for excluded in [m for m in members if m in self.node_check.excluded]:
            self.liveness.forget(excluded)
            self.rdzv.remove(excluded, now)
            self.excluded_nodes[excluded] = self.nodes.pop(excluded)
            self._wake(excluded)
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

    # -- removals ---------------------------------------------------------------------------------
    def _remove(
        self,
        node_id: str,
        why: str,
        kind: EventKind,
        now: float,
        flapped: Exclusion | None = None,
        began_at: float | None = None,
    ) -> None:
        """Drop a node (``began_at``: when it was last seen alive, where detecting its loss started;
        ``flapped``: the exclusion that removes it, for its event's data)."""
        self._update_committed_step()  # while the node's report still counts
        self.checkpoints.floor.lose(node_id)
        was_member = self.rdzv.is_member(node_id) and node_id not in self.succeeded
        self.liveness.forget(node_id)
        self.rdzv.remove(node_id, now)
        node = self.nodes.pop(node_id, None)
        if node is None:
            return
        self._wake(node_id)  # its own long-polls answer differently now (a member's: a round opens)
        began = now if began_at is None else began_at
        data = flapped.event_data() if flapped is not None else {}
        self.record(
            now, kind, why, node=node_id, cause=Cause.NODE_LOSS, durations={"detect": now - began}, data=data
        )
        self._refund_for_loss(node_id, now, began)
        if not was_member or self.outcome is not None:
            return
        if self.succeeded:
            summary = f"{why} after other nodes had finished; cannot restart"
            self._finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=summary), now)
            return
        self._open_round(now, why, counted=False, cause=Cause.NODE_LOSS, began_at=began)
        self._advance(now)

    def _note_loss(self, node: NodeInfo, now: float) -> Exclusion | None:
        """Count one loss of ``node`` (per id, or per host for a default id: master.job.flapping)."""
        return self.flapping.note(_flap_key_of(node), now, node.host, node.nproc, by_host=node.default_id)

    def _record_flap_exclusion(self, flapped: Exclusion, now: float) -> None:
        """An exclusion of a node that is gone already (its loss was a dead verdict)."""
        line = flapped.event_line()
        kind = EventKind.NODE_FLAPPING_EXCLUDED
        self.record(now, kind, line, node=flapped.node_id, data=flapped.event_data())
        self._wake(flapped.node_id)  # its agent's pending long-polls now answer "exclude"
        if flapped.by_host:  # the crash loop's live agent, under a new id, goes too (a dead one: tick)
            key = flapped.node_id
            same = [n for n in self.nodes.values() if n.default_id and _flap_key_of(n) == key]
            for node in [n for n in same if self.liveness.alive(n.node_id, now)]:
                self._remove(node.node_id, line, kind, now, flapped)

    def _readmit_expired(self, now: float) -> None:
        for over in self.flapping.expired(now):
            self.record(now, EventKind.NODE_READMITTED, over.readmitted_line(), node=over.node_id)
            self._wake(over.node_id)

    # -- soft state from heartbeats ---------------------------------------------------------------
    def _refresh_aggregates(self, now: float) -> None:
        """The committed step, the persisted count, the straggler flags and evictions, from tick() every
        AGGREGATE_PERIOD_S (the committed step also before a round opens or a removal). The first two cost
        O(1) (kept per report); the stragglers' median O(members) (paces are kept per heartbeat), which is why
        this is periodic: per heartbeat, a heartbeat interval of N nodes would cost O(N^2)."""
        self.aggregates_at = now
        self._update_committed_step()
        if self.checkpoints.count_persisted(now):
            self.stats.checkpoints_persisted += 1
        current = self.rdzv.current
        members = current.members if current is not None and self.rdzv.phase is Phase.ACTIVE else []
        judged = [x for n in members if (x := self.nodes.get(n)) and x.state is NodeState.RUNNING]
        paces, steps = {n.node_id: n.pace for n in judged}, {n.node_id: n.step for n in judged}
        for kind, message in self.stragglers.update(paces, now, steps, len(members), len(self.rdzv.spares)):
            self.record(now, kind, message)
        for out in self.stragglers.take_evictions():  # --straggler-policy: excluded as flapping nodes are
            node, cool = self.nodes[out.node_id], self.settings.straggler_cooldown_s
            if gone := self.flapping.exclude(node.node_id, now, cool, out.cause(), node.host, node.nproc):
                self._remove(node.node_id, gone.event_line(), EventKind.STRAGGLER_EVICTED, now, gone)

    def _update_committed_step(self) -> None:
        """The committed step only moves forward, and only when every member of the round holds it. O(1):
        :class:`master.job.progress.StepFloor` follows the members' reports as they come. Soft state
        (rebuilt from heartbeats after a failover): no store write per step."""
        if self.rdzv.current is None or self.rdzv.phase is not Phase.ACTIVE:
            return
        if self.checkpoints.commit():
            self.stats.checkpoints_committed += 1

    def _note_persist(self, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
        """Record a node's persist status (soft state); an event only when persisting starts failing or
        recovers (master.job.findings.persist_news)."""
        if req.persisted_step is not None:
            node.persisted_step = req.persisted_step
            self.checkpoints.persisted(req.persisted_step)
        if news := persist_news(node.node_id, node.persist_error, req.persist_error, node.persisted_step):
            self.record(now, news.kind, news.message, node=node.node_id)
        node.persist_error = req.persist_error

    def _note_findings(self, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
        """Events for what a node found wrong, once per report (master.job.findings); a recurring NaN or
        spike stops the job (exit 3), a node named the odd replica too often is excluded (exit 4)."""
        if not (req.ckpt_corrupt or node.corrupt_seen):  # rare: the heartbeat's hot path skips it
            return
        judged = self.findings.judge(node.node_id, fresh(node.corrupt_seen, req.ckpt_corrupt))
        node.corrupt_seen = frozenset(found.id for found in req.ckpt_corrupt)
        for news in judged.events:
            self.record(now, news.kind, news.message, node=node.node_id, data=news.data)
        for step, back_to in judged.rollbacks:
            self.note_durable_change()
            if self.budget.charge_rollback(step, back_to) is False and self.outcome is None:
                self._finish(self.budget.exhausted(f"integrity rollback from step {step} to {back_to}"), now)
        if self.outcome is None and judged.stop is not None:
            self._finish(judged.stop, now)
        elif self.outcome is None and judged.odd:
            self.note_durable_change()  # its suspect counter (master.job.flapping.FlapCounter.note_suspect)
            if out := self.flapping.note_suspect(node.node_id, now, self.settings, node.host, node.nproc):
                self._remove(node.node_id, out.event_line(), EventKind.NODE_SUSPECT_EXCLUDED, now, out)

    def _note_round_progress(self, node: NodeInfo, req: HeartbeatRequest, now: float) -> None:
        """A member's workers started or first stepped in the current round (recovery phases, goodput):
        one event when the last member's did, never one per node."""
        if req.round != self.rdzv.round or not self.rdzv.is_member(node.node_id):
            return
        if req.workers_started_age_s is not None:
            started = self.recovery.node_started(node.node_id, req.round, now - req.workers_started_age_s)
            if started is not None:
                self.record(
                    now,
                    EventKind.WORKERS_STARTED,
                    f"round {req.round}: every member started its workers",
                    round=req.round,
                    data={"at": started},
                )
        if req.first_step_age_s is None:
            return
        stepped = self.recovery.node_stepped(node.node_id, req.round, now - req.first_step_age_s)
        if stepped is None:
            return
        at, recovery = stepped
        training = self.goodput.started_event(at)
        if recovery is None:
            message = f"round {req.round}: every member stepped; training"
            self.record(now, EventKind.FIRST_STEP, message, round=req.round, data=training)
            return
        phases = ", ".join(f"{p} {recovery.seconds[p]:.2f}s" for p in PHASES)
        started_at = self.recovery.round.all_started_at if self.recovery.round is not None else None
        self.record(
            now,
            EventKind.FIRST_STEP,
            f"round {req.round}: every member stepped; recovered from {recovery.cause} in "
            f"{recovery.total:.2f}s ({phases})",
            round=req.round,
            cause=recovery.cause,
            durations={**recovery.seconds, "total": recovery.total},
            # The restart phase's end, as the later heartbeats refined it (RecoveryTracker).
            data={**training, "workers_started_at": started_at},
        )

    # -- replies and wake-ups ---------------------------------------------------------------------
    def _command_reply(self, command: Command) -> CommandReply:
        """The reply naming ``command`` and the job's round. Replies are frozen, so one object per (command,
        round, term) serves every node while the job runs (a steady heartbeat builds no model)."""
        if self.outcome is not None:
            return self._build_reply(command)
        key = (command, self.rdzv.round, self.round_term)
        reply = self._replies.get(key)
        if reply is None:
            if len(self._replies) >= 16:  # only the current round's few commands are asked for
                self._replies.clear()
            reply = self._replies[key] = self._build_reply(command)
        return reply

    def _build_reply(self, command: Command) -> CommandReply:
        return CommandReply(
            command=command,
            round=self.rdzv.round,
            term=self.round_term,
            outcome=self.outcome,
            master_id=self.master_id,
        )

    def _exclude_reply(self, node_id: str) -> CommandReply:
        """Tell an excluded node's agent to stop, with the line it exits with (:meth:`exclusion`)."""
        summary = self.exclusion(node_id) or f"node {node_id} was excluded from the job"
        return CommandReply(
            command=Command.EXCLUDE,
            round=self.rdzv.round,
            outcome=Outcome(succeeded=False, exit_code=ExitCode.NODE_UNHEALTHY, summary=summary),
            master_id=self.master_id,
        )

    def _wake(self, node_id: str | None = None) -> None:
        """Note that pending ``/v1/round`` or ``/v1/watch`` answers may have changed (an effect): those of
        ``node_id`` alone when given (its answers changed, nobody else's), else everyone's."""
        if node_id is None:
            self._effects.wake = True
        else:
            self._effects.wake_nodes.add(node_id)


def _flap_key_of(node: NodeInfo) -> str:
    """What ``node``'s losses count under (:func:`master.job.flapping.flap_key`)."""
    return flap_key(node.node_id, node.host, node.default_id)
