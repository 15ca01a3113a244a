"""What a mutation of the job did, for the server to carry out: log and publish its events, persist
durable state before any reply reveals it, wake the long-polls whose answer may have changed.

The job records effects as it mutates (:class:`EffectsBuffer`); the server drains them after each request
and tick (:meth:`master.job.job.Job.take_effects`) instead of diffing counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from master.job.events import Event


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
