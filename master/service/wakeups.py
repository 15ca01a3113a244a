"""Wake-ups of pending long-polls (``/v1/round``, ``/v1/watch``), keyed by node.

The job says after each mutation whose long-polls may now answer differently
(:class:`master.job.effects.Effects`: ``wake``, ``wake_only``): everyone's when a round opens or closes or
the job ends, one node's when that node alone is removed, excluded or re-admitted. A 10,000-node job holds
about 10,000 pending watches, and each woken one runs its probe again, so a node's change wakes that node's
long-polls only, not every pending one.
"""

from __future__ import annotations

import asyncio
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
