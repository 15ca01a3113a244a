"""A rendezvous round's value types: a node waiting to join (:class:`Candidate`), a member's place
(:class:`Slot`) and a closed round (:class:`ClosedRound`), which indexes its members by node id once so
that the questions every heartbeat asks (is this node a member, which slot is its) cost O(1), not
O(members). :mod:`master.job.rendezvous` makes them; the job reads them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """A node that joined and waits for a round."""

    node_id: str
    host: str
    nproc: int
    store_port: int
    joined_at: float


@dataclass(frozen=True)
class Slot:
    """A member's place in a closed round."""

    node_id: str
    node_rank: int
    rank_offset: int
    nproc: int


@dataclass(frozen=True)
class ClosedRound:
    """A round as it closed: its number, its members' slots in rank order, where rank 0's store is."""

    number: int
    slots: tuple[Slot, ...]
    world_size: int
    master_addr: str
    master_port: int
    closed_at: float
    # Indexes built once: every heartbeat asks whether its node is a member (O(1), not O(members)).
    _by_id: dict[str, Slot] = field(init=False, repr=False, compare=False)
    _members: list[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {s.node_id: s for s in self.slots})
        object.__setattr__(self, "_members", [s.node_id for s in self.slots])

    @property
    def members(self) -> list[str]:
        """The members' ids in rank order (one shared list: read it, never modify it)."""
        return self._members

    def slot(self, node_id: str) -> Slot | None:
        """The member's slot; None for a node that is no member."""
        return self._by_id.get(node_id)

    def has(self, node_id: str) -> bool:
        """Whether ``node_id`` is a member."""
        return node_id in self._by_id
