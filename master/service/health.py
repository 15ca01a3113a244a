"""The master process's own health figures (not the job's): heartbeats received, long-polls open, store
write latency. Counted by the server with one cheap update each; exported by :mod:`master.http.metrics`.
They belong to this process: a restarted or new master starts them from zero (Prometheus' ``rate()``
handles that), unlike the job's totals, which are stored with the job.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Seconds over which :meth:`MasterHealth.heartbeats_per_second` averages.
RATE_WINDOW_S = 10.0


@dataclass
class MasterHealth:
    heartbeats: int = 0
    long_polls_open: int = 0
    store_writes: int = 0
    store_write_seconds: float = 0.0  # sum over all writes
    store_write_last_s: float | None = None
    _marks: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def heartbeat(self, now: float) -> None:
        self.heartbeats += 1
        if not self._marks or now - self._marks[-1][0] >= 1.0:  # one mark a second bounds the work
            self._marks.append((now, self.heartbeats))

    def heartbeats_per_second(self, now: float) -> float:
        """Heartbeats received per second over about the last :data:`RATE_WINDOW_S` seconds."""
        while len(self._marks) > 1 and now - self._marks[1][0] >= RATE_WINDOW_S:
            self._marks.popleft()
        if not self._marks:
            return 0.0
        since, count = self._marks[0]
        span = now - since
        return (self.heartbeats - count) / span if span > 0 else 0.0

    def store_write(self, seconds: float) -> None:
        self.store_writes += 1
        self.store_write_seconds += seconds
        self.store_write_last_s = seconds
