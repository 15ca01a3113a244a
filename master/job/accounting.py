"""What the job's failures and time cost: the restart budget, goodput, recovery phases and lifetime totals.
Pure: no clock (time comes in as arguments), no I/O; each part owns its own state and is durable through
the job's snapshot (a failover continues them).

**The restart budget** (:class:`RestartBudget`): how many restarts of the world the job's failures have
spent, of ``--max-restarts``.

A worker failure costs one restart of the world, once per round (however many of its workers report it).
The charge is provisional until the restart round closes: when a peer node dies, the survivors' collectives
fail *before* the heartbeat timeout declares it dead, and that is a membership change, not a failure. So:

* :meth:`RestartBudget.charge` on a round's first failure report: one restart is spent if any is left
  (else the failure is kept *uncounted*: the job fails at the close unless a loss explains it);
* :meth:`RestartBudget.refund` when a member of that round is lost before the close: the failure followed
  the loss, the restart is given back (an uncounted failure is dropped);
* :meth:`RestartBudget.settle` at the round's close: the pending failure stands; an uncounted one is
  returned, and the job fails with it.

Pure: no clock (the job decides when each applies), no I/O. This is the one place the spent count changes;
it is durable (the job's snapshot holds :meth:`snapshot`), a failure's pending state is not (a master taking
over mid-recovery settles nothing it did not charge).

Before a round's first failure is charged, the job asks the budget's crash-loop policy
(:mod:`master.job.crash_loop`) whether it is deterministic: then the job stops at once (exit 3) instead of
charging it. The policy's series is durable with the budget (under the snapshot's key ``crash_loop``), and a
refund takes the refunded failure out of it (a failure that followed a node's loss is no failure of the
job's own).

**Goodput** (:class:`GoodputAccount`): the share of the job's wall-clock time that was training.

*Training time* is the time during which the workers of a full round were stepping: it starts when every
member of a round has reported its first step in that round (``first_step`` event), and ends at the
earliest moment the world is known to have broken (the worker exit the agent saw, a hung worker's last
progress, a lost node's last heartbeat), at a round opened for a membership change, or at the job's end.
*Wall time* runs from the job's start (``job_started`` event) to now, or to the job's end once it ended.
``goodput = training time / wall time``. Rendezvous, restarts, restores, the first step of every round
and the time a broken world took to be detected all count as lost. The same figures can be recomputed
from the event log: the events that start or stop training carry ``data.training`` (``started`` or
``stopped``) and the exact moment in ``data.training_at``. A ``stopped`` mark while training is already
stopped moves the end of the last training period back to its ``training_at`` (never before that period's
start): the world turned out to have broken earlier than first known (a worker failure that followed a
node's loss: training stopped at the lost node's last heartbeat, :meth:`GoodputAccount.stop_earlier`).

**Recovery phases** (:class:`RecoveryTracker`): where the time between a broken world and its next training
step went.

A *recovery* begins when a running world breaks and ends when every member of a new round has reported
its first step. Its phases, defined from what the system sees:

* ``detect``: from the moment the world broke (the worker exit its agent saw, a hung worker's last
  progress, a lost node's last heartbeat, a waiting node's join for a scale-up) to the master's verdict;
* ``rendezvous``: from the verdict to the close of the next round;
* ``restart``: from the round's close to the moment the last member started its workers;
* ``first_step``: from then to the moment the last member's workers had all reported a step.

A verdict during a recovery (another failure before the first step) continues the same recovery: the time
so far stays in the phases it was spent in, and the recovery goes back to ``rendezvous``. Every second
between the beginning and the end is counted in exactly one phase. The cause is the first verdict's,
unless the master re-attributes it (a failure that followed a node's loss is a node loss); a node loss
also moves the beginning back to the lost node's last heartbeat, which lengthens ``detect`` (a survivor's
worker usually fails on the dead peer's collective well before the heartbeat timeout says it is dead).

**Lifetime totals** (:class:`JobStats`): restarts, verdicts, steps lost, recovery phases, derived from the
job's events, so that the metrics exported from them (:mod:`master.http.metrics`) never go backwards for a
job. Fed one :class:`~master.job.events.Event` at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import Outcome
from elastic.exit_codes import ExitCode
from master.job.crash_loop import CrashLoop, CrashLoopPolicy
from master.job.events import Cause, Event, EventKind

if TYPE_CHECKING:
    from master.job.progress import NodeInfo


@dataclass(frozen=True)
class PendingFailure:
    """A worker failure whose restart is charged provisionally until the restart round closes."""

    round: int
    members: frozenset[str]
    cause: str
    counted: bool  # False when the budget was already spent: the job fails at the close
    reporter: str = ""  # the node that reported it: its report corroborates another member's closed link
    reported_at: float | None = None  # when the master had the report
    #: A stall (a hang report): a member silent to the master corroborates it too (master.job.liveness).
    stalled: bool = False

    def declared_later(self, now: float) -> str:
        """`` (declared dead 0.4 s after the failure report)`` for a peer declared dead ``now`` whose loss
        explains this failure; ``""`` when the report's time is unknown."""
        if self.reported_at is None:
            return ""
        return f" (declared dead {max(0.0, now - self.reported_at):.1f} s after the failure report)"


