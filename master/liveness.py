"""Node liveness as a pure state machine: last heartbeat per node, dead verdicts at ``now``."""

from __future__ import annotations


class Liveness:
    """Tracks when each node was last heard from.

    A node is dead when nothing was heard from it for ``timeout_s``, or, once :meth:`suspect` was called
    for it, when nothing was heard from it by the earlier deadline given there. :meth:`grant_grace` pushes
    every deadline out, which a master that just took over uses so that nodes are not declared dead for
    heartbeats they sent while no master was listening.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}
        self._suspect_until: dict[str, float] = {}
        self._grace_until = float("-inf")

    def beat(self, node_id: str, now: float) -> None:
        self._last_seen[node_id] = now
        self._suspect_until.pop(node_id, None)

    def forget(self, node_id: str) -> None:
        self._last_seen.pop(node_id, None)
        self._suspect_until.pop(node_id, None)

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
        seen = self._last_seen.get(node_id)
        return None if seen is None else max(0.0, now - seen)

    def grant_grace(self, now: float) -> None:
        """No dead verdict before ``now + timeout``, and every node counts as just seen."""
        self._grace_until = now + self.timeout_s
        self._suspect_until.clear()
        for node_id in self._last_seen:
            self._last_seen[node_id] = now

    def dead(self, now: float) -> list[str]:
        """Nodes whose last heartbeat is older than the timeout, or past their suspicion deadline; oldest
        heartbeat first."""
        if now < self._grace_until:
            return []
        overdue = [
            (seen, n)
            for n, seen in self._last_seen.items()
            if now - seen > self.timeout_s or now > self._suspect_until.get(n, now)
        ]
        return [n for _, n in sorted(overdue)]
