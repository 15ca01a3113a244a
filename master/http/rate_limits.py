"""Two pure rate limiters of the master's front door, driven by an injected clock (tests shift time):

- :class:`PeerFailureLimiter`: after ``limit`` requests with a wrong token from one address within
  ``window_s``, that address is refused at once (the gatekeeper answers 429) until the window has passed.
  Requests with a valid token are never counted nor limited (the caller checks the token first).
- :class:`LogLimiter`: at most one log line per ``interval_s`` for a recurring condition (the process out of
  file descriptors), the admitted line saying how many were suppressed since the last one."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

#: Wrong-token requests one address may send within :data:`FAILURE_WINDOW_S` before it is refused (429).
FAILURE_LIMIT = 20
FAILURE_WINDOW_S = 10.0
#: Addresses tracked at once; beyond it the least recently failing is forgotten (memory stays bounded).
MAX_PEERS = 10_000
#: Seconds between two log lines about the same resource exhaustion.
LOG_INTERVAL_S = 30.0


class PeerFailureLimiter:
    """Counts wrong-token requests per peer address in a sliding window of ``window_s`` seconds."""

    def __init__(
        self,
        limit: int = FAILURE_LIMIT,
        window_s: float = FAILURE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = MAX_PEERS,
    ) -> None:
        self.limit, self.window_s, self.clock, self.max_peers = limit, window_s, clock, max_peers
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def blocked(self, peer: str) -> bool:
        """Whether ``peer`` sent ``limit`` wrong-token requests within the last ``window_s`` seconds."""
        times = self._failures.get(peer)
        if times is None:
            return False
        self._expire(times, self.clock())
        if not times:
            del self._failures[peer]
            return False
        return len(times) >= self.limit

    def record_failure(self, peer: str) -> None:
        """Count one wrong-token request from ``peer`` now."""
        now = self.clock()
        times = self._failures.pop(peer, None)
        if times is None:
            times = deque(maxlen=self.limit)  # the last ``limit`` failures are all the verdict needs
        self._expire(times, now)
        times.append(now)
        self._failures[peer] = times  # most recently failing last
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)

    def _expire(self, times: deque[float], now: float) -> None:
        while times and now - times[0] >= self.window_s:
            times.popleft()


class LogLimiter:
    """Admits one occurrence per ``interval_s``; :meth:`admit` says how many it suppressed meanwhile."""

    def __init__(
        self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last: float | None = None
        self._suppressed = 0

    def admit(self) -> int | None:
        """None when this occurrence is to be suppressed; else the number suppressed since the last one
        admitted (the caller logs it with that count)."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return None
        suppressed, self._suppressed, self._last = self._suppressed, 0, now
        return suppressed
