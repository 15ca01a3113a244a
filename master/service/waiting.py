"""How a node's call waits in the master: keyed wake-ups of pending long-polls, and a standby's hold.

**Wake-ups** (:class:`Notifier`) of pending long-polls (``/v1/round``, ``/v1/watch``), keyed by node. The job
says after each mutation whose long-polls may now answer differently (:class:`master.job.events.Effects`:
``wake``, ``wake_only``): everyone's when a round opens or closes or the job ends, one node's when that node
alone is removed, excluded or re-admitted. A 10,000-node job holds about 10,000 pending watches, and each
woken one runs its probe again, so a node's change wakes that node's long-polls only, not every pending one.

**The standby hold** (:class:`StandbyHold`): a standby holds a joined node's heartbeat, watch or round call
briefly before its 503. An agent calls a standby only when its master failed it. Refused at once, it waits
50-100 % of a heartbeat interval and tries again: during a failover every node then calls the standby
several times a second for nothing (at 10,000 nodes some 40,000 refusals a second, which took more CPU than
the takeover itself), and when the standby is elected each node comes back only at its next try. Held
instead, a call waits for the election: answered by the new leader the moment it leads, or 503
``not_leader`` after the hold, well within the agent's own timeout for the call (a third of the heartbeat
timeout), so that an agent that only lost its way to a live leader goes back to it soon.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from weakref import WeakValueDictionary


class Notifier:
    """Wakes waiting long-polls: all of them, or those of some keys (node ids).

    A waiter takes a :meth:`ticket` *before* it checks the state and then waits on that ticket, so that a
    notify between its check and its wait is not lost (it would otherwise sleep until its timeout: with
    notifies only on real changes, nothing else would wake it). A ticket taken with a key is set by a
    notify of everyone or of that key; one taken without a key is set by every notify."""

    def __init__(self) -> None:
        self._event = asyncio.Event()  # the keyless waiters' ticket
        # One ticket per key that has a waiter; an entry goes when its last waiter drops the ticket (ends its
        # poll), so polls of ids that come and go leave nothing behind.
        self._keyed: WeakValueDictionary[str, asyncio.Event] = WeakValueDictionary()

    def notify(self, keys: Iterable[str] | None = None) -> None:
        """Wake every waiter (``keys`` None), or those whose ticket has one of ``keys`` (and keyless ones)."""
        self._event.set()
        self._event = asyncio.Event()
        if keys is None:
            tickets, self._keyed = list(self._keyed.values()), WeakValueDictionary()
        else:
            tickets = [ticket for key in keys if (ticket := self._keyed.pop(key, None)) is not None]
        for ticket in tickets:
            ticket.set()

    def ticket(self, key: str | None = None) -> asyncio.Event:
        """Set by the next :meth:`notify` that concerns ``key`` (of everyone or naming it); without a key,
        by the next notify of any kind."""
        if key is None:
            return self._event
        ticket = self._keyed.get(key)
        if ticket is None:
            ticket = self._keyed[key] = asyncio.Event()
        return ticket


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
