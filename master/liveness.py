"""Node liveness as a pure state machine: last heartbeat per node, dead verdicts at ``now``."""

from __future__ import annotations

from collections import OrderedDict


class Liveness:
    """Tracks when each node was last heard from.

    A node is dead when nothing was heard from it for ``timeout_s``, or, once :meth:`suspect` was called
    for it, when nothing was heard from it by the earlier deadline given there. :meth:`grant_grace` pushes
    every deadline out, which a master that just took over uses so that nodes are not declared dead for
    heartbeats they sent while no master was listening.

    The tick asks for verdicts ten times a second, so :meth:`dead` costs O(overdue + suspects), not
    O(nodes): last heartbeats are kept in the order they came, which is the order of their times (the
    master's clock is monotonic), so the overdue nodes are a prefix. A clock that reads earlier than a
    previous beat (fake clocks in tests) makes the next :meth:`dead` scan every node and sort them once.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: OrderedDict[str, float] = OrderedDict()  # oldest heartbeat first (see above)
        self._in_order = True  # whether _last_seen's order is that of its times
        self._suspect_until: dict[str, float] = {}
        self._grace_until = float("-inf")
        #: Seconds a node's last heartbeat was moved later by :meth:`excuse` (its true age stays known).
        self._excused: dict[str, float] = {}

    def beat(self, node_id: str, now: float) -> None:
        seen = self._last_seen
        if seen and self._in_order and now < next(reversed(seen.values())):
            self._in_order = False
        seen[node_id] = now
        seen.move_to_end(node_id)
        if self._suspect_until:
            self._suspect_until.pop(node_id, None)
        if self._excused:
            self._excused.pop(node_id, None)

    def forget(self, node_id: str) -> None:
        self._last_seen.pop(node_id, None)
        self._suspect_until.pop(node_id, None)
        self._excused.pop(node_id, None)

    def suspect(self, node_id: str, now: float, within_s: float) -> None:
        """Dead at ``now + within_s`` (if that is earlier than its timeout) unless it beats before."""
        if node_id in self._last_seen:
            deadline = min(now + within_s, self._last_seen[node_id] + self.timeout_s)
            self._suspect_until[node_id] = min(deadline, self._suspect_until.get(node_id, deadline))

    def suspected(self, node_id: str) -> bool:
        return node_id in self._suspect_until

    def knows(self, node_id: str) -> bool:
        return node_id in self._last_seen

    def alive(self, node_id: str, now: float) -> bool:
        """Heard from within the timeout (any time during a takeover's grace), and its connection not seen
        to close since: an agent that another one may not replace."""
        seen = self._last_seen.get(node_id)
        if seen is None or node_id in self._suspect_until:
            return False
        return now < self._grace_until or now - seen <= self.timeout_s

    def age(self, node_id: str, now: float) -> float | None:
        """Time since the node's last heartbeat (its true age, whatever :meth:`excuse` moved)."""
        seen = self._last_seen.get(node_id)
        return None if seen is None else max(0.0, now - seen + self._excused.get(node_id, 0.0))

    def grant_grace(self, now: float) -> None:
        """No dead verdict before ``now + timeout``, and every node counts as just seen."""
        self._grace_until = now + self.timeout_s
        self._suspect_until.clear()
        self._excused.clear()
        for node_id in self._last_seen:
            self._last_seen[node_id] = now
        self._in_order = True  # all equal

    def excuse(self, seconds: float) -> None:
        """The master itself was stalled for ``seconds`` (heartbeats waited unread in its sockets): every
        node's last heartbeat and suspicion deadline move that much later (order unchanged). O(nodes), for
        a rare event."""
        excused = self._excused
        for node_id, seen in self._last_seen.items():
            self._last_seen[node_id] = seen + seconds
            excused[node_id] = excused.get(node_id, 0.0) + seconds
        for node_id, until in self._suspect_until.items():
            self._suspect_until[node_id] = until + seconds

    def dead(self, now: float) -> list[str]:
        """Nodes whose last heartbeat is older than the timeout, or past their suspicion deadline; oldest
        heartbeat first."""
        if now < self._grace_until:
            return []
        if not self._in_order:
            self._last_seen = OrderedDict(sorted(self._last_seen.items(), key=lambda item: item[1]))
            self._in_order = True
        overdue = []
        for n, seen in self._last_seen.items():  # oldest first: stop at the first one in time
            if now - seen <= self.timeout_s:
                break
            overdue.append((seen, n))
        for n, until in self._suspect_until.items():
            seen = self._last_seen[n]
            if now > until and now - seen <= self.timeout_s:  # (else listed above already)
                overdue.append((seen, n))
        overdue.sort()  # few (the overdue ones), ties by node id
        return [n for _, n in overdue]
