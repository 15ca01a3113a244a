"""Pure detection rules of the integrity guard: no torch, no I/O, unit-tested on recorded series.

- :func:`non_finite`: a loss or gradient value that is NaN or infinite.
- :class:`SpikeRule`: a loss reading far above the recent window, judged by its median and median
  absolute deviation (MAD), which a few outliers do not move (a mean and standard deviation would be
  dragged up by the very spikes they should catch).
- :func:`odd_ones_out`: which replicas to name when their digests disagree.
- :class:`Coverage`: with a rotating subset, the newest step whose whole state was checked after it.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

#: A loss is a spike when it exceeds the window's median by more than this many scaled MADs...
DEFAULT_SPIKE_MADS = 10.0
#: ...and by more than this fraction of the median (so a window of nearly equal losses, whose MAD is tiny,
#: does not call ordinary noise a spike).
DEFAULT_SPIKE_RATIO = 0.5
#: Losses the rule looks back on.
DEFAULT_WINDOW = 100
#: Readings the window must hold before the rule judges (the first steps of training fall fast).
DEFAULT_WARMUP = 20
#: MAD * 1.4826 estimates the standard deviation of normally distributed readings.
_MAD_TO_SIGMA = 1.4826


def non_finite(*values: float) -> bool:
    """True when any of ``values`` is NaN or infinite."""
    return not all(math.isfinite(v) for v in values)


def median(sorted_values: Sequence[float]) -> float:
    """The median of an already sorted, non-empty sequence."""
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


@dataclass(frozen=True)
class SpikeVerdict:
    """What :meth:`SpikeRule.judge` found for one loss: ``spike``, and the numbers it was judged by."""

    spike: bool
    median: float
    limit: float  # the loss above which a reading is a spike (inf while warming up)


class SpikeRule:
    """Upward loss spikes against the last ``window`` accepted losses (median/MAD, module doc).

    A loss ``x`` is a spike when the window holds at least ``warmup`` readings and
    ``x > median + max(mads * 1.4826 * MAD, ratio * |median|)``. Only accepted readings (not spikes,
    finite) enter the window, so a spike does not raise the bar for the next one. Downward moves are never
    spikes (a loss that falls is training). :meth:`truncate` forgets readings past a rollback's step.
    """

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        warmup: int = DEFAULT_WARMUP,
        mads: float = DEFAULT_SPIKE_MADS,
        ratio: float = DEFAULT_SPIKE_RATIO,
    ) -> None:
        if window < 3 or not 3 <= warmup <= window or mads <= 0 or ratio < 0:
            raise ValueError("spike rule: window >= 3, 3 <= warmup <= window, mads > 0 and ratio >= 0")
        self.window, self.warmup, self.mads, self.ratio = window, warmup, mads, ratio
        self._recent: deque[tuple[int, float]] = deque()  # (step, loss), oldest first
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def judge(self, loss: float) -> SpikeVerdict:
        """Judge ``loss`` against the window without changing it."""
        if len(self._sorted) < self.warmup or not math.isfinite(loss):
            return SpikeVerdict(False, math.nan, math.inf)
        mid = median(self._sorted)
        mad = median(sorted(abs(v - mid) for v in self._sorted))
        limit = mid + max(self.mads * _MAD_TO_SIGMA * mad, self.ratio * abs(mid))
        return SpikeVerdict(loss > limit, mid, limit)

    def accept(self, step: int, loss: float) -> None:
        """Add a judged, accepted reading of ``step`` to the window."""
        self._recent.append((step, loss))
        insort(self._sorted, loss)
        if len(self._recent) > self.window:
            _, old = self._recent.popleft()
            del self._sorted[self._index(old)]

    def truncate(self, step: int) -> None:
        """Forget the readings of steps after ``step`` (they were rolled back)."""
        while self._recent and self._recent[-1][0] > step:
            _, value = self._recent.pop()
            del self._sorted[self._index(value)]

    def _index(self, value: float) -> int:
        from bisect import bisect_left

        return bisect_left(self._sorted, value)


def odd_ones_out(digests: Sequence[bytes]) -> tuple[int, ...]:
    """The ranks to name when the replicas' ``digests`` (one per rank) disagree; () when they agree.

    With three or more replicas and one digest held by a strict majority, the ranks outside it are named
    (the odd one out). Without a majority (two replicas, or a split) nobody can tell which copy is right,
    so every rank outside the largest group is named together with that group when it is not a majority:
    with two replicas the pair is named."""
    if len(set(digests)) <= 1:
        return ()
    counts: dict[bytes, int] = {}
    for value in digests:
        counts[value] = counts.get(value, 0) + 1
    common, held = max(counts.items(), key=lambda item: (item[1], item[0]))
    if held * 2 > len(digests):
        return tuple(rank for rank, value in enumerate(digests) if value != common)
    return tuple(range(len(digests)))


class Coverage:
    """With the state cut into ``parts`` checked in turn (part ``i`` at steps ``s`` where ``s % parts ==
    i``), the newest step all of whose parts were checked, and agreed, at that step or after.

    :meth:`checked` records an agreeing check of one part; :attr:`covered_since` is then the oldest of the
    parts' newest checks: every step up to it is digest-verified (a corruption older than it would have
    shown in one of those checks). With one part it is the last checked step."""

    def __init__(self, parts: int) -> None:
        if parts < 1:
            raise ValueError("parts must be >= 1")
        self.parts = parts
        self._last: list[int | None] = [None] * parts

    def part_of(self, step: int) -> int:
        """The part checked at ``step``."""
        return step % self.parts

    def checked(self, step: int) -> None:
        """The part of ``step`` agreed at ``step``."""
        self._last[self.part_of(step)] = step

    @property
    def covered_since(self) -> int | None:
        """Every step up to this one is digest-verified; None until each part was checked once."""
        if any(last is None for last in self._last):
            return None
        return min(last for last in self._last if last is not None)

    def truncate(self, step: int) -> None:
        """Forget checks of steps after ``step`` (rolled back)."""
        self._last = [last if last is not None and last <= step else None for last in self._last]