#: Integrity rollbacks a budget remembers having charged (each is reported a few times, close together).
ROLLBACKS_KEPT = 64


class RestartBudget:
    """Restarts spent of ``max_restarts``; the failure charged provisionally, if any (module docstring)."""

    def __init__(
        self,
        max_restarts: int,
        spent: int = 0,
        charged_rounds: Iterable[int] = (),
        crash_loop: CrashLoop | None = None,
        charged_rollbacks: Iterable[Iterable[int]] = (),
    ) -> None:
        self.max_restarts = max_restarts
        self._spent = spent
        self._charged_rounds: set[int] = set(charged_rounds)  # rounds whose failure was charged
        #: Integrity rollbacks charged, as (step of the detection, step rolled back to); the newest only.
        self._charged_rollbacks: list[tuple[int, int]] = [(int(a), int(b)) for a, b in charged_rollbacks][
            -ROLLBACKS_KEPT:
        ]
        self._pending: PendingFailure | None = None
        #: The crash-loop policy and its series (durable with the budget).
        self.crash_loop = crash_loop if crash_loop is not None else CrashLoop(CrashLoopPolicy())

    @classmethod
    def of(cls, settings: JobSettings, data: dict[str, Any] | None = None) -> RestartBudget:
        """The budget of a job with ``settings``: new, or continued from a job snapshot ``data``."""
        crash_loop = CrashLoop(CrashLoopPolicy.of(settings))
        crash_loop.restore((data or {}).get("crash_loop"))
        budget = cls.restore(settings.max_restarts, data or {})
        budget.crash_loop = crash_loop
        return budget

    @property
    def spent(self) -> int:
        """Restarts charged and not refunded (the job's ``restart_count``)."""
        return self._spent

    @property
    def pending(self) -> PendingFailure | None:
        """The failure charged provisionally, until its restart round closes or a loss refunds it."""
        return self._pending

    def charged(self, round_number: int) -> bool:
        """Whether a failure of round ``round_number`` was charged already (one restart per round)."""
        return round_number in self._charged_rounds

    def charge(
        self,
        round_number: int,
        members: Iterable[str],
        cause: str,
        reporter: str,
        reported_at: float | None = None,
        stalled: bool = False,
    ) -> PendingFailure | None:
        """A failure in round ``round_number`` (whose members are ``members``), reported by ``reporter``
        (``stalled``: a hang): charge one restart if any is left, provisionally. None, charging nothing,
        when that round's failure was charged already."""
        if round_number in self._charged_rounds:
            return None
        self._charged_rounds.add(round_number)
        counted = self._spent < self.max_restarts
        if counted:
            self._spent += 1
        self._pending = PendingFailure(
            round_number, frozenset(members), cause, counted, reporter, reported_at, stalled
        )
        return self._pending

    def charge_rollback(self, step: int, rolled_back_to: int) -> bool | None:
        """An integrity rollback from the detection at ``step`` to verified step ``rolled_back_to``
        (master.job.findings), which keeps the workers and their round: charge one restart. True when
        charged, False when the budget was spent (the job fails: :meth:`exhausted`), None when this
        rollback was charged already (several ranks report it; a master taking over may see it again)."""
        key = (step, rolled_back_to)
        if key in self._charged_rollbacks:
            return None
        self._charged_rollbacks = [*self._charged_rollbacks, key][-ROLLBACKS_KEPT:]
        if self._spent >= self.max_restarts:
            return False
        self._spent += 1
        return True

    def exhausted(self, cause: str) -> Outcome:
        """The job's outcome when a failure or a rollback (``cause``) finds the budget spent."""
        summary = (
            f"job failed after {self._spent + 1} attempt(s) (max restarts {self.max_restarts}); "
            f"root cause: {cause}"
        )
        return Outcome(succeeded=False, exit_code=ExitCode.FAILED, summary=summary)

    def refund(self, node_id: str) -> PendingFailure | None:
        """``node_id`` was lost before the restart round closed: if it was a member of the pending
        failure's round, that failure followed its loss (a membership change): give its restart back and
        return it. None when no pending failure concerns the node."""
        pending = self._pending
        if pending is None or node_id not in pending.members:
            return None
        if pending.counted:
            self._spent -= 1
        self._pending = None
        self.crash_loop.forget(pending.round)
        return pending

    def settle(self) -> PendingFailure | None:
        """The restart round closed: the pending failure stands. Returns it when it was not counted (the
        budget was spent: the job fails with it), else None."""
        pending, self._pending = self._pending, None
        return pending if pending is not None and not pending.counted else None

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The durable part, under the job snapshot's keys."""
        return {
            "restart_count": self._spent,
            "round_failed": sorted(self._charged_rounds),
            "rollbacks_charged": [list(key) for key in self._charged_rollbacks],
            "crash_loop": self.crash_loop.snapshot(),
        }

    @classmethod
    def restore(cls, max_restarts: int, data: dict[str, Any]) -> RestartBudget:
        """From a job snapshot holding :meth:`snapshot`'s keys (absent: nothing spent)."""
        return cls(
            max_restarts,
            int(data.get("restart_count", 0)),
            data.get("round_failed", []),
            charged_rollbacks=data.get("rollbacks_charged", []),
        )


