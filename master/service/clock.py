"""The master's clock: monotonic, but reading Unix time.

Job state machines take ``now`` from it. It never jumps (a wall-clock step does not expire heartbeats or
stretch a recovery), yet its readings are Unix times, so the job's event times read as dates in the event
log, agree with Prometheus' sample times, and stay comparable after a failover to a master on another
host (to the precision of the hosts' wall clocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def unix_monotonic() -> Callable[[], float]:
    """A clock: ``time.monotonic()`` plus the offset to ``time.time()`` taken once, now."""
    offset = time.time() - time.monotonic()
    return lambda: time.monotonic() + offset
