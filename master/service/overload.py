"""Overload: what the master does when heartbeats arrive faster than it can serve them.

It degrades instead of falling over. Every heartbeat the event loop reads is one that arrived since the
previous pass of the loop, and the loop reads ready connections in the order they became ready (epoll's ready
list): within one pass, the first heartbeats are served, and once the pass has spent :data:`PASS_BUDGET_S`
of CPU time on heartbeats (or :data:`SERVE_SHARE` of the previous pass's, when that pass was long), the rest
of that pass's heartbeats are shed: answered at once ``429 busy``, without validation or any job work
(master.http.stream). A served heartbeat therefore waits about one pass for its read and one budget for its
turn; a shed one is answered as fast, with ``retry_after_s``
(:func:`retry_after`): its agent waits that long before its next beat (elastic.control.stream_client; a
``retry`` refusal in elastic.control.error_table), so that the offered load falls to what the master serves.
Shedding alone would not do: answering a heartbeat costs nearly as much as serving it.

Only a leader sheds: a standby holds a node's heartbeat until it leads (master.service.waiting), which costs
it nothing per pass, and a node it told to wait would come back to the new leader later.

A shed heartbeat that carries its node's current secret still counts as a sign of life (the node's liveness
is judged against receipt, not service: :meth:`master.job.job.Job.heard`; the secret is compared, not hashed,
once the node's heartbeats were checked), so that no node is declared dead because the master was too busy
to serve its reports.

:class:`Admission` keeps the per-pass budget and the counts; :meth:`Admission.judge` (from the service's
tick) says when an overload starts (at least :data:`START_SHED` heartbeats and 1 % of those received shed
within each of two seconds in a row) and ends (no such second for :data:`CALM_S`): an event each, and the
``elastic_master_overloaded`` gauge (master.http.metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: CPU time (the loop thread's) one pass of the event loop may spend on heartbeats before it sheds the rest
#: of that pass's. CPU, not wall time: a master that is preempted or held to a CPU quota mid-pass has not
#: had more work than it can do (shedding by wall time then shed nearly everything: a long pass is read
#: whole in the next one). Served heartbeats wait about two passes at most (their read, their turn). 20 ms:
#: the other work a pass may hold (a tick's aggregates: 7 ms at 10,000 nodes) sheds nothing by itself.
PASS_BUDGET_S = 0.02
#: How long an agent whose heartbeat was shed is asked to wait before its next one (``retry_after_s`` of
#: the ``429``), in heartbeat intervals: shedding alone costs nearly as much as serving (the reply's write
#: is most of a heartbeat's cost), so the offered load must drop too. Never more than half the heartbeat
#: timeout (:func:`retry_after`): the shed heartbeat counted as heard, the next one comes well within it.
BACKOFF_INTERVALS = 3.0
#: Share of the previous pass's CPU a pass may spend on serving heartbeats when that is more than
#: :data:`PASS_BUDGET_S`. A pass that was long (thousands of heartbeats read at once, most of them shed) is
#: no shorter for shedding more of the next: the answers cost most of what serving does. Its heartbeats have
#: waited that long already, and serving half of them keeps the master's goodput from collapsing to one
#: budget per long pass.
SERVE_SHARE = 0.5
#: Heartbeats shed within one second (and at least 1 % of those received) that make an overload.
START_SHED = 10
#: Seconds without a second of overload's rate of sheds (:data:`START_SHED`) that end an overload.
CALM_S = 5.0


def retry_after(interval_s: float, timeout_s: float) -> float:
    """Seconds a shed heartbeat's agent waits before its next one (see :data:`BACKOFF_INTERVALS`)."""
    return min(BACKOFF_INTERVALS * interval_s, timeout_s / 2)


class Admission:
    """The per-pass heartbeat budget of one master, and its overload state (see the module docstring)."""

    def __init__(
        self, budget_s: float = PASS_BUDGET_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.budget_s = budget_s
        self._budget = budget_s  # this pass's (see SERVE_SHARE)
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pass_at: float | None = None  # the first heartbeat of the current pass, while it lasts
        #: Heartbeats shed since the master started (soft: this process's).
        self.shed = 0
        self.overloaded = False
        self._mark: tuple[float, int, int] | None = None  # (time, shed, served) at the last judgement
        self._shedding_at = float("-inf")  # the last judgement that found an overload's rate of sheds
        self._shedding_seconds = 0  # judgements in a row that found it

    def admit(self) -> bool:
        """Whether to serve the heartbeat just read (False: shed it). O(1); on the event loop thread."""
        now = self._clock()
        at = self._pass_at
        if at is None:
            self._pass_at = now
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            # Runs first in the next pass (the loop runs this pass's ready callbacks first): the pass ends.
            loop.call_soon(self._end_pass)
            return True
        if now - at <= self._budget:
            return True
        self.shed += 1
        return False

    def _end_pass(self) -> None:
        at, self._pass_at = self._pass_at, None
        if at is not None:  # the next pass's budget: see SERVE_SHARE
            self._budget = max(self.budget_s, SERVE_SHARE * (self._clock() - at))

    def judge(self, now: float, served: int) -> bool | None:
        """Call about every second or more often with the heartbeats served so far: True when an overload
        starts now, False when it ends now, None otherwise."""
        mark = self._mark
        if mark is None or now - mark[0] < 1.0:
            if mark is None:
                self._mark = (now, self.shed, served)
            return None
        shed, got = self.shed - mark[1], served - mark[2] + self.shed - mark[1]
        self._mark = (now, self.shed, served)
        if shed < START_SHED or shed < 0.01 * got:  # a pass now and then (a collection) sheds a few
            self._shedding_seconds = 0
            return self._calm(now)
        self._shedding_at = now
        self._shedding_seconds += 1
        # Two such seconds in a row: one long pass (the loop preempted, a collection) sheds a burst, and is
        # no overload.
        if not self.overloaded and self._shedding_seconds >= 2:
            self.overloaded = True
            return True
        return None

    def _calm(self, now: float) -> bool | None:
        if self.overloaded and now - self._shedding_at >= CALM_S:
            self.overloaded = False
            return False
        return None
