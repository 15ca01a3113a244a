"""When worker processes were created, as the kernel recorded it, on the agent's monotonic clock.

The recovery phase ``restart`` ends when the last member's workers started (docs/observability.md). The
moment the agent's start call returns comes later than the workers' creation by the start's own
bookkeeping (with warm starts: the zygote's answer with the pid and a pidfd), tens of milliseconds on a
loaded host; the kernel's record (``/proc/PID/stat`` field 22, in clock ticks since boot, 10 ms on Linux)
does not depend on it. Elsewhere than Linux, or once a worker is gone, there is no record: None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

_START_TIME_FIELD = 19  # field 22 of /proc/PID/stat, counted after the ")" that ends the command name


def created_at(pid: int) -> float | None:
    """When process ``pid`` was created, in ``time.monotonic()`` seconds, or None (no record)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat.rsplit(b")", 1)[1].split()[_START_TIME_FIELD])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        # CLOCK_BOOTTIME counts from boot like the record; the age converts it to the monotonic clock.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.monotonic() - max(0.0, age)


def last_created_at(pids: Iterable[int]) -> float | None:
    """When the last of ``pids`` was created (monotonic seconds); None when one has no record."""
    times = [created_at(pid) for pid in pids]
    if not times or None in times:
        return None
    return max(t for t in times if t is not None)
