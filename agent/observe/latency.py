"""A thread-safe latency histogram for the agent's metrics (cumulative buckets, as Prometheus exposes
them): filled on the progress channel's thread, read when Prometheus scrapes
(:mod:`agent.observe.metrics`)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

#: Upper bounds (seconds) of the checkpoint-save histogram's buckets; +Inf is implied. An in-memory save
#: takes milliseconds for a small model and seconds for tens of GiB.
SAVE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class HistogramSample:
    """A histogram read at one moment: ``buckets`` pairs each upper bound (the last ``+Inf``) with the
    number of observations at most that large (cumulative)."""

    buckets: tuple[tuple[str, int], ...]
    count: int
    total: float


class LatencyHistogram:
    """Observations of a latency in seconds, counted into fixed buckets."""

    def __init__(self, bounds: tuple[float, ...] = SAVE_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self._total += seconds

    def sample(self) -> HistogramSample:
        with self._lock:
            counts, total = list(self._counts), self._total
        cumulative, running = [], 0
        for bound, count in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return HistogramSample(tuple(cumulative), running, total)
