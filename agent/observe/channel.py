"""The agent's end of the worker→agent progress channel (see :mod:`elastic.report`).

A Unix datagram socket in a private folder; one thread receives reports and keeps, per local rank,
the last step, when it last advanced, recent step times and the newest checkpointed step. Checkpoint
reports are also passed to an optional ``on_checkpoint(local_rank, step, location, persist_to)``
callback (the checkpoint keeper), called on the receiving thread: it must not block. A report that
carries the worker's round (from ``ELASTIC_ROUND``) passes it as ``round_number=``, which fences the
keeper's persist; reports of workers that do not send it call the callback without it. A report that a
restore found a damaged copy (kind ``corrupt``, :func:`elastic.report.report_corrupt`) calls the same
callback with ``corrupt=True`` (the file as the location), for the keeper to report it to the master; an
integrity guard's report (kind ``integrity``) with ``integrity=`` (:class:`elastic.contract.IntegrityNote`). A
checkpoint report that carries the save's duration (seconds) adds it to :attr:`save_latency`, a
:class:`LatencyHistogram` (cumulative buckets, as Prometheus exposes them) that :mod:`agent.observe.metrics`
reads when Prometheus scrapes. The datagram's form is :class:`elastic.contract.Progress`.

Progress without user code (:mod:`elastic.autoprogress`): ``auto`` reports (optimizer steps counted by a
global hook) advance the step as ``step`` reports do, until the rank sends its first explicit ``step``
report (``elastic.report``): from then on explicit steps win and ``auto`` reports are only signs of life.
``life`` (a forward pass), ``save``/``saved`` (a checkpoint save's start and end) feed the adaptive hang
bound (:mod:`agent.observe.hang_policy`): when each rank last showed life, whether a save is in progress,
and its recent step durations (:data:`DURATION_WINDOW`, without the time of the saves between steps).

Workers send checkpoint reports with a blocking send (see :mod:`elastic.report`): while this thread
is stalled they wait in the kernel's queue instead of being dropped.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from agent.observe.hang_policy import DEFAULT_POLICY
from elastic.contract import MAX_DATAGRAM_BYTES, IntegrityNote, MalformedDatagram, Progress, ProgressKind

RECENT_STEPS = 20
#: Step durations kept per rank for the adaptive hang bound: its p99 window.
DURATION_WINDOW = DEFAULT_POLICY.window
#: Upper bounds (seconds) of the checkpoint-save histogram's buckets; +Inf is implied. An in-memory save
#: takes milliseconds for a small model and seconds for tens of GiB.
SAVE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

log = logging.getLogger(__name__)


@dataclass
class RankProgress:
    step: int | None = None
    advanced_at: float = field(default_factory=time.monotonic)
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    ckpt_step: int | None = None
    #: Recent compute times per step (step time minus all-reduce wait; only with elastic.track_ddp).
    compute_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    #: The worker said its training is over (elastic.report.report_done): no more steps to expect.
    done: bool = False
    #: When its first step report arrived (the master's recovery phase ``first_step`` ends there).
    first_step_at: float | None = None
    #: The rank sent an explicit step report (elastic.report): its ``auto`` reports no longer count as steps.
    explicit: bool = False
    #: Step durations for the adaptive hang bound: the first step left out, and from an interval that
    #: contains a save the save's time (an interval whose save had not ended at the next step: all of it).
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=DURATION_WINDOW))
    #: The last sign of life (a forward pass, or an optimizer step of a rank whose explicit steps win).
    alive_at: float | None = None
    #: A checkpoint save in progress began then (None: none).
    saving_since: float | None = None
    #: The last checkpoint save ended then.
    resumed_at: float | None = None
    #: The interval since the last step is no step time (the first explicit report: the count restarts).
    interrupted: bool = False
    #: Seconds of checkpoint saves that began and ended since the last step (not step time).
    saved_s: float = 0.0

    @property
    def step_time_s(self) -> float | None:
        """Median of the recent step durations (robust to one slow step)."""
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def compute_time_s(self) -> float | None:
        """Median of the recent compute times per step, when the worker measures them."""
        return statistics.median(self.compute_times) if self.compute_times else None


_SOCKET_NAME = "progress.sock"
#: The longest path a unix socket can bind: ``sockaddr_un.sun_path`` holds 108 bytes, its NUL included.
_SUN_PATH_MAX = 107


class ProgressChannel:
    """Receives progress datagrams from this node's workers."""

    def __init__(self, on_checkpoint: Callable[..., None] | None = None) -> None:
        self._on_checkpoint = on_checkpoint
        self._dir = tempfile.mkdtemp(prefix="elastic-agent-")
        if len(os.path.join(self._dir, _SOCKET_NAME).encode()) > _SUN_PATH_MAX:
            # A deep TMPDIR leaves no room for the socket's name (bind fails: "AF_UNIX path too long"):
            # /tmp instead, whose name is short. The folder stays private (mode 0700) either way.
            os.rmdir(self._dir)
            self._dir = tempfile.mkdtemp(prefix="elastic-agent-", dir="/tmp")
        self.folder = self._dir  # removed by close(), or by the reaper if the agent is SIGKILLed
        self.path = os.path.join(self._dir, _SOCKET_NAME)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._lock = threading.Lock()
        self._ranks: dict[int, RankProgress] = {}
        #: Durations of the workers' checkpoint saves (in memory), as they reported them.
        self.save_latency = LatencyHistogram()
        #: Reports of checkpoint copies that failed their digest at a worker's restore.
        self.corrupt_reports = 0
        #: Reports of the workers' integrity guards (detections and rollbacks).
        self.integrity_reports = 0
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="progress-channel", daemon=True)
        self._thread.start()

    def reset(self, nproc: int, kept: Iterable[int] = ()) -> None:
        """Forget the previous workers' progress (called when a new worker group starts). The local ranks
        ``kept`` (workers that live on in process) keep their step durations: the adaptive hang bound of
        their steps still holds, and a fresh warm-up would give every in-process recovery 10 steps of the
        600 s fallback."""
        with self._lock:
            old = self._ranks
            self._ranks = {r: RankProgress() for r in range(nproc)}
            for r in kept:
                if r in old and r in self._ranks:
                    self._ranks[r].durations = deque(old[r].durations, maxlen=DURATION_WINDOW)
                    self._ranks[r].explicit = old[r].explicit

    def forget_durations(self, local_ranks: Iterable[int]) -> None:
        """Drop the step durations :meth:`reset` kept for ``local_ranks`` (their workers were not kept)."""
        with self._lock:
            for r in local_ranks:
                if r in self._ranks:
                    self._ranks[r].durations.clear()

    def snapshot(self) -> dict[int, RankProgress]:
        with self._lock:
            return {
                r: RankProgress(
                    p.step,
                    p.advanced_at,
                    deque(p.step_times),
                    p.ckpt_step,
                    deque(p.compute_times),
                    p.done,
                    p.first_step_at,
                    p.explicit,
                    deque(p.durations),
                    p.alive_at,
                    p.saving_since,
                    p.resumed_at,
                    p.interrupted,
                )
                for r, p in self._ranks.items()
            }

    def checkpointed_step(self) -> int | None:
        """The newest step every local rank has checkpointed (None until all have)."""
        with self._lock:
            steps = [p.ckpt_step for p in self._ranks.values()]
        known = [s for s in steps if s is not None]
        return min(known) if steps and len(known) == len(steps) else None

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except OSError:
                return  # closed
            try:
                report = Progress.decode(data)
            except MalformedDatagram:
                continue  # a malformed datagram is dropped; workers cannot break the agent
            rank, kind, step = report.local_rank, report.kind, report.step
            current = self._apply(rank, kind, step, report.compute_s)
            if current and report.save_s is not None:
                self.save_latency.observe(report.save_s)
            if current and kind is ProgressKind.CKPT and self._on_checkpoint is not None:
                fence = {"round_number": report.round} if report.round is not None else {}
                try:
                    self._on_checkpoint(rank, step, report.location, report.persist_to, **fence)
                except Exception:  # a failing callback must not stop progress reports
                    log.exception("checkpoint callback failed for local rank %d step %d", rank, step)
            elif current and kind is ProgressKind.CORRUPT:
                self._corrupt(rank, step, report.location)
            elif current and kind is ProgressKind.INTEGRITY:
                self._integrity(rank, step, report)

    def _corrupt(self, rank: int, step: int, location: str) -> None:
        """A worker's restore found a copy whose bytes fail their digest: logged here, and passed on to the
        keeper (``on_checkpoint(..., corrupt=True)``), whose corruption log the heartbeats carry."""
        self.corrupt_reports += 1
        log.error(
            "local rank %d: the checkpoint of step %d at %s failed its digest check at restore (not loaded)",
            rank,
            step,
            location or "?",
        )
        if self._on_checkpoint is None:
            return
        try:
            self._on_checkpoint(rank, step, location, "", corrupt=True)
        except Exception:  # a failing callback must not stop progress reports
            log.exception("corruption callback failed for local rank %d step %d", rank, step)

    def _integrity(self, rank: int, step: int, report: Progress) -> None:
        """A worker's integrity guard found a fault at ``step`` (or rolled back after one): passed on to
        the keeper (``on_checkpoint(..., integrity=note)``), whose findings the heartbeats carry."""
        try:
            note = replace(IntegrityNote.from_detail(report.detail), rolled_back_to=report.rolled_back_to)
        except MalformedDatagram:
            return  # a malformed report is dropped, like a malformed datagram
        self.integrity_reports += 1
        if self._on_checkpoint is None:
            return
        try:
            self._on_checkpoint(rank, step, "", "", integrity=note)
        except Exception:  # a failing callback must not stop progress reports
            log.exception("integrity callback failed for local rank %d step %d", rank, step)

    def record(self, rank: int, kind: ProgressKind, step: int, *, now: float) -> bool:
        """Record a report as if received at ``now`` (replays of recorded series: bench/hangs.py, tests)."""
        return self._apply(rank, kind, step, now=now)

    def _apply(
        self, rank: int, kind: ProgressKind, step: int, compute: float | None = None, now: float | None = None
    ) -> bool:
        """Record a report; False when it is of no current local rank."""
        now = time.monotonic() if now is None else now
        with self._lock:
            progress = self._ranks.get(rank)
            if progress is None:
                return False
            if kind is ProgressKind.AUTO and progress.explicit:
                kind = ProgressKind.LIFE  # explicit steps win; an optimizer step still shows life
            if kind is ProgressKind.STEP and not progress.explicit:
                # The first explicit report: the hook's count (from 0 in this process) is not the script's
                # step (a resumed run reports 1001 after one optimizer step; another counts from 0), so the
                # step restarts at the script's and no duration spans the switch.
                progress.explicit = True
                if progress.step is not None:
                    progress.step_times.clear()
                    progress.durations.clear()
                    progress.step, progress.advanced_at, progress.interrupted = step, now, False
                    progress.saving_since = None
            if kind in (ProgressKind.STEP, ProgressKind.AUTO):
                if progress.step is None or step > progress.step:
                    if progress.step is not None:
                        duration = (now - progress.advanced_at) / (step - progress.step)
                        progress.step_times.append(duration)
                        # A job that flash-saves every step has a save in every interval: leaving those
                        # intervals out, as before, kept its window empty and its bound at the fallback.
                        if not progress.interrupted and progress.saving_since is None:
                            working = now - progress.advanced_at - progress.saved_s
                            progress.durations.append(max(working, 0.0) / (step - progress.step))
                    progress.step, progress.advanced_at = step, now
                    progress.interrupted, progress.saving_since, progress.saved_s = False, None, 0.0
                    if progress.first_step_at is None:
                        progress.first_step_at = now
                    if compute is not None and compute >= 0:
                        progress.compute_times.append(compute)
            elif kind is ProgressKind.LIFE:
                progress.alive_at = now
            elif kind is ProgressKind.SAVE:
                progress.saving_since = now
            elif kind is ProgressKind.SAVED:
                _end_save(progress, now)
            elif kind is ProgressKind.CKPT:
                _end_save(progress, now)  # elastic.save's report ends its save
                if progress.ckpt_step is None or step > progress.ckpt_step:
                    progress.ckpt_step = step
            elif kind is ProgressKind.DONE:
                progress.done = True
        return True


def _end_save(progress: RankProgress, now: float) -> None:
    """A checkpoint save in progress ended at ``now``: its time is no step time."""
    if progress.saving_since is not None:
        progress.saved_s += max(now - progress.saving_since, 0.0)
        progress.saving_since, progress.resumed_at = None, now


# -- the checkpoint-save histogram: filled on the channel's thread, read when Prometheus scrapes -----------
@dataclass(frozen=True)
class HistogramSample:
    """A histogram read at one moment: ``buckets`` pairs each upper bound (the last ``+Inf``) with the
    number of observations at most that large (cumulative)."""

    buckets: tuple[tuple[str, int], ...]
    count: int
    total: float


class LatencyHistogram:
    """Observations of a latency in seconds, counted into fixed buckets."""

    def __init__(self, bounds: tuple[float, ...] = SAVE_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self._total += seconds

    def sample(self) -> HistogramSample:
        with self._lock:
            counts, total = list(self._counts), self._total
        cumulative, running = [], 0
        for bound, count in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return HistogramSample(tuple(cumulative), running, total)
