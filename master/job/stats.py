"""Job-lifetime totals derived from the job's events (restarts, verdicts, steps lost, recovery phases...).

Durable through the job's snapshot, so that a failover does not reset them: the metrics exported from
them (:mod:`master.http.metrics`) never go backwards for a job. Pure: fed one :class:`Event` at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from master.job.events import HANG, WORKER_FAILURE, Event
from master.job.recovery_phases import PHASES

#: Upper bounds (seconds) of the recovery histogram's buckets; +Inf is implied.
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: Event kinds that are verdicts about a node, with the verdict's kind (a worker failure splits by cause).
_VERDICTS = {
    "node_dead": "dead",
    "node_left": "left",
    "node_suspect": "suspect",
    "node_excluded": "excluded",
    "node_flapping_excluded": "excluded",
    "straggler": "straggler",
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
    verdicts: dict[str, int] = field(default_factory=dict)
    persist_failures: int = 0
    leader_changes: int = 0
    checkpoints_committed: int = 0  # times the job's committed step moved forward
    checkpoints_persisted: int = 0  # times the newest step some node made durable moved forward
    recovery: dict[tuple[str, str], Histogram] = field(default_factory=dict)  # (phase, cause) ->

    def apply(self, event: Event) -> None:
        """Count what ``event`` says happened."""
        kind = event.kind
        if kind == "round_opened" and event.cause:
            self.restarts += 1
            self.steps_lost += int(event.data.get("steps_lost", 0))
        elif kind == "worker_failed":
            self._verdict(HANG if event.cause == HANG else WORKER_FAILURE)
        elif kind in _VERDICTS:
            self._verdict(_VERDICTS[kind])
        elif kind == "persist_failed":
            self.persist_failures += 1
        elif kind == "master_takeover":
            self.leader_changes += 1
        elif kind == "first_step" and event.cause:
            for phase in PHASES:
                if phase in event.durations:
                    key = (phase, event.cause)
                    self.recovery.setdefault(key, Histogram()).observe(float(event.durations[phase]))

    def _verdict(self, kind: str) -> None:
        self.verdicts[kind] = self.verdicts.get(kind, 0) + 1

    def snapshot(self) -> dict:
        return {
            "restarts": self.restarts,
            "steps_lost": self.steps_lost,
            "verdicts": dict(self.verdicts),
            "persist_failures": self.persist_failures,
            "leader_changes": self.leader_changes,
            "checkpoints_committed": self.checkpoints_committed,
            "checkpoints_persisted": self.checkpoints_persisted,
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
            verdicts={str(k): int(v) for k, v in (data.get("verdicts") or {}).items()},
            persist_failures=int(data.get("persist_failures", 0)),
            leader_changes=int(data.get("leader_changes", 0)),
            checkpoints_committed=int(data.get("checkpoints_committed", 0)),
            checkpoints_persisted=int(data.get("checkpoints_persisted", 0)),
        )
        for h in data.get("recovery") or []:
            if len(h["buckets"]) == len(RECOVERY_BUCKETS):  # buckets of another layout are dropped
                stats.recovery[(h["phase"], h["cause"])] = Histogram(list(h["buckets"]), h["count"], h["sum"])
        return stats
