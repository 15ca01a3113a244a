"""Ending a node's workers together with everything they started (the group's ``stop()``).

A worker leads its own process group, but its descendants may leave it (``setsid``, daemons): they are
found by parentage with psutil. The order is SIGTERM, SIGCONT (a stopped worker acts on SIGTERM only once
continued), a grace period, then SIGKILL to the groups and to every descendant, also those spawned
during the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from agent.workers.errors_file import message_from_stderr, read_error_file
from agent.workers.launchers import WorkerProcess
from agent.workers.output import RankLabel
from agent.workers.types import CRASH_SIGNALS, FailureInfo, WorkerExit

logger = logging.getLogger(__name__)

# After SIGKILL a process normally disappears at once; this only bounds pathological cases (D state).
REAP_TIMEOUT_S = 10.0
_DESCENDANT_POLL_S = 0.02


@dataclass
class RunningWorker:
    """Runtime state of one spawned worker."""

    local_rank: int
    global_rank: int
    proc: WorkerProcess
    error_file: Path
    stderr_tail: deque[str]
    readers: list[threading.Thread] = field(default_factory=list)
    watcher: threading.Thread | None = None
    returncode: int | None = None  # set by the watcher thread, under the group's lock
    label: RankLabel | None = None  # the prefix of its forwarded lines

    def rerank(self, global_rank: int) -> None:
        """The worker lives on in a round where it has ``global_rank`` (in-process recovery)."""
        self.global_rank = global_rank
        if self.label is not None:
            self.label.set(global_rank)

    @property
    def pgid(self) -> int:
        # Every launcher makes the worker the leader of a new session, so its group id is its own pid.
        return self.proc.pid


def end_workers(workers: list[RunningWorker], grace_s: float) -> None:
    """SIGTERM the workers' groups and descendants, wait up to ``grace_s``, SIGKILL what is left, and
    wait (bounded) until their watcher threads saw them exit."""
    deadline = time.monotonic() + max(grace_s, 0.0)
    descendants = _descendants(workers)
    for w in workers:
        _signal_group(w.pgid, signal.SIGTERM)
    _signal_procs(descendants, signal.SIGTERM)
    # A stopped worker (SIGSTOP, a hang verdict) acts on SIGTERM only once continued.
    for w in workers:
        _signal_group(w.pgid, signal.SIGCONT)
    _signal_procs(descendants, signal.SIGCONT)
    for w in workers:
        if w.watcher is not None:
            w.watcher.join(timeout=max(deadline - time.monotonic(), 0.0))
    alive = _wait_gone(descendants, deadline)

    # Grace is over: kill what is left, including children spawned during the grace period.
    late = _descendants(workers)
    for w in workers:
        _signal_group(w.pgid, signal.SIGKILL)
    _signal_procs(alive + late, signal.SIGKILL)
    for w in workers:
        if w.watcher is not None:
            w.watcher.join(timeout=REAP_TIMEOUT_S)
            if w.watcher.is_alive():
                logger.warning("worker pid %d did not exit after SIGKILL", w.proc.pid)
    _wait_gone(alive + late, time.monotonic() + REAP_TIMEOUT_S)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # ProcessLookupError: the group is empty, the worker and all its children are gone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(workers: list[RunningWorker]) -> list[psutil.Process]:
    """All live descendants of the workers still running (found by parentage, not process group)."""
    found: list[psutil.Process] = []
    for w in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.extend(psutil.Process(w.proc.pid).children(recursive=True))
    return found


def _wait_gone(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Wait until ``procs`` are dead or ``deadline`` passes; return those still alive.

    Descendants are not our children, so there is nothing to block on: poll. A zombie counts as gone (its
    new parent reaps it, or not, on its own schedule), which psutil.wait_procs would wait for in vain.
    """
    alive = [p for p in procs if _is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(min(_DESCENDANT_POLL_S, max(deadline - time.monotonic(), 0.0)))
        alive = [p for p in alive if _is_alive(p)]
    return alive


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_procs(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for p in procs:
        # psutil checks the process identity (pid + create time), so a recycled pid is never signalled.
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def failure_of(worker: RunningWorker, exit: WorkerExit, drain_timeout_s: float) -> FailureInfo:
    """Root cause of ``worker``'s exit ``exit`` (see ``WorkerGroup.failure_info``)."""
    # The exit can overtake the last lines of output; give the stderr reader a moment to drain.
    if len(worker.readers) > 1:
        worker.readers[1].join(timeout=drain_timeout_s)
    sig = exit.signal_name
    message = read_error_file(worker.error_file)
    if message is None and (sig is None or sig in CRASH_SIGNALS):
        message = message_from_stderr(list(worker.stderr_tail))
    generic = message is None
    if message is None:
        message = f"killed by {sig}" if sig else f"exited with code {exit.returncode}"
    return FailureInfo(
        local_rank=exit.local_rank,
        global_rank=worker.global_rank,
        exit_code=None if sig else exit.returncode,
        signal=sig,
        message=message,
        generic=generic,
    )
