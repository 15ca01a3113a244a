"""Rendezvous rounds as a pure state machine: no I/O, time comes in as ``now``.

Lifecycle of the machine::

    OPEN(r) --close--> ACTIVE(r) --open_round--> OPEN(r+1) ...

* ``OPEN``: nodes join. The round closes when ``max_nodes`` have joined; or when at least ``min_nodes``
  have joined and every node *expected back* (the previous round's members that are still alive) has
  joined, so a restart after a crash closes at once; or, for nodes that are new, when the last-call
  window has passed since ``min_nodes`` was reached and no expected member is still pending (pending
  members are waited for up to ``rejoin_timeout_s``). The admitted count is rounded down to a multiple
  of ``node_unit``; the others stay on the wait list.
* ``ACTIVE``: the admitted members train. Ranks are stable: the previous members keep their node ranks, a
  new node takes the node rank of a lost member (a hot spare taking its place, lowest rank first), and the
  places nobody fills are closed up (members keep their relative order); further new nodes are appended in
  join order.
* Spares: while ``ACTIVE``, nodes the running round has no place for (its maximum is reached, or
  ``node_unit`` blocks a larger round) wait as hot spares (:attr:`Rendezvous.spares`). When a member is
  lost the job opens a round expecting the survivors back; it closes as soon as they are (no last call:
  "every member came back"), with the spares filling the lost places up to ``max_nodes``, so the world
  keeps its size and the survivors their ranks.
* Growth: while ``ACTIVE``, waiting nodes that would enlarge the world (respecting ``max_nodes`` and
  ``node_unit``) make :meth:`growth_due` true once the last-call window has passed since growth first
  became possible (or at once when the world would reach ``max_nodes``); the job then opens a round.

Every such choice is made in one place, :meth:`Rendezvous.decide`, which returns the action *and* a sentence
saying why ("waiting for 1 more node until 12:00:03", "last call for node c until 12:00:03", "closed: 2
nodes, world size 8 (every member came back)"), as torchft's lighthouse ``quorum_compute`` does: the
sentence is what ``elastic-master status`` and the status page show, and what the master logs when it
changes. Sentences name deadlines as wall-clock times, never as countdowns, so they change only when the
decision does.

The round's value types live here too: a node waiting to join (:class:`Candidate`), a member's place
(:class:`Slot`) and a closed round (:class:`ClosedRound`), which indexes its members by node id once so that
the questions every heartbeat asks (is this node a member, which slot is its) cost O(1), not O(members).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum

from elastic.control.job_settings import JobSettings

#: Node ids a reason names before it says "and N more" (a 10,000-node job's reason stays one short line).
NAMES_SHOWN = 3


def wall_clock_text(t: float) -> str:
    """``12:00:03``: the local wall-clock time of ``t``, a reading of the master's clock (which reads Unix
    time: :func:`master.service.service.unix_monotonic`)."""
    return time.strftime("%H:%M:%S", time.localtime(t))


def name_list(ids: Iterable[str], limit: int = NAMES_SHOWN) -> str:
    """``a, b, c and 7 more``: at most ``limit`` ids, then how many more there are."""
    ids = list(ids)
    shown = ", ".join(ids[:limit])
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"


def sorted_names(ids: Collection[str], limit: int = NAMES_SHOWN) -> str:
    """:func:`name_list` of ``ids`` in sorted order, in O(len(ids)): the first ``limit`` are picked, not
    all sorted (a round of 10,000 members names 3 of them)."""
    shown = ", ".join(heapq.nsmallest(limit, ids))
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


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


class Phase(str, Enum):
    OPEN = "open"
    ACTIVE = "active"


class Action(str, Enum):
    """What the rendezvous does at a given time (:meth:`Rendezvous.decide`)."""

    WAIT = "wait"  # OPEN: the round cannot close yet
    CLOSE = "close"  # OPEN: the round closes now, with ``Decision.admitted`` nodes
    TRAIN = "train"  # ACTIVE: the running round goes on
    GROW = "grow"  # ACTIVE: waiting nodes are admitted now; the job opens a larger round


@dataclass(frozen=True)
class Decision:
    """A rendezvous decision and the sentence that explains it."""

    action: Action
    reason: str
    #: Nodes the round closes with (CLOSE) or would grow to (GROW); 0 otherwise.
    admitted: int = 0
    #: When the decision changes by itself if nothing else happens (a deadline, in the ``now`` clock).
    until: float | None = None


@dataclass(frozen=True)
class Standing:
    """How the rendezvous stands, for a node waiting for its round (:meth:`Rendezvous.standing`)."""

    joined: int  # nodes that joined and wait for the next round
    expected_back: int  # members of the previous round the forming round waits for, not rejoined yet
    running: int | None  # members of the running round (ACTIVE); None while a round forms
    last_call_ends_at: float | None  # when the last call ends (forming, or growth while ACTIVE)


class Rendezvous:
    """Rounds, membership and rank assignment of one job."""

    def __init__(self, settings: JobSettings, clock_text: Callable[[float], str] = wall_clock_text) -> None:
        self.settings = settings
        #: Renders a deadline (in the ``now`` clock) for reasons; tests with a fake clock pass their own.
        self.clock_text = clock_text
        self._close_why = ""  # why the current round closed, for the ACTIVE phase's reason
        self.phase = Phase.OPEN
        self.round = 1  # the round being formed (OPEN) or running (ACTIVE)
        self.opened_at: float | None = None
        self.current: ClosedRound | None = None  # last closed round
        self._joined: dict[str, Candidate] = {}  # insertion order = join order
        self._expected: set[str] = set()
        self._pending: set[str] = set()  # expected members not joined yet (kept up to date: O(1) per join)
        self._min_reached_at: float | None = None
        self._growth_since: float | None = None
        #: Seconds rounds formed with fewer admissible nodes than the minimum (the ``waiting_for_nodes``
        #: badput, master.job.accounting.goodput_of), and since when the open round does (durable: the sum).
        self.waiting_s = 0.0
        self._short_since: float | None = None

    # -- queries ----------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[str]:
        """Nodes that joined and are not (yet) members of the running round."""
        return list(self._joined)

    def is_member(self, node_id: str) -> bool:
        return self.phase is Phase.ACTIVE and self.current is not None and self.current.has(node_id)

    def has_joined(self, node_id: str) -> bool:
        return node_id in self._joined

    @property
    def spares(self) -> list[str]:
        """Hot spares, in join order: nodes that joined while a round runs that has no place for them (its
        maximum is reached, or a larger round would break ``node_unit``) and no growth is due. They stay
        registered and heartbeat; at the next round each takes the node rank of a lost member
        (:meth:`try_close`). A node waiting for a growth round is no spare. O(spares)."""
        if self.phase is not Phase.ACTIVE or self.current is None or self._growth_since is not None:
            return []
        return list(self._joined)

    @property
    def spares_count(self) -> int:
        """``len(spares)`` in O(1): every member's heartbeat reply asks (its replication targets)."""
        if self.phase is not Phase.ACTIVE or self.current is None or self._growth_since is not None:
            return 0
        return len(self._joined)

    def is_member_or_spare(self, node_id: str) -> bool:
        """Whether ``node_id`` takes part in peer replication (a member sends and receives, a spare
        receives)."""
        return self.is_member(node_id) or self.is_spare(node_id)

    def is_spare(self, node_id: str) -> bool:
        """Whether ``node_id`` is one of :attr:`spares`, in O(1) (every heartbeat of a spare asks)."""
        return (
            self.phase is Phase.ACTIVE
            and self.current is not None
            and self._growth_since is None
            and node_id in self._joined
        )

    def standing(self) -> Standing:
        """Counts and the last call's end, in O(1): every waiting node's round poll reads them."""
        s = self.settings
        if self.phase is Phase.ACTIVE and self.current is not None:
            since = self._growth_since
            end = None if since is None else since + s.last_call_s
            return Standing(len(self._joined), 0, len(self.current.slots), end)
        since = self._min_reached_at
        end = None if since is None else since + s.last_call_s
        return Standing(len(self._joined), len(self._pending), None, end)

    def waiting_time(self, now: float) -> float:
        """:attr:`waiting_s`, with the open round's time short of the minimum so far."""
        since = self._short_since
        return self.waiting_s + (max(0.0, now - since) if since is not None else 0.0)

    # -- transitions ------------------------------------------------------------------------------
    def join(self, candidate: Candidate, now: float) -> None:
        """Add (or refresh) a node on the join list of the open round or the wait list."""
        self._joined[candidate.node_id] = candidate
        self._pending.discard(candidate.node_id)
        if self.opened_at is None:
            self.opened_at = now
        self._track_min(now)
        self._track_growth(now)

    def remove(self, node_id: str, now: float) -> None:
        """Forget a node that died or left (its slot in a running round stays until the next round)."""
        self._joined.pop(node_id, None)
        self._expected.discard(node_id)
        self._pending.discard(node_id)
        self._track_min(now)
        self._track_growth(now)

    def open_round(self, now: float, expected: set[str]) -> int:
        """Start forming the next round; ``expected`` are the members that should come back."""
        if self.phase is Phase.ACTIVE:
            self.round += 1
        self.phase = Phase.OPEN
        self.opened_at = now
        self._expected = set(expected)
        self._pending = self._expected - self._joined.keys()
        self._min_reached_at = None
        self._growth_since = None
        self._track_min(now)
        return self.round

    def try_close(self, now: float) -> ClosedRound | None:
        """Close the open round if its conditions hold (:meth:`decide`); returns the closed round or None."""
        if self.phase is not Phase.OPEN:
            return None
        decision = self._decide_open(now, explain=False)  # a CLOSE's reason is always complete
        if decision.action is not Action.CLOSE:
            return None
        self._close_why = decision.reason.split(": ", 1)[1]  # "closing with 2 nodes: <why>"
        closed, takeovers = self._close(decision.admitted, now)
        if takeovers:
            self._close_why += "; " + takeovers
        return closed

    def growth_due(self, now: float) -> bool:
        """True when waiting nodes should be admitted into a new, larger round now."""
        return self.phase is Phase.ACTIVE and self._decide_active(now, explain=False).action is Action.GROW

    def decide(self, now: float) -> Decision:
        """What the rendezvous does at ``now``, and why; changes nothing (the transitions act on it)."""
        if self.phase is Phase.OPEN:
            return self._decide_open(now)
        return self._decide_active(now)

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
            "waiting_s": round(self.waiting_s, 3),
            # Not "expected": while a round forms it is the previous round's members that are still known
            # (see restore), so storing it would rewrite every member's id at every membership change.
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
        if "expected" in data:  # written by an older release
            self._expected = set(data["expected"])
        else:  # the job narrows it to the nodes it still knows (restrict_expected)
            forming = self.current if self.phase is Phase.OPEN else None
            self._expected = set(forming.members) if forming is not None else set()
        self._pending = self._expected - self._joined.keys()
        self.opened_at = now if self.phase is Phase.OPEN else None
        self._min_reached_at = None
        self._growth_since = None
        self._close_why = ""  # not stored: the ACTIVE reason just omits it after a takeover
        self.waiting_s, self._short_since = float(data.get("waiting_s", 0.0)), None
        self._track_min(now)
        self._track_growth(now)

    def restrict_expected(self, known: Iterable[str]) -> None:
        """Expect only ``known`` nodes back (after a restore: members removed since are not known)."""
        self._expected &= set(known)
        self._pending &= self._expected

    # -- decisions --------------------------------------------------------------------------------
    def _decide_open(self, now: float, explain: bool = True) -> Decision:
        """``explain`` False: the same action, but a WAIT's reason is left empty (the transitions ask at every
        join, and naming the members still expected back costs O(members): O(N^2) for a round of N)."""
        s = self.settings
        joined = len(self._joined)
        admitted = self._admissible(joined)
        pending = self._pending
        if admitted < s.min_nodes or admitted == 0:
            deadline = self.join_deadline()
            if not explain:
                return Decision(Action.WAIT, "", until=deadline)
            target = -(-s.min_nodes // s.node_unit) * s.node_unit  # min_nodes rounded up to the unit
            unit = f" in units of {s.node_unit}" if s.node_unit > 1 else ""
            back = f"; expected back: {sorted_names(pending)}" if pending else ""
            return Decision(
                Action.WAIT,
                f"waiting for {max(target - joined, 1)} more {'node' if target - joined == 1 else 'nodes'} "
                f"({joined} joined, {s.min_nodes} needed{unit}{back})" + self._until(deadline),
                until=deadline,
            )
        if joined >= s.max_nodes:
            return _closing(admitted, f"the maximum of {_nodes(s.max_nodes)} joined")
        if self._expected and not pending:
            return _closing(admitted, "every member came back")
        # Live members that are still stopping their workers are waited for (a restart must not shrink
        # the world), but only up to the rejoin timeout: a member that never comes back is left out.
        rejoin_deadline = None if self.opened_at is None else self.opened_at + s.rejoin_timeout_s
        if pending and (rejoin_deadline is None or now < rejoin_deadline):
            who = f"{'member' if len(pending) == 1 else 'members'} {sorted_names(pending)}" if explain else ""
            why = f"waiting for {who} to rejoin{self._until(rejoin_deadline)}" if explain else ""
            return Decision(Action.WAIT, why, until=rejoin_deadline)
        last_call_end = None if self._min_reached_at is None else self._min_reached_at + s.last_call_s
        closing = last_call_end is not None and now >= last_call_end
        left_out = (
            f"; left out {sorted_names(pending)} (not back in time)"
            if pending and (explain or closing)
            else ""
        )
        if closing:
            return _closing(admitted, f"the last call ended{left_out}")
        why = (
            f"last call: {joined} of at most {s.max_nodes} nodes joined, more may join"
            f"{self._until(last_call_end)}{left_out}"
            if explain
            else ""
        )
        return Decision(Action.WAIT, why, admitted, until=last_call_end)

    def _decide_active(self, now: float, explain: bool = True) -> Decision:
        """``explain`` False: the same action without a reason (naming waiting nodes costs O(waiting))."""
        current = self.current
        if current is None:  # not reached: ACTIVE always has a closed round
            return Decision(Action.TRAIN, "training")
        members = len(current.slots)
        waiting = self._joined
        if self._growth_since is None and not explain:
            return Decision(Action.TRAIN, "")
        why = f" ({self._close_why})" if self._close_why else ""
        head = f"closed: {_nodes(members)}, world size {current.world_size}{why}"
        if self._growth_since is None:
            if not waiting:
                return Decision(Action.TRAIN, head)
            s = self.settings
            blocked = (
                f"the maximum of {_nodes(s.max_nodes)} is reached"
                if members >= s.max_nodes
                else f"a larger round needs a multiple of {s.node_unit} nodes"
            )
            return Decision(
                Action.TRAIN,
                f"{head}; spare {_names_of(list(waiting))} ({blocked}; a spare takes a lost member's "
                "node rank at the next round)",
            )
        target = self._admissible(members + len(waiting))
        names = _names_of(list(waiting)) if explain else ""
        if target >= self.settings.max_nodes:
            return Decision(
                Action.GROW, f"admitting {names}: a round of {_nodes(target)} (the maximum)", target
            )
        last_call_end = self._growth_since + self.settings.last_call_s
        if now >= last_call_end:
            return Decision(Action.GROW, f"admitting {names}: the last call ended", target)
        return Decision(
            Action.TRAIN,
            f"{head}; last call for {names}" + self._until(last_call_end) + f" (then {_nodes(target)})",
            target,
            until=last_call_end,
        )

    def _until(self, deadline: float | None) -> str:
        return "" if deadline is None else f" until {self.clock_text(deadline)}"

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
            self._stop_waiting(now)
        else:
            self._min_reached_at = None
            if self._short_since is None:
                self._short_since = now

    def _stop_waiting(self, now: float) -> None:
        if self._short_since is not None:
            self.waiting_s += max(0.0, now - self._short_since)
            self._short_since = None

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

    def _close(self, admitted: int, now: float) -> tuple[ClosedRound, str]:
        """Close with ``admitted`` nodes: the previous round's members first, then new nodes in join order.
        Returns the round and a clause naming spare takeovers ('' when none).

        Ranks: a member keeps its node rank; a new node (a spare) takes the node rank of a lost member,
        lowest rank first, so that a loss replaced by a spare changes no survivor's rank (survivors under
        ``elastic.run`` keep their processes and ranks; for node rank 0 the spare also hosts the store).
        Places no new node fills are closed up, members keeping their relative order; further new nodes
        are appended."""
        previous = self.current.members if self.current else []
        order = [n for n in previous if n in self._joined]
        kept = set(order)
        order += [n for n in self._joined if n not in kept]
        chosen_set = set(order[:admitted])
        newcomers = [n for n in order[:admitted] if n not in kept]
        # The previous round's layout with a hole (None) for each member not coming back.
        layout: list[str | None] = [n if n in chosen_set else None for n in previous]
        fills, takeovers = iter(newcomers), []
        for rank, node in enumerate(layout):
            if node is None and (spare := next(fills, None)) is not None:
                layout[rank] = spare
                takeovers.append(f"{spare} takes node rank {rank} of {previous[rank]}")
        chosen = [n for n in layout if n is not None] + list(fills)
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
        self._stop_waiting(now)
        self._expected, self._pending = set(), set()
        self._min_reached_at = None
        self._growth_since = None
        self._track_growth(now)
        said = ("spare " if len(takeovers) == 1 else "spares ") + ", ".join(takeovers) if takeovers else ""
        return self.current, said


def _closing(admitted: int, why: str) -> Decision:
    return Decision(Action.CLOSE, f"closing with {_nodes(admitted)}: {why}", admitted)


def _names_of(ids: list[str]) -> str:
    """``node c`` or ``nodes c, d`` (at most :data:`NAMES_SHOWN` ids)."""
    return f"{'node' if len(ids) == 1 else 'nodes'} {name_list(ids)}"
