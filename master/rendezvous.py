"""Rendezvous rounds as a pure state machine: no I/O, time comes in as ``now``.

Lifecycle of the machine::

    OPEN(r) --close--> ACTIVE(r) --open_round--> OPEN(r+1) ...

* ``OPEN``: nodes join. The round closes when ``max_nodes`` have joined; or when at least ``min_nodes``
  have joined and every node *expected back* (the previous round's members that are still alive) has
  joined, so a restart after a crash closes at once; or, for nodes that are new, when the last-call
  window has passed since ``min_nodes`` was reached and no expected member is still pending (pending
  members are waited for up to ``rejoin_timeout_s``). The admitted count is rounded down to a multiple
  of ``node_unit``; the others stay on the wait list.
* ``ACTIVE``: the admitted members train. Ranks are stable: the previous members keep their order,
  new nodes are appended in join order.
* Growth: while ``ACTIVE``, waiting nodes that would enlarge the world (respecting ``max_nodes`` and
  ``node_unit``) make :meth:`growth_due` true once the last-call window has passed since growth first
  became possible (or at once when the world would reach ``max_nodes``); the job then opens a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elastic.job_settings import JobSettings


class Phase(str, Enum):
    OPEN = "open"
    ACTIVE = "active"


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
    number: int
    slots: tuple[Slot, ...]
    world_size: int
    master_addr: str
    master_port: int
    closed_at: float

    @property
    def members(self) -> list[str]:
        return [slot.node_id for slot in self.slots]

    def slot(self, node_id: str) -> Slot | None:
        return next((s for s in self.slots if s.node_id == node_id), None)


class Rendezvous:
    """Rounds, membership and rank assignment of one job."""

    def __init__(self, settings: JobSettings) -> None:
        self.settings = settings
        self.phase = Phase.OPEN
        self.round = 1  # the round being formed (OPEN) or running (ACTIVE)
        self.opened_at: float | None = None
        self.current: ClosedRound | None = None  # last closed round
        self._joined: dict[str, Candidate] = {}  # insertion order = join order
        self._expected: set[str] = set()
        self._min_reached_at: float | None = None
        self._growth_since: float | None = None

    # -- queries ----------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[str]:
        """Nodes that joined and are not (yet) members of the running round."""
        return list(self._joined)

    def is_member(self, node_id: str) -> bool:
        return self.phase is Phase.ACTIVE and self.current is not None and node_id in self.current.members

    def has_joined(self, node_id: str) -> bool:
        return node_id in self._joined

    # -- transitions ------------------------------------------------------------------------------
    def join(self, candidate: Candidate, now: float) -> None:
        """Add (or refresh) a node on the join list of the open round or the wait list."""
        self._joined[candidate.node_id] = candidate
        if self.opened_at is None:
            self.opened_at = now
        self._track_min(now)
        self._track_growth(now)

    def remove(self, node_id: str, now: float) -> None:
        """Forget a node that died or left (its slot in a running round stays until the next round)."""
        self._joined.pop(node_id, None)
        self._expected.discard(node_id)
        self._track_min(now)
        self._track_growth(now)

    def open_round(self, now: float, expected: set[str]) -> int:
        """Start forming the next round; ``expected`` are the members that should come back."""
        if self.phase is Phase.ACTIVE:
            self.round += 1
        self.phase = Phase.OPEN
        self.opened_at = now
        self._expected = set(expected)
        self._min_reached_at = None
        self._growth_since = None
        self._track_min(now)
        return self.round

    def try_close(self, now: float) -> ClosedRound | None:
        """Close the open round if its conditions hold; returns the closed round or None."""
        if self.phase is not Phase.OPEN:
            return None
        s = self.settings
        joined = len(self._joined)
        admitted = self._admissible(joined)
        if admitted < s.min_nodes or admitted == 0:
            return None
        full = joined >= s.max_nodes
        all_back = bool(self._expected) and self._expected <= self._joined.keys()
        # Live members that are still stopping their workers are waited for (a restart must not shrink
        # the world), but only up to the rejoin timeout: a member that never comes back is left out.
        members_pending = bool(self._expected - self._joined.keys()) and (
            self.opened_at is None or now < self.opened_at + s.rejoin_timeout_s
        )
        last_call_over = (
            self._min_reached_at is not None
            and now >= self._min_reached_at + s.last_call_s
            and not members_pending
        )
        if not (full or all_back or last_call_over):
            return None
        return self._close(admitted, now)

    def growth_due(self, now: float) -> bool:
        """True when waiting nodes should be admitted into a new, larger round now."""
        if self.phase is not Phase.ACTIVE or self.current is None or self._growth_since is None:
            return False
        members = len(self.current.slots)
        target = self._admissible(members + len(self._joined))
        return target >= self.settings.max_nodes or now >= self._growth_since + self.settings.last_call_s

    def join_deadline(self) -> float | None:
        """When the open round times out if it cannot close (None while ACTIVE)."""
        if self.phase is not Phase.OPEN or self.opened_at is None:
            return None
        return self.opened_at + self.settings.join_timeout_s

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Plain-data state, for the durable store."""
        current = self.current
        return {
            "phase": self.phase.value,
            "round": self.round,
            "current": None
            if current is None
            else {
                "number": current.number,
                "world_size": current.world_size,
                "master_addr": current.master_addr,
                "master_port": current.master_port,
                "slots": [vars(s) for s in current.slots],
            },
            "joined": [vars(c) for c in self._joined.values()],
            "expected": sorted(self._expected),
        }

    def restore(self, data: dict, now: float) -> None:
        """Load :meth:`snapshot` output; every deadline restarts from ``now`` (clocks differ per host)."""
        self.phase = Phase(data["phase"])
        self.round = int(data["round"])
        cur = data.get("current")
        self.current = (
            None
            if cur is None
            else ClosedRound(
                cur["number"],
                tuple(Slot(**s) for s in cur["slots"]),
                cur["world_size"],
                cur["master_addr"],
                cur["master_port"],
                now,
            )
        )
        self._joined = {c["node_id"]: Candidate(**{**c, "joined_at": now}) for c in data.get("joined", [])}
        self._expected = set(data.get("expected", []))
        self.opened_at = now if self.phase is Phase.OPEN else None
        self._min_reached_at = None
        self._growth_since = None
        self._track_min(now)
        self._track_growth(now)

    # -- internals --------------------------------------------------------------------------------
    def _admissible(self, count: int) -> int:
        unit = self.settings.node_unit
        return (min(count, self.settings.max_nodes) // unit) * unit

    def _track_min(self, now: float) -> None:
        if self.phase is not Phase.OPEN:
            return
        if self._admissible(len(self._joined)) >= self.settings.min_nodes:
            if self._min_reached_at is None:
                self._min_reached_at = now
        else:
            self._min_reached_at = None

    def _track_growth(self, now: float) -> None:
        if self.phase is not Phase.ACTIVE or self.current is None:
            self._growth_since = None
            return
        members = len(self.current.slots)
        if self._admissible(members + len(self._joined)) > members:
            if self._growth_since is None:
                self._growth_since = now
        else:
            self._growth_since = None

    def _close(self, admitted: int, now: float) -> ClosedRound:
        previous = self.current.members if self.current else []
        order = [n for n in previous if n in self._joined]
        order += [n for n in self._joined if n not in order]
        chosen = order[:admitted]
        slots: list[Slot] = []
        offset = 0
        for node_rank, node_id in enumerate(chosen):
            cand = self._joined.pop(node_id)
            slots.append(Slot(node_id, node_rank, offset, cand.nproc))
            offset += cand.nproc
            if node_rank == 0:
                master_addr, master_port = cand.host, cand.store_port
        self.current = ClosedRound(self.round, tuple(slots), offset, master_addr, master_port, now)
        self.phase = Phase.ACTIVE
        self.opened_at = None
        self._expected = set()
        self._min_reached_at = None
        self._growth_since = None
        self._track_growth(now)
        return self.current
