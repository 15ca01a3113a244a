"""The master's service: it leads the job while elected (the tick, persistence of durable state before any
reply reveals it, wake-ups of long-polls) and stands by otherwise. The HTTP routes (master.http.app) call it.

All job state is touched only from the event loop thread, so no lock is needed. Background tasks are
supervised (master.service.supervision): a crash resigns the leadership and exits non-zero.

The master's clock (:func:`unix_monotonic`) is monotonic, but reads Unix time: job state machines take
``now`` from it. It never jumps (a wall-clock step does not expire heartbeats or stretch a recovery), yet its
readings are Unix times, so the job's event times read as dates in the event log, agree with Prometheus'
sample times, and stay comparable after a failover to a master on another host (to the precision of the
hosts' wall clocks).

A leader cut off from its agents but not from etcd would keep its lease and declare every node dead (a
job-wide restart) while the agents, failing over, reach a standby that answers ``503 not_leader``. Of the
designs that avoid it (agents that vote a leader out through the standby, a leader that needs a quorum of
heartbeats to renew its lease, or a leader that suspects itself) this is the last: the job's tick applies
the pure rule :class:`master.job.liveness.SelfSuspicion` (most of the running round silent at once: hold
every verdict for one heartbeat timeout, record the incident durably, ask to resign), and the service
resigns the term once the store holds that incident (:meth:`MasterService._resign_term`), then campaigns
again only after a pause, so that the standby wins. It needs no new message and no change to the lease,
and it also covers a master without a standby (the hold alone delays the verdicts by one timeout). The
incident is durable so that the successor, restoring it, declares the nodes that stay silent dead after
its grace instead of resigning in turn: at most one resignation per incident.

The process's own health figures (:class:`MasterHealth`: heartbeats received, long-polls open, store write
latency) are counted here with one cheap update each and exported by :mod:`master.http.metrics`. They belong
to this process: a restarted or new master starts them from zero (Prometheus' ``rate()`` handles that),
unlike the job's totals, which are stored with the job."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    LONG_POLL_CAP_S,
)
from elastic.control.token_source import WatchedToken
from elastic.exit_codes import ExitCode
from elastic.text import printable
from master.job.errors import JobError
from master.job.events import EventKind
from master.job.job import Job
from master.job.snapshot import describe as describe_unreadable
from master.job.views import ReasonLog
from master.service.event_log import EventLog
from master.service.fault_hook import InjectedFault
from master.service.gc_pacing import GcPacer
from master.service.overload import CALM_S, Admission
from master.service.settings import ServerSettings
from master.service.supervision import MasterFailure, Supervisor
from master.service.waiting import Notifier, StandbyHold, hold_seconds
from master.store.base import MemoryStore, StateFormatError, StateStore, StoreError

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
#: Seconds over which :meth:`MasterHealth.heartbeats_per_second` averages.
RATE_WINDOW_S = 10.0
#: Longest wait, before a suspecting leader resigns, for the store to hold the incident (see _resign_term).
RESIGN_SAVE_S = 2.0


def unix_monotonic() -> Callable[[], float]:
    """The master's clock: ``time.monotonic()`` plus the offset to ``time.time()`` taken once, now."""
    offset = time.time() - time.monotonic()
    return lambda: time.monotonic() + offset


@dataclass
class MasterHealth:
    """This master process's own figures (not the job's); see the module docstring."""

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


class ConnectionFigures(Protocol):
    """What ``/metrics`` reads of the server's connection guard (master.http.conn_guard.ConnectionGuard)."""

    @property
    def open(self) -> int: ...
    @property
    def cap(self) -> int: ...
    @property
    def closed(self) -> dict[str, int]: ...


