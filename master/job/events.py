"""The job's structured events and the effects of a mutation: what the job tells the server.

An :class:`Event` is one record per state change, the one source that the master's log lines,
``elastic-master status``, the Prometheus metrics and the ``--event-log`` file derive from. Its ``kind`` is an
:class:`EventKind` and a recovery's ``cause`` a :class:`Cause`; both are ``str`` enums whose values are the
wire and log text, unchanged.

An event's ``at`` is in the job's clock, which the server anchors to Unix time (``master.service.service``),
so that event times read as wall-clock times in the event log and agree with Prometheus' sample times.
``seq`` numbers every event of the job from 1, across failovers (the count is durable), so that a reader
can check a log for gaps and a new leader can continue a log without duplicates.

:class:`Effects` is what the mutations between two drains did, for the server to carry out: log and publish
their events, persist durable state before any reply reveals it, wake the long-polls whose answer may have
changed. The job records them as it mutates (:class:`EffectsBuffer`); the server drains them after each
request and tick (:meth:`master.job.job.Job.take_effects`) instead of diffing counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

_E = TypeVar("_E", bound="_Text")


class _Text(str, Enum):
    """A ``str`` enum that is its wire text everywhere: in f-strings, in ``%s`` log lines, as a JSON value
    and as a dict key (it hashes like its text, so tables keyed by members answer lookups by plain text)."""

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)

    @classmethod
    def parse(cls: type[_E], text: str) -> _E | str:
        """The member named by ``text``; the text itself when no member is (a newer master's record)."""
        try:
            return cls(text)
        except ValueError:
            return text


class EventKind(_Text):
    """What changed. The values are those of the event log, ``/v1/status`` and the stored snapshot."""

    JOB_STARTED = "job_started"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    NODE_JOINED = "node_joined"
    NODE_REPLACED = "node_replaced"  # a new agent took over a node id whose previous agent was gone
    NODE_SUSPECT = "node_suspect"  # its connection closed: dead soon unless it heartbeats
    NODE_DEAD = "node_dead"
    NODE_LEFT = "node_left"
    NODE_SUCCEEDED = "node_succeeded"
    NODE_READMITTED = "node_readmitted"
    NODE_FLAPPING_EXCLUDED = "node_flapping_excluded"
    NODE_CHECK = "node_check"  # a node-check verdict that excludes nobody
    NODE_EXCLUDED = "node_excluded"  # by the node check
    ROUND_OPENED = "round_opened"
    ROUND_CLOSED = "round_closed"
    WORKER_FAILED = "worker_failed"
    CRASH_LOOP = "crash_loop"  # a failure judged deterministic (master.job.crash_loop): the job stops, exit 3
    FAILURE_NOT_COUNTED = "failure_not_counted"  # the restart it charged is refunded (a node loss)
    WORKERS_STARTED = "workers_started"
    FIRST_STEP = "first_step"
    PERSIST_FAILED = "persist_failed"
    PERSIST_RECOVERED = "persist_recovered"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # a node found a checkpoint copy failing its digest
    INTEGRITY_DETECTED = "integrity_detected"  # the guard found a NaN, a spike or a replica mismatch
    INTEGRITY_ROLLED_BACK = (
        "integrity_rolled_back"  # ...and the job rolled back in process to a verified step
    )
    NODE_SUSPECT_EXCLUDED = "node_suspect_excluded"  # named the odd replica too often: suspect hardware
    STRAGGLER = "straggler"
    STRAGGLER_CLEARED = "straggler_cleared"
    STRAGGLER_EVICTED = "straggler_evicted"  # --straggler-policy evict|replace removed it
    STRAGGLER_POLICY = "straggler_policy"  # the policy cannot act (no compute times), or keeps a straggler
    MASTER_TAKEOVER = "master_takeover"
    MASTER_STALLED = "master_stalled"
    MASTER_SUSPECTED = "master_suspected"  # it heard nothing from most nodes at once: holds, resigns
    MASTER_OVERLOADED = "master_overloaded"  # it sheds heartbeats (master.service.overload)
    MASTER_OVERLOAD_ENDED = "master_overload_ended"
    TOKEN_ROTATED = "token_rotated"  # --token-file changed: the previous token works one heartbeat timeout
    TOKEN_FILE_UNUSABLE = "token_file_unusable"  # --token-file unreadable, empty or short: the token stays


class Cause(_Text):
    """Causes of a recovery (the ``cause`` of the verdict that stopped a running world)."""

    WORKER_FAILURE = "worker_failure"
    HANG = "hang"
    NODE_LOSS = "node_loss"
    SCALE_UP = "scale_up"


#: Every cause, in the order metrics list them.
CAUSES = tuple(Cause)


@dataclass(frozen=True)
class Event:
    """One state change of the job.

    ``durations`` holds seconds (e.g. a recovery's phases, or ``detect`` of a failure verdict);
    ``data`` holds other figures of the kind (``steps_lost``, ``world_size``, ``training_at``...).
    ``kind`` and ``cause`` are members of :class:`EventKind` and :class:`Cause`, or the text of one that a
    newer master recorded (kept as it came)."""

    at: float
    kind: EventKind | str
    message: str
    seq: int = 0
    round: int | None = None
    node: str | None = None
    cause: Cause | str | None = None
    durations: Mapping[str, float] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The event as one JSON-able record (an event-log line, a snapshot entry)."""
        return {
            "seq": self.seq,
            "time": round(self.at, 6),
            "kind": str(self.kind),
            "round": self.round,
            "node": self.node,
            "cause": None if self.cause is None else str(self.cause),
            "durations": {k: round(v, 6) for k, v in self.durations.items()},
            "data": dict(self.data),
            "message": self.message,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any], seq: int, default_at: float) -> Event:
        """An event from :meth:`record`, or from an older snapshot's ``{kind, message}`` (which has no
        time or sequence number: ``seq`` and ``default_at`` fill them in)."""
        cause = record.get("cause")
        return cls(
            at=float(record.get("time", default_at)),
            kind=EventKind.parse(str(record["kind"])),
            message=str(record.get("message", "")),
            seq=int(record.get("seq", seq)),
            round=record.get("round"),
            node=record.get("node"),
            cause=None if cause is None else Cause.parse(str(cause)),
            durations=dict(record.get("durations") or {}),
            data=dict(record.get("data") or {}),
        )


def restore_events(stored: list[Mapping[str, Any]], event_count: int, now: float) -> list[Event]:
    """Stored records (the newest of ``event_count`` events) as events; records of an older snapshot
    get the sequence numbers their position implies and ``now`` as their time."""
    first = event_count - len(stored) + 1
    return [Event.from_record(r, first + i, now) for i, r in enumerate(stored)]


@dataclass(frozen=True)
class Effects:
    """The effects of the mutations since the previous :meth:`EffectsBuffer.take`."""

    #: Events recorded, oldest first (each is also durable: it is part of the stored state).
    events: tuple[Event, ...] = ()
    #: Durable state changed: the store must hold ``version`` before a reply that reveals it.
    persist: bool = False
    #: The answer of a pending ``/v1/round`` or ``/v1/watch`` long-poll may have changed.
    wake: bool = False
    #: With ``wake``: only the long-polls of these nodes may answer differently (a node removed, excluded
    #: or re-admitted), so only they are woken; None: every pending long-poll (a round opened or closed,
    #: the job finished). A job of N nodes must not wake N long-polls for one node's change.
    wake_only: frozenset[str] | None = None
    #: The job's durable version after these mutations.
    version: int = 0


@dataclass
class EffectsBuffer:
    """Accumulates effects between two drains (the job's private record)."""

    events: list[Event] = field(default_factory=list)
    wake: bool = False  # every pending long-poll
    wake_nodes: set[str] = field(default_factory=set)  # the long-polls of these nodes
    taken_version: int = 0
    _quiet: Effects = field(default_factory=Effects)  # "nothing happened" at taken_version, reused

    def take(self, version: int) -> Effects:
        """Drain: the effects since the last take, given the job's current durable ``version``."""
        if version == self.taken_version and not (self.events or self.wake or self.wake_nodes):
            return self._quiet  # a steady heartbeat's (most calls): no new object
        only = None if self.wake or not self.wake_nodes else frozenset(self.wake_nodes)
        wake = self.wake or bool(self.wake_nodes)
        effects = Effects(tuple(self.events), version != self.taken_version, wake, only, version)
        self.events.clear()
        self.wake = False
        self.wake_nodes.clear()
        self.taken_version = version
        self._quiet = Effects(version=version)
        return effects
