"""The job's state and the primitives every transition uses: record an event, finish the job, note the
effects for the server. The transitions live in :mod:`master.job.job` (requests, time),
:mod:`master.job.round_flow` (rounds), :mod:`master.job.results` (failures and successes) and
:mod:`master.job.progress` (soft state from heartbeats); they all work on a :class:`JobState`.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    NODE_SECRET_HEADER,
    CommandReply,
    Outcome,
)
from master.job.credentials import matches
from master.job.effects import Effects, EffectsBuffer
from master.job.errors import (
    BadNodeSecretError,
)
from master.job.events import Event
from master.job.flapping import FlapCounter, FlapPolicy
from master.job.goodput import GoodputAccount
from master.job.liveness import Liveness
from master.job.node_check import NodeCheck
from master.job.node_info import NodeInfo
from master.job.recovery_phases import RecoveryTracker
from master.job.rendezvous import Rendezvous
from master.job.stats import JobStats
from master.job.step_floor import StepFloor
from master.job.stragglers import StragglerTracker

EXIT_FAILED = 1
#: Seconds between two computations of the job-wide aggregates (committed step, stragglers) in tick().
AGGREGATE_PERIOD_S = 0.5


@dataclass(frozen=True)
class PendingFailure:
    """A worker failure whose restart is charged provisionally until the restart round closes."""

    round: int
    members: frozenset[str]
    cause: str
    counted: bool  # False when the budget was already spent: the job fails at the close
    reporter: str = ""  # the node that reported it: its report corroborates another member's closed link


class JobState:
    """All master-side state of one job (no transitions beyond the primitives below)."""

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
        self.ckpt_floor = StepFloor()  # the running round's members' checkpoint steps (soft state)
        self.outcome: Outcome | None = None
        self.events: deque[Event] = deque(maxlen=1000)
        self.event_count = 0  # events ever recorded (the deque keeps the newest)
        #: Bumped by every change of durable state (master.job.effects): what the store must hold before a
        #: reply reveals it. Soft state (steps, committed step, heartbeat ages) never bumps it.
        self.version = 0
        #: The leader's term (master.store.base.StateStore.term), set by the server when it leads.
        self.term = term
        #: The term in which the current round number was opened: a round is ``(round_term, number)``.
        self.round_term = 0
        self._effects = EffectsBuffer()
        #: Replies shared by every node (master.job.replies.command_reply): frozen models, built once.
        self.replies: dict[tuple, CommandReply] = {}
        self.round_failed: set[int] = set()  # rounds whose failure was already counted
        self.pending_failure: PendingFailure | None = None
        self.succeeded: set[str] = set()  # members of the current round that finished
        self.started_at = now
        self.stragglers = StragglerTracker(settings.straggler_factor)
        self.node_check = NodeCheck(settings.node_check, settings.node_check_factor)
        self.excluded_nodes: dict[str, NodeInfo] = {}  # by the node check; kept for the status view
        self.flapping = FlapCounter(FlapPolicy.of(settings))  # durable: losses and exclusions
        self.removed_count = 0  # nodes ever removed (dead, left, excluded): part of long_poll_key()
        self.aggregates_at = float("-inf")  # when _refresh_aggregates() last ran
        self.goodput = GoodputAccount(started_at=now)
        self.recovery = RecoveryTracker()
        self.stats = JobStats()
        self.persisted_newest: int | None = None  # newest persisted step any node reported (soft state)
        self.persisted_high: int | None = None  # newest persisted step seen (counts persisted checkpoints)
        self.persisted_at: float | None = None  # when it last moved forward (soft state)
        self.record(now, "job_started", f"job {settings.job_id} started (master {self.master_id})")

    def training_started(self, at: float) -> dict:
        return {"training": "started", "training_at": at} if self.goodput.start(at) else {}

    def training_stopped(self, at: float) -> dict:
        """Stop goodput's training clock at ``at``; the data to put on the event that stopped it."""
        return {"training": "stopped", "training_at": at} if self.goodput.stop(at) else {}

    def record(self, now: float, kind: str, message: str, **fields) -> None:
        """Record one state change (``fields``: round, node, cause, durations, data of :class:`Event`)."""
        self.event_count += 1
        event = Event(now, kind, message, seq=self.event_count, **fields)
        self.events.append(event)
        self.stats.apply(event)
        self._effects.events.append(event)
        self.version += 1

    def finish(self, outcome: Outcome, now: float) -> None:
        self.outcome = outcome
        self.wake_long_polls()
        training = self.training_stopped(now)
        self.goodput.end(now)
        self.record(
            now, "job_succeeded" if outcome.succeeded else "job_failed", outcome.summary, data=training
        )

    def is_check_round(self, number: int) -> bool:
        """Whether round ``number`` is (or, closing while the check is pending, becomes) a node-check
        round, which trains nothing (read-only, unlike NodeCheck.covers)."""
        check = self.node_check
        return check.mode != "off" and (number in check.rounds or not check.done)

    def wake_long_polls(self, node_id: str | None = None) -> None:
        """Note that pending ``/v1/round`` or ``/v1/watch`` answers may have changed (an effect): those of
        ``node_id`` alone when given (its answers changed, nobody else's), else everyone's."""
        if node_id is None:
            self._effects.wake = True
        else:
            self._effects.wake_nodes.add(node_id)

    def forget_effects(self) -> None:
        """Drop the effects recorded so far (a restored job's stored events are not new)."""
        self._effects = EffectsBuffer()

    def take_effects(self) -> Effects:
        """What the mutations since the last call did: the events they recorded, whether durable state
        changed (the store must hold :attr:`version` before a reply reveals it) and whether a pending
        long-poll may now answer differently. The server calls this after every request and tick."""
        return self._effects.take(self.version)

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
            len(self.flapping.excluded),
        )

    def exclusion(self, node_id: str) -> str | None:
        """The line an excluded node's agent exits with (node check or flapping); None if not excluded."""
        if node_id in self.node_check.excluded:
            return self.node_check.excluded[node_id]
        flapped = self.flapping.excluded.get(node_id)
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
