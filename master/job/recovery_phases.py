"""Recovery phases: where the time between a broken world and its next training step went. Pure.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
            restarting = bool(data) and data["phase"] == "restart"
            closed_at = float(data["since"]) if restarting else 0.0
            self.round = RoundStart(round_number, frozenset(members), closed_at=closed_at)
