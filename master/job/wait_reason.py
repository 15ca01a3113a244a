"""Why the job is where it is: the sentence ``/v1/status``, ``elastic-master status`` and the status page
show, and the recent events they list.

The rendezvous decides with its reason (:meth:`master.job.rendezvous.Rendezvous.decide`); the job adds what
only it knows: the outcome, a node-check round waiting for results, a round whose members are finishing.
Pure functions of the job and ``now``; the master logs the sentence when it changes (:class:`ReasonLog`).
"""

from __future__ import annotations

import logging
from typing import Any

from elastic.control.protocol import StatusEvent
from elastic.text import printable
from master.job.rendezvous import Phase, name_list

#: A :class:`master.job.job.Job` (not imported: the job imports this module).
Job = Any

#: Events ``/v1/status`` lists (the newest ones).
STATUS_EVENTS = 20


def waiting_reason(job: Job, now: float) -> str:
    """One sentence: what the job waits for (with its deadline) or why it is in its current round."""
    if job.outcome is not None:
        result = "succeeded" if job.outcome.succeeded else "failed"
        return f"finished: the job {result}" + (f" ({job.outcome.summary})" if job.outcome.summary else "")
    rdzv = job.rdzv
    current = rdzv.current
    if rdzv.phase is Phase.ACTIVE and current is not None:
        check = job.node_check
        if current.number in check.rounds and not check.done:
            pending = [m for m in current.members if m not in check.results]
            return f"node check: waiting for the results of {name_list(pending)}"
        if job.succeeded:  # members of this round only; counted, not listed: this runs at every tick
            return f"finishing: {len(job.succeeded)} of {len(current.members)} nodes are done"
    return rdzv.decide(now).reason


def recent_events(job: Job, now: float, limit: int = STATUS_EVENTS) -> list[StatusEvent]:
    """The job's newest ``limit`` events, oldest first, numbered from the job's first event."""
    events = list(job.events)[-limit:]
    first = job.event_count - len(events) + 1
    return [
        StatusEvent(seq=first + i, age_s=max(now - e.at, 0.0), kind=e.kind, message=e.message)
        for i, e in enumerate(events)
    ]


class ReasonLog:
    """Logs the job's waiting reason when it changes (not at every tick)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last = ""

    def note(self, job: Job, now: float) -> None:
        reason = waiting_reason(job, now)
        if reason != self._last:
            self._last = reason
            self._log.info("round %d: %s", job.rdzv.round, printable(reason))