@dataclass
class GoodputAccount:
    """Training time and wall time of one job; durable through :meth:`snapshot` (Unix-anchored times)."""

    started_at: float
    training_s: float = 0.0
    training_since: float | None = None  # set while a full world is stepping
    ended_at: float | None = None
    #: The last finished training period (start, end), which :meth:`stop_earlier` may shorten.
    last_period: tuple[float, float] | None = None

    @property
    def training(self) -> bool:
        return self.training_since is not None

    def start(self, at: float) -> bool:
        """The full world steps from ``at`` on; False when it already did (nothing changes)."""
        if self.training or self.ended_at is not None:
            return False
        self.training_since = at
        return True

    def stop(self, at: float) -> bool:
        """Training stopped at ``at`` (possibly before now: a failure seen earlier); False if it was not
        training. A stop before the start (clock noise between nodes) counts as no training."""
        if self.training_since is None:
            return False
        self.training_s += max(0.0, at - self.training_since)
        self.last_period = (self.training_since, max(at, self.training_since))
        self.training_since = None
        return True

    def started_event(self, at: float) -> dict[str, Any]:
        """Start the training clock at ``at``; the data to put on the event that started it."""
        return {"training": "started", "training_at": at} if self.start(at) else {}

    def stopped_event(self, at: float) -> dict[str, Any]:
        """Stop the training clock at ``at``; the data to put on the event that stopped it."""
        return {"training": "stopped", "training_at": at} if self.stop(at) else {}

    def stop_earlier(self, at: float) -> float | None:
        """The last training period ended at ``at``, not when :meth:`stop` said (the world is found to have
        broken earlier). Returns the period's new end (``at``, but not before the period began), or None
        when nothing changes: training runs, no period ended yet, or it did not end after ``at``."""
        if self.training_since is not None or self.last_period is None:
            return None
        began, ended = self.last_period
        new_end = max(at, began)
        if new_end >= ended:
            return None
        self.training_s -= ended - new_end
        self.last_period = (began, new_end)
        return new_end

    def end(self, at: float) -> None:
        """The job ended: training stops and the wall time stops growing."""
        self.stop(at)
        if self.ended_at is None:
            self.ended_at = at

    def training_time(self, now: float) -> float:
        running = max(0.0, now - self.training_since) if self.training_since is not None else 0.0
        return self.training_s + running

    def ratio(self, now: float) -> float | None:
        """Training time / wall time since the start; None before any wall time passed."""
        until = self.ended_at if self.ended_at is not None else now
        wall = until - self.started_at
        if wall <= 0:
            return None
        return min(1.0, self.training_time(until) / wall)

    def snapshot(self) -> dict:
        return {
            "started_at": self.started_at,
            "training_s": self.training_s,
            "training_since": self.training_since,
            "ended_at": self.ended_at,
            "last_period": list(self.last_period) if self.last_period is not None else None,
        }

    @classmethod
    def restore(cls, data: dict | None, now: float) -> GoodputAccount:
        """From :meth:`snapshot`; a snapshot without it (an older master) starts counting at ``now``."""
        if not data:
            return cls(started_at=now)
        period = data.get("last_period")  # absent in an older snapshot
        return cls(
            started_at=float(data["started_at"]),
            training_s=float(data.get("training_s", 0.0)),
            training_since=data.get("training_since"),
            ended_at=data.get("ended_at"),
            last_period=(float(period[0]), float(period[1])) if period else None,
        )


