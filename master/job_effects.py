"""What a mutation of the job did, for the server to carry out: log and publish its events, persist
durable state before any reply reveals it, wake the long-polls whose answer may have changed.

The job records effects as it mutates (:class:`EffectsBuffer`); the server drains them after each request
and tick (:meth:`master.job.Job.take_effects`) instead of diffing counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from master.job_events import Event


@dataclass(frozen=True)
class Effects:
    """The effects of the mutations since the previous :meth:`EffectsBuffer.take`."""

    #: Events recorded, oldest first (each is also durable: it is part of the stored state).
    events: tuple[Event, ...] = ()
    #: Durable state changed: the store must hold ``version`` before a reply that reveals it.
    persist: bool = False
    #: The answer of a pending ``/v1/round`` or ``/v1/watch`` long-poll may have changed.
    wake: bool = False
    #: The job's durable version after these mutations.
    version: int = 0


@dataclass
class EffectsBuffer:
    """Accumulates effects between two drains (the job's private record)."""

    events: list[Event] = field(default_factory=list)
    wake: bool = False
    taken_version: int = 0

    def take(self, version: int) -> Effects:
        """Drain: the effects since the last take, given the job's current durable ``version``."""
        effects = Effects(tuple(self.events), version != self.taken_version, self.wake, version)
        self.events.clear()
        self.wake = False
        self.taken_version = version
        return effects
