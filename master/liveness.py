"""Node liveness as a pure state machine: last heartbeat per node, dead verdicts at ``now``."""

from __future__ import annotations


class Liveness:
    """Tracks when each node was last heard from.

    A node is dead when nothing was heard from it for ``timeout_s``. :meth:`grant_grace` pushes every
    deadline out, which a master that just took over uses so that nodes are not declared dead for
    heartbeats they sent while no master was listening.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}
        self._grace_until = float("-inf")

    def beat(self, node_id: str, now: float) -> None:
        self._last_seen[node_id] = now

    def forget(self, node_id: str) -> None:
        self._last_seen.pop(node_id, None)

    def knows(self, node_id: str) -> bool:
        return node_id in self._last_seen

    def age(self, node_id: str, now: float) -> float | None:
        seen = self._last_seen.get(node_id)
        return None if seen is None else max(0.0, now - seen)

    def grant_grace(self, now: float) -> None:
        """No dead verdict before ``now + timeout``, and every node counts as just seen."""
        self._grace_until = now + self.timeout_s
        for node_id in self._last_seen:
            self._last_seen[node_id] = now

    def dead(self, now: float) -> list[str]:
        """Nodes whose last heartbeat is older than the timeout, oldest first."""
        if now < self._grace_until:
            return []
        overdue = [(seen, n) for n, seen in self._last_seen.items() if now - seen > self.timeout_s]
        return [n for _, n in sorted(overdue)]
