"""``StandbyHold``: a standby holds a joined node's heartbeat, watch or round call briefly before its 503.

An agent calls a standby only when its master failed it. Refused at once, it waits 50-100 % of a heartbeat
interval and tries again: during a failover every node then calls the standby several times a second for
nothing (at 10,000 nodes some 40,000 refusals a second, which took more CPU than the takeover itself), and
when the standby is elected each node comes back only at its next try. Held instead, a call waits for
the election: answered by the new leader the moment it leads, or 503 ``not_leader`` after the hold, well
within the agent's own timeout for the call (a third of the heartbeat timeout), so that an agent that
only lost its way to a live leader goes back to it soon.
"""

from __future__ import annotations

import asyncio
import math

#: The longest hold, whatever the heartbeat timeout.
HOLD_CAP_S = 1.0
#: The hold is this share of the heartbeat timeout: three quarters of the agent's per-call timeout (a third
#: of it), so that the 503 still reaches an agent that waits for it.
HOLD_SHARE = 1 / 4


def hold_seconds(heartbeat_timeout_s: float) -> float:
    """How long a standby holds a call: :data:`HOLD_SHARE` of the heartbeat timeout, at most
    :data:`HOLD_CAP_S`."""
    return min(HOLD_CAP_S, heartbeat_timeout_s * HOLD_SHARE)


#: Held calls whose holds end within this long of each other share one timer and one event.
SLOT_S = 0.05


class StandbyHold:
    """Whether this master leads, as something calls can wait for. Thousands of calls are held at once
    during a failover: they share an event per :data:`SLOT_S` of end time (one timer each), not a task and
    a timer per call. Used inside the running loop only."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._leading = False
        self._slots: dict[int, asyncio.Event] = {}  # slot number (end time / SLOT_S) -> its event
        self.waiting = 0  # calls held now

    def led(self) -> None:
        """This master leads now: release every held call."""
        self._leading = True
        for slot in self._slots.values():
            slot.set()
        self._slots.clear()

    def lost(self) -> None:
        """This master stands by (again)."""
        self._leading = False

    async def wait(self) -> None:
        """Return once this master leads, or after :attr:`seconds` (up to :data:`SLOT_S` more)."""
        if self._leading:
            return
        loop = asyncio.get_running_loop()
        number = math.ceil((loop.time() + self.seconds) / SLOT_S)
        slot = self._slots.get(number)
        if slot is None:
            slot = self._slots[number] = asyncio.Event()
            loop.call_at(number * SLOT_S, self._end, number)
        self.waiting += 1
        try:
            await slot.wait()
        finally:
            self.waiting -= 1

    def _end(self, number: int) -> None:
        slot = self._slots.pop(number, None)
        if slot is not None:
            slot.set()
