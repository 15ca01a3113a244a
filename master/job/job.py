"""The job state machine: rendezvous + liveness + restarts + outcome. Pure: no I/O, time is ``now``.

The HTTP server is a thin shell: it calls these methods and carries out their effects
(:meth:`JobState.take_effects`: events to log, durable state to store before replying, long-polls to wake).
The state and its primitives are in :mod:`master.job.state`; rounds in :mod:`master.job.round_flow`; failure
accounting in :mod:`master.job.results`; soft progress in :mod:`master.job.progress`; replies in
:mod:`master.job.replies`; snapshots in :mod:`master.job.snapshot`; views in :mod:`master.job.status`.
"""

from __future__ import annotations

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    Command,
    CommandReply,
    HeartbeatRequest,
    JobInfo,
    JobStatus,
    JoinReply,
    JoinRequest,
    NodeState,
    Outcome,
    RoundReply,
)
from master.job.credentials import JoinKind, hash_secret, judge_join, matches, new_secret
from master.job.errors import (
    DuplicateNodeError,
    NodeExcludedError,
    SettingsMismatchError,
    UnknownNodeError,
)
from master.job.events import NODE_LOSS
from master.job.flapping import Exclusion, clock_time
from master.job.node_info import NodeInfo
from master.job.progress import (
    note_checkpoint,
    note_persist,
    note_round_progress,
    refresh_aggregates,
    update_committed_step,
)
from master.job.rendezvous import Candidate, Phase
from master.job.replies import assignment, command_for, command_reply, exclude_reply, replica_targets
from master.job.results import attribute_failure_to_loss, corroborate, on_failure, on_node_check, on_success
from master.job.round_flow import advance, open_round
from master.job.snapshot import restore_into, snapshot_of
from master.job.state import AGGREGATE_PERIOD_S, EXIT_FAILED, JobState
from master.job.status import job_info, job_status