class NotLeaderError(JobError):
    """This master does not lead the job (a standby, or it stepped down or lost its lease): the client asks
    another master (HTTP 503, master.http.errors)."""

    code = ErrorCode.NOT_LEADER


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
        # event times read as Unix times (unix_monotonic)
        self.settings = settings
        self.clock = clock or unix_monotonic()
        self.health = MasterHealth()  # this process's own figures, for /metrics
        #: The job token every listener of this master accepts: a rotated --token-file is followed, the
        #: previous token accepted for one heartbeat timeout (elastic.control.token_source).
        self.tokens = WatchedToken(
            settings.token, settings.token_file, settings.job.heartbeat_timeout_s, log_news=False
        )
        #: Heartbeats served or shed by the loop pass's budget (master.service.overload), and the overload.
        self.admission = Admission()
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
        self._saved_version = -1  # the current job's version that the store holds (see stored())
        self._saved: asyncio.Event | None = None  # set (and replaced) after each save
        self._reasons = ReasonLog(log)  # the round's waiting reason, logged when it changes
        self._tick_fault_s = tick_fault_s
        self._led_since = 0.0
        self._ticked_at: float | None = None  # the last tick while leading (see _excuse_stall)
        self._term_tasks: list[asyncio.Task] = []
        self._run_task: asyncio.Task | None = None
        self._resign: asyncio.Event | None = None  # the term's: set when the job suspects this master
        self._stepping_down: asyncio.Task | None = None
        #: Called once when a supervised task failed (the server then exits); see :attr:`failure`.
        self.on_failure: Callable[[], None] | None = None
        #: ``--exit-on-job-end``: called once the job ended and its agents learned it (the server then stops
        #: serving, and the daemon exits with :attr:`job_end_code`).
        self.on_job_end: Callable[[], None] | None = None
        #: The exit code of the one table (elastic.exit_codes) for the job's end; None while it runs.
        self.job_end_code: int | None = None
        #: The serving server's connection guard, for its figures on /metrics (None when not served).
        self.connection_guard: ConnectionFigures | None = None
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
        if self.settings.exit_on_job_end:
            self.supervisor.spawn(self._end_with_job(), "exit-on-job-end")

    def ready(self) -> bool:
        """``GET /readyz``: this master can serve: it leads the job, or it stands by for a durable store
        (campaigning, so that it takes over when the leader goes); never while stepping down or failed."""
        if self.stopping or self.failure is not None or self._run_task is None or self._run_task.done():
            return False
        return (self.job is not None and self.store.leading) or (self.job is None and self.store.durable)

    async def _end_with_job(self) -> None:
        """``--exit-on-job-end``: once the job has an outcome (stored) and its agents had time to learn it,
        set :attr:`job_end_code` and ask the server to stop. The agents learn the outcome from their
        long-polls and heartbeat replies: the master lingers until no long-poll is open and no heartbeat
        came for two heartbeat intervals, at most one heartbeat timeout (a node silent that long is dead)."""
        while True:  # the outcome: a wake-up of the long-polls comes with it (master.job.job.Job._finish)
            ticket = self.notifier.ticket()
            job = self.job
            if job is not None and job.outcome is not None:
                break
            await ticket.wait()
        with contextlib.suppress(NotLeaderError):
            await self.stored()
        s = self.settings.job
        ended = time.monotonic()
        quiet_s, pace = 2 * s.heartbeat_interval_s, min(0.1, s.heartbeat_interval_s / 4)  # the tick's pace
        heard, heard_at = self.health.heartbeats, ended
        while time.monotonic() - ended < s.heartbeat_timeout_s:
            now = time.monotonic()
            if self.health.heartbeats != heard:
                heard, heard_at = self.health.heartbeats, now
            if self.health.long_polls_open == 0 and now - heard_at >= quiet_s:
                break
            await asyncio.sleep(pace)  # what it waits for is other processes' silence: no event to await
        code, why = end_code(job)
        log.info("the job ended: %s; exiting %d (--exit-on-job-end)", why, code)
        self.job_end_code = code
        if self.on_job_end is not None:
            self.on_job_end()
        await asyncio.Event().wait()  # a supervised task does not end on its own; the shutdown cancels it

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
            raise NotLeaderError(f"master {self.master_id} is a standby; ask another master")
        return self.job

    def changed(self) -> None:
        """Call after every mutation: carry out its effects (master.job.events.Effects): log its events, have
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
        self._note_token_news()
        # No verdicts from a term that may be over (e.g. "every node dead" right after a freeze).
        if self.job is not None and self.store.leading and not self.stopping:
            if self._tick_fault_s is not None and self.clock() - self._led_since >= self._tick_fault_s:
                raise InjectedFault(
                    f"ELASTIC_MASTER_TICK_FAULT_S={self._tick_fault_s:g}: tick failure injected"
                )
            now = self.clock()
            self._excuse_stall(now)
            self._judge_overload(now)
            self.job.tick(now)
            if self.job.suspicion.resign_wanted:  # master.job.liveness.silent_at_once
                self.job.suspicion.resign_wanted = False
                if self.store.durable and self._resign is not None:
                    self._resign.set()
            self.changed()
            self._reasons.note(self.job, self.clock())

    def _note_token_news(self) -> None:
        """A rotated or unusable --token-file (polled here too, so a change is seen without a request) is an
        event of the job, where the operator looks; a standby only logs it (its leader records its own)."""
        self.tokens.poll()
        news = self.tokens.take_news()
        job = self.job
        if job is None or not self.store.leading or self.stopping:
            for _, message in news:
                log.warning("%s", message)
            return
        if not news:
            return
        for kind, message in news:
            what = EventKind.TOKEN_ROTATED if kind == "rotated" else EventKind.TOKEN_FILE_UNUSABLE
            job.record(self.clock(), what, message)
        self.changed()

    def _judge_overload(self, now: float) -> None:
        """An overload that starts or ends (master.service.overload) is an event of the job."""
        admission, job = self.admission, self.job
        change = admission.judge(now, self.health.heartbeats)
        if change is None or job is None:
            return
        if change:
            message = (
                f"master {self.master_id} is overloaded: heartbeats arrive faster than it serves them; it "
                f"serves them in arrival order and sheds the rest (answered 429 busy; {admission.shed} shed "
                "so far), their nodes counted alive on receipt"
            )
        else:
            message = (
                f"master {self.master_id} is no longer overloaded: it served the heartbeats of the last "
                f"{CALM_S:g}s ({admission.shed} shed in all)"
            )
        job.note_overload(change, message, now)

    def heard(self, node_id: str, node_secret: str) -> None:
        """A heartbeat of ``node_id`` arrived but was shed (master.service.overload): alive at its receipt
        if it carries the node's secret."""
        job = self.job
        if job is not None and self.store.leading:
            job.heard(node_id, node_secret, self.clock())

    def _excuse_stall(self, now: float) -> None:
        """A tick more than :data:`STALL_S` after the previous one means the master's own loop stalled
        (CPU starved, a long collection, the process stopped): the heartbeats of that time waited unread,
        so no node is declared dead for them; the stall is an event, where the operator looks."""
        last, self._ticked_at = self._ticked_at, now
        job = self.job
        if last is None or job is None or now - last <= STALL_S:
            return
        job.excuse_stall(now - last, now)

    async def run(self) -> None:
        """Lead the job whenever elected; tick and persist while leading; stand by otherwise."""
        dirty = self._dirty = asyncio.Event()
        while True:
            lost = asyncio.Event()  # this term's: set once its leadership is lost
            await self.store.campaign(self.master_id, lost.set)
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
                # continue the file past what a previous leader of this submission wrote
                self.event_log.resume(self.job.incarnation)
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
                spawn(self._persist_forever(dirty, lost), "persist"),
            ]
            resign = self._resign = asyncio.Event()
            resigned = False
            while not lost.is_set() and not resigned:
                await _first(lost, resign)
                if resign.is_set() and not lost.is_set():
                    resign.clear()
                    resigned = await self._resign_term()
            for task in self._term_tasks:
                task.cancel()
            log.warning(
                "master %s %s the leadership of job %s; standing by",
                self.master_id,
                "resigned" if resigned else "lost",
                job_settings.job_id,
            )
            self.job = None
            self._resign = None
            self.standby_hold.lost()
            self.notifier.notify()
            if resigned:
                # Let the standby (campaigning since it saw the key go) win: a resigned leader that won
                # again at once would only hear the same silence, one term later.
                interval, timeout = job_settings.heartbeat_interval_s, job_settings.heartbeat_timeout_s
                await asyncio.sleep(resign_pause(interval, timeout))

    async def _resign_term(self) -> bool:
        """Resign this term because the job suspects this master's network (the leader heard nothing from
        most nodes at once; master.job.liveness.silent_at_once), so that a standby that the agents reach
        leads: True once resigned. Write-ahead: the store holds the incident first, so the successor never
        resigns in turn (it declares the nodes still silent dead after its grace). When that save does not
        make it in time, this master keeps leading; its hold on the verdicts ends one heartbeat timeout
        later."""
        try:
            await asyncio.wait_for(self.stored(), RESIGN_SAVE_S)
        except (NotLeaderError, asyncio.TimeoutError):
            log.warning("could not store the self-suspicion before resigning; leading on")
            return False
        log.warning(
            "master %s resigns the leadership of job %s: it heard nothing from most nodes at once "
            "(its own network is suspect); a standby that hears them takes over",
            self.master_id,
            self.settings.job.job_id,
        )
        await self.store.resign()
        return True

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

    async def _persist_forever(self, dirty: asyncio.Event, lost: asyncio.Event) -> None:
        """Write the newest snapshot after changes (coalesced: bursts cost one write: ``dirty``); a failed
        write sets this term's ``lost``."""
        while True:
            await dirty.wait()
            dirty.clear()
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
                lost.set()
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
                raise NotLeaderError(why)
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
        id): only changes that concern that node, or everyone, wake the poll (master.service.waiting). With
        ``client_gone`` (an awaitable of this poll's own, done once the client has disconnected, e.g.
        ``master.http.app.disconnected``; cancelled when the poll ends), a client that disconnects ends the
        poll at once and ``on_client_gone`` is called."""
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
                # One task per wait (the ticket's), the timeout a timer of asyncio.wait's: a watch renews
                # every ~20 s per node, thousands a minute at scale (wait_for would add a task of its own).
                change = asyncio.ensure_future(ticket.wait())
                try:
                    waiting = {change} if gone is None else {change, gone}
                    await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()  # woken by the client going, the timeout, or this poll's own end
                if gone is not None and gone.done():
                    if on_client_gone is not None:
                        on_client_gone()
                    return None
        finally:
            self.health.long_polls_open -= 1
            if gone is not None:
                gone.cancel()


async def _first(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def end_code(job: Job) -> tuple[int, str]:
    """The exit code of ``elastic-master --exit-on-job-end`` for an ended job, and why (one line): 0 only
    when the job succeeded and its newest step is durable (no node reports a persist error, and no
    checkpoint step is newer than the newest one a node persisted; a job that persists nothing has
    nothing to lose); a succeeded job whose newest step is not durable: 1 (retryable: started again, it
    resumes from the newest durable step); a failed one: its outcome's code (1 retryable, 3 failed for
    good, ...)."""
    outcome = job.outcome
    if outcome is None:
        raise ValueError("the job has not ended")
    if not outcome.succeeded:
        return (outcome.exit_code or int(ExitCode.FAILED)), f"failed: {outcome.summary}"
    newest, persisted = job.checkpoints.committed_step, job.checkpoints.persisted_newest
    troubled = sorted(n.node_id for n in job.nodes.values() if n.persist_error)
    if troubled:
        return int(ExitCode.FAILED), (
            f"succeeded, but the persists of node(s) {', '.join(troubled)} failed: the newest step may not "
            "be durable (elastic-run says where each copy is kept)"
        )
    if persisted is not None and newest is not None and persisted < newest:
        return int(ExitCode.FAILED), (
            f"succeeded, but the newest step {newest} is not durable (newest persisted step {persisted})"
        )
    durable = f"newest step {persisted} durable" if persisted is not None else "no checkpoint persisted"
    return int(ExitCode.SUCCESS), f"succeeded ({durable})"


def resign_pause(interval_s: float, timeout_s: float) -> float:
    """How long a master that resigned waits before it campaigns again: two heartbeat intervals (at least
    a second), never more than the heartbeat timeout."""
    return min(timeout_s, max(1.0, 2.0 * interval_s))


def spread(timeout: float) -> float:
    """A long-poll's wait, up to :data:`LONG_POLL_SPREAD` shorter than asked (at random): the nodes of a
    round start their watches together, and without it they would all time out and poll again in the
    same instant, every time (10,000 renewals at once delayed heartbeats by 300 ms)."""
    return timeout * (1.0 - LONG_POLL_SPREAD * random.random()) if timeout >= 1.0 else timeout
