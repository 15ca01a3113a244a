"""The job's structured events: one record per state change, the one source that the master's log lines,
``elastic-master status``, the Prometheus metrics and the ``--event-log`` file derive from.

An event's ``at`` is in the job's clock, which the server anchors to Unix time (:mod:`master.service.clock`),
so that event times read as wall-clock times in the event log and agree with Prometheus' sample times.
``seq`` numbers every event of the job from 1, across failovers (the count is durable), so that a reader
can check a log for gaps and a new leader can continue a log without duplicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Causes of a recovery (the ``cause`` of the verdict that stopped a running world).
WORKER_FAILURE, HANG, NODE_LOSS, SCALE_UP = "worker_failure", "hang", "node_loss", "scale_up"
CAUSES = (WORKER_FAILURE, HANG, NODE_LOSS, SCALE_UP)


@dataclass(frozen=True)
class Event:
    """One state change of the job.

    ``durations`` holds seconds (e.g. a recovery's phases, or ``detect`` of a failure verdict);
    ``data`` holds other figures of the kind (``steps_lost``, ``world_size``, ``training_at``...)."""

    at: float
    kind: str
    message: str
    seq: int = 0
    round: int | None = None
    node: str | None = None
    cause: str | None = None
    durations: Mapping[str, float] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The event as one JSON-able record (an event-log line, a snapshot entry)."""
        return {
            "seq": self.seq,
            "time": round(self.at, 6),
            "kind": self.kind,
            "round": self.round,
            "node": self.node,
            "cause": self.cause,
            "durations": {k: round(v, 6) for k, v in self.durations.items()},
            "data": dict(self.data),
            "message": self.message,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any], seq: int, default_at: float) -> Event:
        """An event from :meth:`record`, or from an older snapshot's ``{kind, message}`` (which has no
        time or sequence number: ``seq`` and ``default_at`` fill them in)."""
        return cls(
            at=float(record.get("time", default_at)),
            kind=str(record["kind"]),
            message=str(record.get("message", "")),
            seq=int(record.get("seq", seq)),
            round=record.get("round"),
            node=record.get("node"),
            cause=record.get("cause"),
            durations=dict(record.get("durations") or {}),
            data=dict(record.get("data") or {}),
        )


def restore_events(stored: list[Mapping[str, Any]], event_count: int, now: float) -> list[Event]:
    """Stored records (the newest of ``event_count`` events) as events; records of an older snapshot
    get the sequence numbers their position implies and ``now`` as their time."""
    first = event_count - len(stored) + 1
    return [Event.from_record(r, first + i, now) for i, r in enumerate(stored)]
