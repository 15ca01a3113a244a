"""The committed step's input, kept per report: the newest checkpoint step that *every* member of the running
round holds is the smallest of the members' reported steps, and exists only once each member reported one.

Heartbeats report steps one node at a time, so :class:`StepFloor` keeps that minimum up to date in O(1)
(amortized) per report instead of the job scanning every member (O(N) per look, which a 10,000-node job
cannot do per heartbeat, nor at each of many removals in one tick). Soft state: nothing here is stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class StepFloor:
    """The smallest step reported by the members of one round, once each of them has reported one."""

    def __init__(self) -> None:
        self._members: frozenset[str] = frozenset()
        self._steps: dict[str, int] = {}  # member -> its reported step
        self._count: Counter[int] = Counter()  # step -> members reporting it (few distinct steps)
        self._lowest: int | None = None  # min(self._count), None when it must be recomputed
        self._lost = False  # a member was removed: its step is never reported again in this round

    def reset(self, members: Iterable[str]) -> None:
        """A round with these members begins (O(members), once per round): no step reported yet."""
        self._members = frozenset(members)
        self._steps.clear()
        self._count.clear()
        self._lowest = None
        self._lost = False

    def report(self, node_id: str, step: int) -> None:
        """``node_id`` holds checkpoint ``step`` (reports of non-members are ignored)."""
        if node_id not in self._members:
            return
        old = self._steps.get(node_id)
        if old == step:
            return
        self._steps[node_id] = step
        if old is not None:
            self._count[old] -= 1
            if not self._count[old]:
                del self._count[old]
                if old == self._lowest:
                    self._lowest = None
        self._count[step] += 1
        if self._lowest is not None and step < self._lowest:
            self._lowest = step

    def lose(self, node_id: str) -> None:
        """A member was removed: until the next round, no step is held by every member."""
        if node_id in self._members:
            self._lost = True

    def floor(self) -> int | None:
        """The newest step every member holds; None until each reported one (or after a member's loss)."""
        if self._lost or not self._members or len(self._steps) < len(self._members):
            return None
        if self._lowest is None:
            self._lowest = min(self._count)  # O(distinct steps): members checkpoint the same steps
        return self._lowest
