"""The master's service: it leads the job while elected (the tick, persistence of durable state before any
reply reveals it, wake-ups of long-polls) and stands by otherwise. The HTTP routes (master.http.app) call it.

All job state is touched only from the event loop thread, so no lock is needed. Background tasks are
supervised (master.service.supervision): a crash resigns the leadership and exits non-zero."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    LONG_POLL_CAP_S,
)
from elastic.text import printable
from master.http.errors import ApiError
from master.job.job import Job
from master.job.wait_reason import ReasonLog
from master.service.clock import unix_monotonic
from master.service.event_log import EventLog
from master.service.fault_hook import InjectedFault
from master.service.gc_pacing import GcPacer
from master.service.health import MasterHealth
from master.service.settings import ServerSettings
from master.service.standby_hold import StandbyHold, hold_seconds
from master.service.supervision import MasterFailure, Supervisor
from master.service.wakeups import Notifier
from master.store.base import MemoryStore, StateFormatError, StateStore, StoreError
from master.store.state_schema import describe as describe_unreadable

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A gap between two ticks (normally 0.1 s apart) longer than this is a stall of the master's own.
STALL_S = 1.0
#: The longest rest between two saves (see _persist_forever).
MAX_SAVE_REST_S = 0.5
#: The share by which a long-poll of a second or more may end before its timeout (:func:`spread`).
LONG_POLL_SPREAD = 0.25
#: Longest wait for the last save of a master that steps down (etcd slow or gone: the lease still goes).
FINAL_SAVE_S = 2.0


async def _wait_for(ticket: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):  # not the builtin TimeoutError before 3.11
        await asyncio.wait_for(ticket.wait(), timeout)


class MasterService:
    """Owns the job (while this master leads), the clock, the tick loop, persistence and wake-ups."""

    def __init__(
        self,
        settings: ServerSettings,
        clock: Callable[[], float] | None = None,
        store: StateStore | None = None,
        tick_fault_s: float | None = None,
    ) -> None:
        """``tick_fault_s``: the test hook of master.service.fault_hook (the tick fails after leading that
        long)."""
        # event times read as Unix times (master.service.clock)
        self.settings = settings
        self.clock = clock or unix_monotonic()
        self.health = MasterHealth()  # this process's own figures, for /metrics
        self.event_log = (
            EventLog(settings.event_log, settings.event_log_max_bytes, settings.event_log_backups)
            if settings.event_log
            else None
        )
        self.store = store or MemoryStore()
        self.master_id = uuid.uuid4().hex[:12]
        self.job: Job | None = None  # None while standing by
        self.standby_hold = StandbyHold(hold_seconds(settings.job.heartbeat_timeout_s))
        self._notifier: Notifier | None = None
        #: Keeps full garbage collections off the heartbeat path (the daemon sets one:
        #: master.service.gc_pacing).
        self.gc_pacer: GcPacer | None = None
        self._dirty: asyncio.Event | None = None
        self._lost: asyncio.Event | None = None
        self._saved_version = -1  # the current job's version that the store holds (see stored())
        self._saved: asyncio.Event | None = None  # set (and replaced) after each save
        self._reasons = ReasonLog(log)  # the round's waiting reason, logged when it changes
        self._tick_fault_s = tick_fault_s
        self._led_since = 0.0
        self._ticked_at: float | None = None  # the last tick while leading (see _excuse_stall)
        self._term_tasks: list[asyncio.Task] = []
        self._run_task: asyncio.Task | None = None
        self._stepping_down: asyncio.Task | None = None
        #: Called once when a supervised task failed (the server then exits); see :attr:`failure`.
        self.on_failure: Callable[[], None] | None = None
        self.supervisor = Supervisor(self._failed)

    @property
    def failure(self) -> MasterFailure | None:
        """Why the master must exit non-zero, once a supervised task failed."""
        return self.supervisor.failure

    @property
    def stopping(self) -> bool:
        return self._stepping_down is not None

    def start(self) -> None:
        """Start the (supervised) run loop; call inside the running event loop."""
        self._run_task = self.supervisor.spawn(self.run(), "run")

    def step_down(self) -> asyncio.Task:
        """Stop leading for good, before any draining: cancel the tick and persist loops, answer every
        pending long-poll with 503 ``not_leader`` (agents ask another master), save the job once more if
        it changed, and revoke the lease (the store's ``close``) so that a standby is elected at once.
        Idempotent; the returned task completes when the lease is gone."""
        if self._stepping_down is None:
            self._stepping_down = asyncio.ensure_future(self._step_down())
        return self._stepping_down

    async def _step_down(self) -> None:
        for task in [*self._term_tasks, *([self._run_task] if self._run_task is not None else [])]:
            task.cancel()
        job = self.job
        self.notifier.notify()  # pending long-polls probe again and meet leading_job()'s 503
        if (
            job is not None
            and self.store.durable
            and self.store.leading
            and self._saved_version < job.version
        ):
            try:  # what a request changed since the last save (the tick is stopped: nothing changes now)
                await asyncio.wait_for(self.store.save(job.snapshot()), FINAL_SAVE_S)
            except (StoreError, asyncio.TimeoutError) as exc:
                log.warning("last save before stepping down failed (%s)", exc or "timed out")
        self.job = None
        await self.store.close()
        if job is not None:
            log.info("master %s stepped down from job %s", self.master_id, self.settings.job.job_id)

    def _failed(self, failure: MasterFailure) -> None:
        async def resign_and_exit() -> None:
            await self.step_down()
            if self.on_failure is not None:
                self.on_failure()

        asyncio.ensure_future(resign_and_exit())

    @property
    def notifier(self) -> Notifier:
        if self._notifier is None:  # created lazily inside the running loop
            self._notifier = Notifier()
        return self._notifier

    def leading_job(self) -> Job:
        """The job, or a 503 that sends the client to another master."""
        # ``store.leading`` turns false as soon as the lease may have expired, before the store's lease
        # task notices: a leader frozen past its lease serves nothing stale once it runs again.
        if self.job is None or not self.store.leading or self.stopping:
            raise ApiError(
                503, ErrorCode.NOT_LEADER, f"master {self.master_id} is a standby; ask another master"
            )
        return self.job

    def changed(self) -> None:
        """Call after every mutation: carry out its effects (master.job.effects): log its events, have
        durable changes persisted, wake the long-polls whose answer may have changed."""
        job = self.job
        if job is None:
            return
        effects = job.take_effects()
        for event in effects.events:
            log.info("%s: %s", event.kind, printable(event.message))  # messages quote nodes' own words
        if effects.persist and self._dirty is not None:
            self._dirty.set()
        if effects.wake:  # only then can a pending long-poll's answer have changed; wake_only: whose
            self.notifier.notify(effects.wake_only)

    def tick(self) -> None:
        if self.gc_pacer is not None:
            self.gc_pacer.tick()
        # No verdicts from a term that may be over (e.g. "every node dead" right after a freeze).
        if self.job is not None and self.store.leading and not self.stopping:
            if self._tick_fault_s is not None and self.clock() - self._led_since >= self._tick_fault_s:
                raise InjectedFault(
                    f"ELASTIC_MASTER_TICK_FAULT_S={self._tick_fault_s:g}: tick failure injected"
                )
            now = self.clock()
            self._excuse_stall(now)
            self.job.tick(now)
            self.changed()
            self._reasons.note(self.job, self.clock())

    def _excuse_stall(self, now: float) -> None:
        """A tick more than :data:`STALL_S` after the previous one means the master's own loop stalled
        (CPU starved, a long collection, the process stopped): the heartbeats of that time waited unread,
        so no node is declared dead for them; the stall is an event, where the operator looks."""
        last, self._ticked_at = self._ticked_at, now
        job = self.job
        if last is None or job is None or now - last <= STALL_S:
            return
        stalled = now - last
        job.liveness.excuse(stalled)
        job.record(
            now,
            "master_stalled",
            f"master {self.master_id} did not run for {stalled:.1f}s (CPU starved, stopped or paused): "
            "heartbeat ages extended by that much",
        )

    async def run(self) -> None:
        """Lead the job whenever elected; tick and persist while leading; stand by otherwise."""
        self._dirty = asyncio.Event()
        while True:
            self._lost = asyncio.Event()
            await self.store.campaign(self.master_id, self._lost.set)
            try:
                snapshot = await self.store.load()
            except StateFormatError:
                raise  # it does not pass by retrying: the supervisor resigns and exits with this line
            except StoreError as exc:
                # Never start a fresh job over state that exists but could not be read: campaign again.
                log.error("elected, but cannot read the job state (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            now = self.clock()
            job_settings = self.settings.job
            term = self.store.term
            self.job = (
                self._restore(snapshot, now, term)
                if snapshot
                else Job(job_settings, now, self.master_id, term)
            )
            self._led_since = now
            self._ticked_at = None
            if self.event_log is not None:
                self.event_log.resume()  # continue the file past what a previous leader wrote
            self._saved_version = -1
            log.info(
                "master %s leads job %s (store %s)",
                self.master_id,
                job_settings.job_id,
                self.settings.store_url,
            )
            self.changed()
            spawn = self.supervisor.spawn
            self._term_tasks = [
                spawn(self._tick_forever(), "tick"),
                spawn(self._persist_forever(), "persist"),
            ]
            await self._lost.wait()
            for task in self._term_tasks:
                task.cancel()
            log.warning(
                "master %s lost the leadership of job %s; standing by", self.master_id, job_settings.job_id
            )
            self.job = None
            self.standby_hold.lost()
            self.notifier.notify()

    def _restore(self, snapshot: dict, now: float, term: int) -> Job:
        """The job continued from the stored state; :class:`StateFormatError` (one line naming the key)
        when this master cannot read it."""
        try:
            return Job.restore(self.settings.job, snapshot, now, self.master_id, term)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            where, job_id = self.store.state_location, self.settings.job.job_id
            raise StateFormatError(
                f"cannot continue job {job_id}: its stored state ({where}) cannot be read: "
                f"{describe_unreadable(exc)}; fix or delete that key"
            ) from None

    async def _tick_forever(self) -> None:
        period = min(0.1, self.settings.job.heartbeat_interval_s / 4)
        while True:
            self.tick()
            await asyncio.sleep(period)

    async def _persist_forever(self) -> None:
        """Write the newest snapshot after changes (coalesced: bursts cost one write)."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self.job is None:
                continue
            job, version = self.job, self.job.version  # the version of the snapshot taken just below
            snapshot, began = job.snapshot(), time.perf_counter()
            try:
                await self.store.save(snapshot)
            except StoreError as exc:
                log.error(
                    "cannot persist job state (%s); stepping down so that no master serves stale state", exc
                )
                self._lost.set()
                continue
            took = time.perf_counter() - began
            self.health.store_write(took)
            if self.event_log is not None:  # only events the store holds: a successor never repeats one
                self.event_log.write(e for e in job.events if e.seq <= snapshot["event_count"])
            if job is self.job:
                if self._saved_version < 0:  # the term's first save: every reply since the election waited
                    waited = self.clock() - self._led_since
                    log.info("first save of this term: %.3fs (%.3fs after the election)", took, waited)
                    self.standby_hold.led()  # held calls go on only now: none of them waits for this save
                self._saved_version = max(self._saved_version, version)
            self._saved_ticket().set()
            self._saved = None
            # A save is O(state) (26 + 105 ms at 10,000 nodes): back to back under a flood of joins, they
            # took the whole loop and the lease went unrenewed. Rest as long as the save took (changes
            # meanwhile coalesce into the next one): saves hold at most half the loop.
            await asyncio.sleep(min(took, MAX_SAVE_REST_S))

    def _saved_ticket(self) -> asyncio.Event:
        if self._saved is None:  # created lazily inside the running loop
            self._saved = asyncio.Event()
        return self._saved

    def holds_calls(self) -> bool:
        """Whether a joined node's call waits on :attr:`standby_hold` first: this master stands by."""
        return self.store.durable and not self.stopping and (self.job is None or not self.store.leading)

    def holds_current_state(self) -> bool:
        """Whether :meth:`stored` would return at once (the store is not durable, or holds the leading
        job as it is now): a caller may then answer without waiting (the agent stream's heartbeats)."""
        if not self.store.durable:
            return True
        job = self.job
        return (
            job is not None
            and self.store.leading
            and not self.stopping
            and self._saved_version >= job.version
        )

    async def stored(self) -> None:
        """Return once the store holds the job state as it is now. A reply that reveals durable state a
        client keeps (a node's new secret) waits for this, so that a master taking over knows what the
        reply said; a 503 (the client asks another master) when this master stops leading first."""
        if not self.store.durable:
            return
        job = self.leading_job()
        target = job.version
        while self._saved_version < target:
            if self.job is not job or not self.store.leading:
                why = f"master {self.master_id} stopped leading; ask another master"
                raise ApiError(503, ErrorCode.NOT_LEADER, why)
            await _wait_for(self._saved_ticket(), 1.0)  # bounded: a lost leadership sets no ticket

    async def long_poll(
        self,
        probe: Callable[[], T | None],
        timeout: float,
        client_gone: Awaitable[object] | None = None,
        on_client_gone: Callable[[], None] | None = None,
        key: str | None = None,
    ) -> T | None:
        """Return ``probe()`` as soon as it is not None, or None after ``timeout`` (capped, and up to a
        quarter shorter: :func:`spread`); ``key`` (a node
        id): only changes that concern that node, or everyone, wake the poll (master.service.wakeups). With
        ``client_gone`` (an awaitable of this poll's own, done once the client has disconnected, e.g.
        :func:`disconnected`; cancelled when the poll ends), a client that disconnects ends the poll at
        once and ``on_client_gone`` is called."""
        deadline = self.clock() + spread(min(max(timeout, 0.0), LONG_POLL_CAP_S))
        gone = asyncio.ensure_future(client_gone) if client_gone is not None else None
        self.health.long_polls_open += 1
        try:
            while True:
                ticket = self.notifier.ticket(key)  # before the check: a change after it sets the ticket
                result = probe()
                remaining = deadline - self.clock()
                if result is not None:
                    await self.stored()  # write-ahead: an answer never reveals a state not stored yet
                    return result
                if remaining <= 0:
                    return None
                change = asyncio.ensure_future(_wait_for(ticket, remaining))
                await asyncio.wait({change, gone} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if gone is not None and gone.done():
                    change.cancel()
                    if on_client_gone is not None:
                        on_client_gone()
                    return None
        finally:
            self.health.long_polls_open -= 1
            if gone is not None:
                gone.cancel()


def spread(timeout: float) -> float:
    """A long-poll's wait, up to :data:`LONG_POLL_SPREAD` shorter than asked (at random): the nodes of a
    round start their watches together, and without it they would all time out and poll again in the
    same instant, every time (10,000 renewals at once delayed heartbeats by 300 ms)."""
    return timeout * (1.0 - LONG_POLL_SPREAD * random.random()) if timeout >= 1.0 else timeout


async def disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