PHASES = ("detect", "rendezvous", "restart", "first_step")


@dataclass
class Recovery:
    """One recovery in progress (or done): its cause, the seconds per phase, and the phase it is in."""

    cause: str
    began_at: float
    phase: str = "rendezvous"
    since: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def move(self, phase: str, at: float) -> None:
        """Charge the time since the last move to the current phase; continue in ``phase`` from ``at``."""
        self.seconds[self.phase] += max(0.0, at - self.since)
        self.phase, self.since = phase, max(at, self.since)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class RoundStart:
    """Which members of a closed round started their workers and stepped, and when (soft state)."""

    number: int
    members: frozenset[str]
    closed_at: float = 0.0
    started: dict[str, float] = field(default_factory=dict)
    stepped: dict[str, float] = field(default_factory=dict)
    all_started_at: float | None = None
    all_stepped_at: float | None = None


class RecoveryTracker:
    """Follows rounds and verdicts; says when a round's workers all started, stepped, and what a finished
    recovery cost. The job feeds it and turns what it returns into events."""

    def __init__(self) -> None:
        self.recovery: Recovery | None = None
        self.round: RoundStart | None = None
        #: When the current world began (its round closed, or its recovery ended): no break before it.
        self.world_since: float | None = None

    def verdict(self, cause: str, began_at: float, at: float) -> None:
        """A running world broke (``began_at``) and the master decided so (``at``)."""
        if self.recovery is None:
            self.recovery = Recovery(cause, began_at, since=began_at, phase="detect")
        self.recovery.move("rendezvous", at)
        self.round = None  # the round that was starting is over

    def reattribute(self, cause: str, broke_at: float | None = None) -> None:
        """The recovery's cause is another than first judged (e.g. a failure caused by a node's loss),
        and the world broke at ``broke_at`` when that is earlier than its beginning so far (not before
        the broken world began): the difference is added to ``detect``."""
        r = self.recovery
        if r is None:
            return
        r.cause = cause
        if broke_at is None:
            return
        if self.world_since is not None:
            broke_at = max(broke_at, self.world_since)
        if broke_at < r.began_at:
            r.seconds["detect"] += r.began_at - broke_at
            r.began_at = broke_at

    def round_closed(self, number: int, members: list[str], at: float) -> None:
        self.round = RoundStart(number, frozenset(members), closed_at=at)
        self.world_since = at
        if self.recovery is not None:
            self.recovery.move("restart", at)

    def node_started(self, node_id: str, number: int, at: float) -> float | None:
        """A member's workers of round ``number`` started at ``at``; returns when the last member's did,
        once every member's have (and only that once).

        Every heartbeat repeats the moment (as an age), and the master dates it on the heartbeat's arrival,
        so each estimate is late by that heartbeat's transit, which is longest right after a start (the
        new workers' start-up competes for the CPU): until every member stepped, the earliest estimate of
        each member counts, and the split between ``restart`` and ``first_step`` follows it."""
        rnd = self.round
        if rnd is None or rnd.number != number or node_id not in rnd.members:
            return None
        # An estimate (arrival minus the reported age) can fall a little before the close that the start
        # followed; the phases never run backwards.
        at = max(at, rnd.closed_at)
        if node_id in rnd.started:
            if rnd.all_stepped_at is None and at < rnd.started[node_id]:
                rnd.started[node_id] = at
                self._restarted_earlier(rnd)
            return None
        rnd.started[node_id] = at
        if len(rnd.started) < len(rnd.members):
            return None
        rnd.all_started_at = max(rnd.started.values())
        if self.recovery is not None:
            self.recovery.move("first_step", rnd.all_started_at)
        return rnd.all_started_at

    def _restarted_earlier(self, rnd: RoundStart) -> None:
        """A better estimate moved the moment the last member started back: so does the phase split."""
        if rnd.all_started_at is None:
            return
        moved = max(0.0, rnd.all_started_at - max(rnd.started.values()))
        r = self.recovery
        if r is not None and r.phase == "first_step":
            moved = min(moved, r.seconds["restart"])  # not before the round closed
            r.seconds["restart"] -= moved
            r.since -= moved  # the first step phase began that much earlier
        rnd.all_started_at -= moved

    def node_stepped(self, node_id: str, number: int, at: float) -> tuple[float, Recovery | None] | None:
        """A member's workers of round ``number`` have all reported a step (by ``at``). Once every member
        has stepped (after all started): when the last one did, and the recovery this ends, if any."""
        rnd = self.round
        if rnd is None or rnd.number != number or node_id not in rnd.started or node_id in rnd.stepped:
            return None  # a member counts as stepped only after it counted as started
        rnd.stepped[node_id] = at
        if len(rnd.stepped) < len(rnd.members) or rnd.all_started_at is None:
            return None
        return self._all_stepped(rnd)

    def _all_stepped(self, rnd: RoundStart) -> tuple[float, Recovery | None] | None:
        if rnd.all_stepped_at is not None:
            return None
        rnd.all_stepped_at = max(max(rnd.stepped.values()), rnd.all_started_at or 0.0)
        self.world_since = rnd.all_stepped_at
        done, self.recovery = self.recovery, None
        if done is not None:
            done.move("first_step", rnd.all_stepped_at)
        return rnd.all_stepped_at, done

    def snapshot(self) -> dict | None:
        """The recovery in progress (durable, so a failover does not lose its phases)."""
        r = self.recovery
        if r is None:
            return None
        return {
            "cause": r.cause,
            "began_at": r.began_at,
            "phase": r.phase,
            "since": r.since,
            "seconds": r.seconds,
        }

    def restore(self, data: dict | None, round_number: int | None, members: list[str]) -> None:
        """Continue a stored recovery; the round's starts and steps come back with the heartbeats."""
        if data:
            self.recovery = Recovery(
                data["cause"],
                float(data["began_at"]),
                data["phase"],
                float(data["since"]),
                dict(data["seconds"]),
            )
        if round_number is not None:
            closed_at = float(data["since"]) if data and data["phase"] == "restart" else 0.0
            self.round = RoundStart(round_number, frozenset(members), closed_at=closed_at)