class Job(JobState):
    """One job: the requests of its nodes and the passing of time, as pure transitions."""

    # -- requests ---------------------------------------------------------------------------------
    def join(self, req: JoinRequest, now: float, node_secret: str | None = None) -> JoinReply:
        """A node asks to take part in the next round. ``node_secret``: the secret the join carries, if
        any. A join for an id whose agent is alive must carry that agent's secret (a rejoin, which keeps
        it); without it, it is a duplicate (:class:`DuplicateNodeError`). Any other join starts a new
        incarnation of the id with a new secret (:func:`master.job.credentials.judge_join`)."""
        s = self.settings
        if (req.min_nodes, req.max_nodes) != (s.min_nodes, s.max_nodes):
            raise SettingsMismatchError(
                f"node {req.node_id} asks for --nnodes {req.min_nodes}:{req.max_nodes} but job "
                f"{s.job_id} runs with {s.min_nodes}:{s.max_nodes}; start every agent with the same --nnodes"
            )
        self._readmit_expired(now)
        if (excluded := self.exclusion(req.node_id)) is not None:
            raise NodeExcludedError(excluded)
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
        secret = node_secret if kind is JoinKind.REJOIN and node_secret else new_secret()
        if kind is JoinKind.REPLACE:
            closed = self.liveness.suspected(req.node_id)
            why = "its connection to the master closed" if closed else "it stopped heartbeating"
            self.record(
                now, "node_replaced", f"node {req.node_id}: a new agent replaced the previous one ({why})"
            )
            self.wake_long_polls(req.node_id)  # the previous agent's pending long-polls: its secret is void
            # Its agent restarted before the dead verdict: a loss like that verdict (master.job.flapping).
            if (flapped := self.flapping.note(req.node_id, now, node.host, node.nproc)) is not None:
                self._remove(req.node_id, self._flap_line(flapped), "node_flapping_excluded", now, flapped)
                advance(self, now)
                raise NodeExcludedError(flapped.message(s.job_id))
        was_member = self.rdzv.is_member(req.node_id)
        if node is None:
            node = self.nodes[req.node_id] = NodeInfo(req.node_id, req.host, req.nproc)
        node.host, node.nproc, node.state = req.host, req.nproc, NodeState.WAITING
        node.joined_at = now
        node.secret_hash = hash_secret(secret)
        self.liveness.beat(req.node_id, now)
        self.rdzv.join(Candidate(req.node_id, req.host, req.nproc, req.store_port, now), now)
        if kind is not JoinKind.REJOIN or was_member:
            joined = f"node {req.node_id} ({req.host}, {req.nproc} workers) joined"
            self.record(now, "node_joined", joined, node=req.node_id)
        # else: the same agent back for the next round (every member, at every membership change). It
        # reveals nothing new (same secret, same round number), so it is neither an event nor a store
        # write: a job of N nodes would write N of each per change (the round's close records who came).
        if was_member and self.succeeded:
            why = f"member {req.node_id} restarted after other nodes had finished; cannot restart"
            self.finish(Outcome(succeeded=False, exit_code=EXIT_FAILED, summary=why), now)
        elif was_member:
            # A member joining a running round means its agent restarted: a membership change.
            open_round(self, now, f"member {req.node_id} rejoined", counted=False, cause=NODE_LOSS)
        advance(self, now)
        return JoinReply(round=self.rdzv.round, master_id=self.master_id, node_secret=secret)

    def next_round(self, node_id: str, after: int, node_secret: str | None) -> RoundReply | None:
        """The node's assignment in a round newer than ``after``; None while there is none yet. A finished
        job's outcome is answered to any caller (``GET /v1/status`` shows it too); anything else needs the
        node's secret."""
        if self.outcome is not None:
            return RoundReply(status="finished", outcome=self.outcome, round=self.rdzv.round)
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} has not joined job {self.settings.job_id}")
        self.authenticate(self.nodes[node_id], node_secret)
        current = self.rdzv.current
        if self.rdzv.phase is Phase.ACTIVE and current and current.number > after:
            slot = current.slot(node_id)
            if slot is not None:
                return RoundReply(status="assigned", assignment=assignment(self, slot), round=current.number)
        if not self.rdzv.has_joined(node_id) and not self.rdzv.is_member(node_id):
            raise UnknownNodeError(f"node {node_id} is not waiting for a round; join first")
        return None

    def heartbeat(self, req: HeartbeatRequest, now: float, node_secret: str | None) -> CommandReply:
        """Record a node's state; act on a failure or success; say what the node must do. Raises
        :class:`BadNodeSecretError`, having changed nothing, when ``node_secret`` is not the node's."""
        node = self.nodes.get(req.node_id)
        if node is None:
            if self.outcome is not None:
                return command_reply(self, Command.STOP)
            if self.exclusion(req.node_id) is not None:
                return exclude_reply(self, req.node_id)
            raise UnknownNodeError(
                f"node {req.node_id} is not part of job {self.settings.job_id}; join first"
            )
        self.authenticate(node, node_secret)
        if req.node_id not in self.succeeded:  # a finished node is no longer watched for liveness
            self.liveness.beat(req.node_id, now)
        node.note_workers(req.workers)
        note_persist(self, node, req, now)
        node.replication_port, node.replicated_step = req.replication_port, req.replicated_step
        node.replication_lag, node.replication_error = req.replication_lag, req.replication_error
        note_round_progress(self, node, req, now)
        if req.ckpt_step is not None and req.round == self.rdzv.round:
            note_checkpoint(self, node, req.ckpt_step)
        current_round = (
            req.round == self.rdzv.round
            and (req.term is None or req.term == self.round_term)
            and self.rdzv.is_member(req.node_id)
        )
        if current_round:  # soft state: a node's state in its round is never a store write of its own
            node.state, node.round = req.state, req.round
        if current_round and req.state is NodeState.FAILED and self.outcome is None:
            on_failure(self, node, req.failure, now)
            corroborate(self, req.node_id, now)
        elif current_round and req.node_check is not None and self.outcome is None:
            on_node_check(self, req.node_id, req.round, req.node_check, now)
        elif (
            current_round
            and req.state is NodeState.SUCCEEDED
            and self.outcome is None
            and node.node_id not in self.succeeded  # repeated reports are not new transitions
        ):
            on_success(self, node, now)
        reply = self.command_for(req.node_id, req.round, req.term)
        if req.replicas and reply.command is Command.CONTINUE and self.rdzv.is_member(req.node_id):
            reply = reply.model_copy(update={"peers": replica_targets(self, req.node_id, req.replicas)})
        return reply

    def leave(self, node_id: str, reason: str, now: float, node_secret: str | None) -> None:
        """Orderly departure (the agent was told to stop, e.g. preemption): a membership change."""
        if node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}")
        self.authenticate(self.nodes[node_id], node_secret)
        self._remove(node_id, f"node {node_id} left" + (f" ({reason})" if reason else ""), "node_left", now)
        advance(self, now)

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
        pending = self.pending_failure
        if pending is not None and pending.reporter != node_id and node_id in pending.members:
            # Another member's failure report (its collective broke) corroborates it: dead at once.
            self.liveness.suspect(node_id, now, 0.0)
            why = f"after node {pending.reporter} reported a failure; declared dead now"
        else:
            within = min(2 * s.heartbeat_interval_s, s.heartbeat_timeout_s)
            self.liveness.suspect(node_id, now, within)
            why = f"declared dead unless it heartbeats within {within:g}s"
        self.record(
            now, "node_suspect", f"node {node_id} closed its connection to the master {why}", node=node_id
        )

    def watch(
        self, node_id: str, node_round: int, node_secret: str | None, node_term: int | None = None
    ) -> CommandReply:
        """:meth:`command_for` for a node's watch long-poll. A node this master does not know gets
        :class:`UnknownNodeError`, as its heartbeat does: a master restarted without a durable store (or
        one that declared the node dead) must say so, not answer "rejoin" as if it had opened a round. A
        known node's secret is checked while the job runs (a finished job's outcome is no secret)."""
        if self.outcome is None and self.exclusion(node_id) is not None:
            return exclude_reply(self, node_id)
        if self.outcome is None and node_id not in self.nodes:
            raise UnknownNodeError(f"node {node_id} is not part of job {self.settings.job_id}; join first")
        if self.outcome is None:
            self.authenticate(self.nodes[node_id], node_secret)
        return self.command_for(node_id, node_round, node_term)

    def command_for(self, node_id: str, node_round: int, node_term: int | None = None) -> CommandReply:
        """What a node whose workers run in round ``(node_term, node_round)`` must do now."""
        return command_for(self, node_id, node_round, node_term)

    # -- time -------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply every time-driven transition: dead nodes, round close, growth, join timeout."""
        if self.outcome is not None:
            return
        if now - self.aggregates_at >= AGGREGATE_PERIOD_S:
            refresh_aggregates(self, now)
        self._readmit_expired(now)
        for node_id in self.liveness.dead(now):
            age = self.liveness.age(node_id, now)
            lost = self.nodes.get(node_id)
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
            if lost is not None and (flapped := self.flapping.note(node_id, now, lost.host, lost.nproc)):
                self._record_flap_exclusion(flapped, now)
        advance(self, now)

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
        self.record(now, "node_readmitted", f"node {node_id} re-admitted by an operator", node=node_id)
        self.wake_long_polls(node_id)

    # -- views ------------------------------------------------------------------------------------
    def info(self) -> JobInfo:
        return job_info(self)

    def status(self, now: float) -> JobStatus:
        return job_status(self, now)

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything a master taking over needs; plain JSON-able data (master.job.snapshot)."""
        return snapshot_of(self)

    @classmethod
    def restore(
        cls, settings: JobSettings, data: dict, now: float, master_id: str | None = None, term: int = 0
    ) -> Job:
        """A job continued from :meth:`snapshot` by a (new) master (master.job.snapshot.restore_into).

        Raises ValueError, KeyError or TypeError for a state it cannot read (master.store.state_schema)."""
        job = cls(settings, now, master_id, term)
        restore_into(job, data, now)
        return job

    # -- internals --------------------------------------------------------------------------------
    def _remove(
        self,
        node_id: str,
        why: str,
        kind: str,
        now: float,
        flapped: Exclusion | None = None,
        began_at: float | None = None,
    ) -> None:
        """Drop a node (``began_at``: when it was last seen alive, where detecting its loss started;
        ``flapped``: the exclusion that removes it, for its event's data)."""
        update_committed_step(self)  # while the node's report still counts
        self.ckpt_floor.lose(node_id)
        was_member = self.rdzv.is_member(node_id) and node_id not in self.succeeded
        self.liveness.forget(node_id)
        self.rdzv.remove(node_id, now)
        node = self.nodes.pop(node_id, None)
        if node is None:
            return
        self.removed_count += 1
        self.wake_long_polls(node_id)  # its own long-polls answer differently now (a member's: a round opens)
        began = now if began_at is None else began_at
        data = _flap_data(flapped) if flapped is not None else {}
        self.record(
            now, kind, why, node=node_id, cause=NODE_LOSS, durations={"detect": now - began}, data=data
        )
        attribute_failure_to_loss(self, node_id, now, began)
        if not was_member or self.outcome is not None:
            return
        if self.succeeded:
            self.finish(
                Outcome(
                    succeeded=False,
                    exit_code=EXIT_FAILED,
                    summary=f"{why} after other nodes had finished; cannot restart",
                ),
                now,
            )
            return
        open_round(self, now, why, counted=False, cause=NODE_LOSS, began_at=began)
        advance(self, now)

    def _flap_line(self, flapped: Exclusion) -> str:
        return (
            f"node {flapped.node_id} excluded for flapping: lost {flapped.count} times within "
            f"{flapped.window_s:g}s (more than --flap-limit {flapped.limit}); re-admitted at "
            f"{clock_time(flapped.until)} or by 'elastic-master readmit {flapped.node_id}'"
        )

    def _record_flap_exclusion(self, flapped: Exclusion, now: float) -> None:
        """An exclusion of a node that is gone already (its loss was a dead verdict)."""
        line = self._flap_line(flapped)
        self.record(now, "node_flapping_excluded", line, node=flapped.node_id, data=_flap_data(flapped))
        self.wake_long_polls(flapped.node_id)  # its agent's pending long-polls now answer "exclude"

    def _readmit_expired(self, now: float) -> None:
        for over in self.flapping.expired(now):
            self.record(
                now,
                "node_readmitted",
                f"node {over.node_id} re-admitted: its flapping cool-down of "
                f"{over.until - over.since:g}s is over",
                node=over.node_id,
            )
            self.wake_long_polls(over.node_id)


def _flap_data(flapped: Exclusion) -> dict:
    return {"count": flapped.count, "window_s": flapped.window_s, "until": flapped.until}