#: Upper bounds (seconds) of the recovery histogram's buckets; +Inf is implied.
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: Event kinds that are verdicts about a node, with the verdict's kind (a worker failure splits by cause).
_VERDICTS: dict[str, str] = {  # keyed by members: they answer lookups by an event's plain text too
    EventKind.NODE_DEAD: "dead",
    EventKind.NODE_LEFT: "left",
    EventKind.NODE_SUSPECT: "suspect",
    EventKind.NODE_EXCLUDED: "excluded",
    EventKind.NODE_FLAPPING_EXCLUDED: "excluded",
    EventKind.STRAGGLER_EVICTED: "excluded",
    EventKind.NODE_SUSPECT_EXCLUDED: "excluded",
    EventKind.STRAGGLER: "straggler",
}


@dataclass
class Histogram:
    """Cumulative-bucket counts of observations, as Prometheus exposes them."""

    buckets: list[int] = field(default_factory=lambda: [0] * len(RECOVERY_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(RECOVERY_BUCKETS):
            if value <= bound:
                self.buckets[i] += 1
        self.count += 1
        self.total += value


@dataclass
class JobStats:
    """Counters of one job's life (a failover continues them)."""

    restarts: int = 0  # running worlds stopped by a verdict (any cause): the workers restarted
    steps_lost: int = 0
    redone_s: float = 0.0  # those steps' time, at the step time when they were lost (redone_seconds)
    verdicts: dict[str, int] = field(default_factory=dict)
    persist_failures: int = 0
    leader_changes: int = 0
    checkpoints_committed: int = 0  # times the job's committed step moved forward
    checkpoints_persisted: int = 0  # times the newest step some node made durable moved forward
    checkpoint_corrupt: int = 0  # checkpoint copies found failing their digest (restore or persist)
    integrity: dict[str, int] = field(default_factory=dict)  # guard detections by kind, and "rolled_back"
    recovery: dict[tuple[str, str], Histogram] = field(default_factory=dict)  # (phase, cause) ->

    def apply(self, event: Event) -> None:
        """Count what ``event`` says happened."""
        kind = event.kind
        if kind == EventKind.ROUND_OPENED and event.cause:
            self.restarts += 1
            self.steps_lost += int(event.data.get("steps_lost", 0))
            self.redone_s += float(event.data.get("redone_s", 0.0))
        elif kind == EventKind.WORKER_FAILED:
            self._verdict(Cause.HANG if event.cause == Cause.HANG else Cause.WORKER_FAILURE)
        elif kind in _VERDICTS:
            self._verdict(_VERDICTS[kind])
        elif kind == EventKind.PERSIST_FAILED:
            self.persist_failures += 1
        elif kind == EventKind.CHECKPOINT_CORRUPT:
            self.checkpoint_corrupt += 1
        elif kind in (EventKind.INTEGRITY_DETECTED, EventKind.INTEGRITY_ROLLED_BACK):
            what = str(event.data.get("kind", "")) if kind == EventKind.INTEGRITY_DETECTED else "rolled_back"
            self.integrity[what] = self.integrity.get(what, 0) + 1
        elif kind == EventKind.MASTER_TAKEOVER:
            self.leader_changes += 1
        elif kind == EventKind.FIRST_STEP and event.cause:
            for phase in PHASES:
                if phase in event.durations:
                    key = (phase, str(event.cause))
                    self.recovery.setdefault(key, Histogram()).observe(float(event.durations[phase]))

    def _verdict(self, kind: str) -> None:
        self.verdicts[str(kind)] = self.verdicts.get(str(kind), 0) + 1

    def snapshot(self) -> dict:
        return {
            "restarts": self.restarts,
            "steps_lost": self.steps_lost,
            "redone_s": self.redone_s,
            "verdicts": dict(self.verdicts),
            "persist_failures": self.persist_failures,
            "leader_changes": self.leader_changes,
            "checkpoints_committed": self.checkpoints_committed,
            "checkpoints_persisted": self.checkpoints_persisted,
            "checkpoint_corrupt": self.checkpoint_corrupt,
            "integrity": dict(self.integrity),
            "recovery": [
                {"phase": p, "cause": c, "buckets": h.buckets, "count": h.count, "sum": h.total}
                for (p, c), h in self.recovery.items()
            ],
        }

    @classmethod
    def restore(cls, data: dict | None) -> JobStats:
        """From :meth:`snapshot`; an older snapshot without stats starts from zero."""
        if not data:
            return cls()
        stats = cls(
            restarts=int(data.get("restarts", 0)),
            steps_lost=int(data.get("steps_lost", 0)),
            redone_s=float(data.get("redone_s", 0.0)),
            verdicts={str(k): int(v) for k, v in (data.get("verdicts") or {}).items()},
            persist_failures=int(data.get("persist_failures", 0)),
            leader_changes=int(data.get("leader_changes", 0)),
            checkpoints_committed=int(data.get("checkpoints_committed", 0)),
            checkpoints_persisted=int(data.get("checkpoints_persisted", 0)),
            checkpoint_corrupt=int(data.get("checkpoint_corrupt", 0)),
            integrity={str(k): int(v) for k, v in (data.get("integrity") or {}).items()},
        )
        for h in data.get("recovery") or []:
            if len(h["buckets"]) == len(RECOVERY_BUCKETS):  # buckets of another layout are dropped
                stats.recovery[(h["phase"], h["cause"])] = Histogram(list(h["buckets"]), h["count"], h["sum"])
        return stats


# -- goodput and badput buckets -------------------------------------------------------------------------
#: The named parts of the time that was not productive training, in the order they are shown. Recovery
#: phases map to the first four (``detect`` -> detection, ``rendezvous`` -> rendezvous, ``restart`` ->
#: re_form, ``first_step`` -> restore: the restore of the checkpoint and the first step after it);
#: ``redone_steps``: steps trained past the committed checkpoint of a world that broke (trained twice; the
#: name Google's goodput library gives it: wasted progress from disruption); ``waiting_for_nodes``: the part
#: of the rendezvous spent with fewer nodes than the minimum; ``other``: the rest (the job's start-up before
#: its first step, and any time no recovery explains).
BADPUT_BUCKETS = (
    "detection",
    "rendezvous",
    "re_form",
    "restore",
    "redone_steps",
    "waiting_for_nodes",
    "other",
)
_PHASE_BUCKET = {
    "detect": "detection",
    "rendezvous": "rendezvous",
    "restart": "re_form",
    "first_step": "restore",
}


def lost_work(members: Iterable[NodeInfo], committed_step: int | None) -> tuple[int, float]:
    """What a world that broke had trained past the newest step a member saved (or the committed step,
    when newer), in steps and in seconds (:func:`redone_seconds`): the steps its next round trains again.
    The next round resumes from the newest copy any rank holds (elastic.load's and elastic.run's
    agreements), not from the committed step, which is the members' *lowest* saved step and trails each
    node's own by up to a heartbeat: counted from it, a round over-counted the redone steps by the steps
    of that heartbeat (a 30-minute chaos run: 29 s where 11.5 s were redone)."""
    members = list(members)
    steps = [m.step for m in members if m.step is not None]
    resumed = max([committed_step or 0, *(m.ckpt_step for m in members if m.ckpt_step is not None)])
    lost = max(0, max(steps) - resumed) if steps else 0
    return lost, redone_seconds(lost, (m.step_time_s for m in members))


def _trained_through(phase: str, cause: str) -> bool:
    """Whether the world kept training during ``phase`` of a recovery of ``cause``: a scale-up's detection
    runs from the waiting node's join to the verdict, while the members train (their training stops at
    the verdict), so it is no lost time."""
    return phase == "detect" and cause == Cause.SCALE_UP


def redone_seconds(steps_lost: int, step_times: Iterable[float | None]) -> float:
    """The time of ``steps_lost`` steps at the members' step time (the lower median of those known; the
    node is as slow as its slowest worker); 0 when no step time is known."""
    known = sorted(t for t in step_times if t is not None and t > 0)
    if steps_lost <= 0 or not known:
        return 0.0
    return steps_lost * known[(len(known) - 1) // 2]


@dataclass(frozen=True)
class Goodput:
    """The job's goodput and its badput buckets at one moment (:func:`goodput_of`)."""

    wall_s: float
    productive_s: float  # training time less the redone steps' time
    badput_s: dict[str, float]  # by BADPUT_BUCKETS name; productive_s + their sum = wall_s

    @property
    def ratio(self) -> float | None:
        """Productive time / wall time; None before any wall time passed."""
        return min(1.0, max(0.0, self.productive_s / self.wall_s)) if self.wall_s > 0 else None


def goodput_of(
    goodput: GoodputAccount, stats: JobStats, recovery: RecoveryTracker, waiting_s: float, now: float
) -> Goodput:
    """Goodput = (training time - redone steps' time) / wall time, with the rest of the wall time in named
    buckets that sum to it: the recovery phases of every finished recovery and of the one in progress,
    the redone steps, the waiting for nodes (``waiting_s``: rounds formed short of the minimum node
    count, :meth:`master.job.rendezvous.Rendezvous.waiting_time`; taken out of the rendezvous, where it
    happens) and other."""
    until = goodput.ended_at if goodput.ended_at is not None else now
    wall = max(0.0, until - goodput.started_at)
    training = goodput.training_time(until)
    phases = dict.fromkeys(PHASES, 0.0)
    for (phase, cause), hist in stats.recovery.items():
        if phase in phases and not _trained_through(phase, cause):
            phases[phase] += hist.total
    current = recovery.recovery
    if current is not None:
        for phase, seconds in current.seconds.items():
            if not _trained_through(phase, current.cause):
                phases[phase] = phases.get(phase, 0.0) + seconds
        if goodput.ended_at is None and not _trained_through(current.phase, current.cause):
            phases[current.phase] = phases.get(current.phase, 0.0) + max(0.0, until - current.since)
    out = dict.fromkeys(BADPUT_BUCKETS, 0.0)
    for phase, bucket in _PHASE_BUCKET.items():
        out[bucket] = phases.get(phase, 0.0)
    out["waiting_for_nodes"] = min(waiting_s, out["rendezvous"])
    out["rendezvous"] -= out["waiting_for_nodes"]
    redone = min(stats.redone_s, training)
    out["redone_steps"] = redone
    named = sum(v for k, v in out.items() if k not in ("other", "redone_steps"))
    out["other"] = max(0.0, wall - training - named)
    return Goodput(wall, training - redone, out)
