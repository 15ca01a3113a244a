"""Ending a node's workers together with everything they started (the group's ``stop()``).

A worker leads its own process group, but its descendants may leave it (``setsid``, daemons): they are
found by parentage with psutil. One that also lost its parent (a double fork) is reparented to the agent,
which is a child subreaper (:func:`agent.workers.launchers.become_child_subreaper`); it is found among the
agent's children by the worker environment it inherited (its error-file variable points into the group's
error folder). The order is SIGTERM, SIGCONT (a stopped worker acts on SIGTERM only once continued), a
grace period, then SIGKILL to the groups and to every descendant, also those spawned during the grace
period; the agent then reaps the descendants that became its children, so none is left a zombie.

Every process is signalled through a :class:`ProcessRef`: a pidfd where the kernel has them (Linux >= 5.3),
else the PID with its start time, checked right before the signal. So a PID that a reaped process left and
an unrelated process took since is never signalled; a worker's process group only while its leader's PID
is still the worker's or free (a group keeps its id's PID from reuse while it has a member).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
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
_HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


class ProcessRef:
    """One process the agent started or found among its workers' descendants, held so that a signal never
    reaches another process that took its PID since: a pidfd (opened while the process is known to be the
    one meant), else its start time, compared with the PID's current one before each signal.

    ``started``: the process's creation time as psutil reads it (``Process.create_time()``). Close it
    (:meth:`close`) when done; a closed reference signals nothing."""

    def __init__(self, pid: int, started: float, pidfd: int = -1) -> None:
        self.pid = pid
        self.started = started
        self._pidfd = pidfd
        self._lock = threading.Lock()  # close() never races a signal through the descriptor

    @classmethod
    def of(cls, proc: psutil.Process) -> ProcessRef | None:
        """A reference to the process psutil found (its PID and creation time); None when it is gone."""
        try:
            started = proc.create_time()
        except psutil.NoSuchProcess:
            return None
        pidfd = -1
        if _HAS_PIDFD:
            try:
                pidfd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                return None
            except OSError:  # no pidfds in this kernel (ENOSYS) or none allowed: the start-time check
                pidfd = -1
        ref = cls(proc.pid, started, pidfd)
        # The descriptor names whoever held the PID when it was opened: the process found, if the PID still
        # has its start time now (had it been reaped and the PID reused in between, the time would differ).
        if not ref._same_start():
            ref.close()
            return None
        return ref

    @classmethod
    def of_pid(cls, pid: int) -> ProcessRef | None:
        """A reference to the process that holds ``pid`` now (a child not yet reaped, for instance)."""
        try:
            return cls.of(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to this process; False (nothing sent) once it is reaped or closed, or when its PID
        now belongs to another process."""
        with self._lock:
            if self._pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except (ProcessLookupError, PermissionError):
                    return False
                return True
            if self._pidfd == -2 or not self._same_start():  # closed, or the PID changed hands
                return False
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                return False
            return True

    def holds_pid(self) -> bool:
        """Whether the PID is still this process's (running, or exited and not yet reaped)."""
        return self.signal(0)

    def alive(self) -> bool:
        """Whether the process still runs (a zombie does not)."""
        if not self.holds_pid():
            return False
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.started and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def reap(self) -> bool:
        """Collect the exit of this process if it is the agent's child (a descendant reparented to the
        subreaper agent) and has exited; True when it was reaped. Never another child's exit: the wait
        goes through the pidfd, or through the PID only while its start time is this process's."""
        with self._lock:
            try:
                if self._pidfd >= 0:
                    return os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG) is not None
                if self._pidfd == -2 or not self._same_start():
                    return False
                return os.waitpid(self.pid, os.WNOHANG)[0] == self.pid
            except ChildProcessError:  # not the agent's child: its parent reaps it
                return False

    def close(self) -> None:
        """Release the pidfd; idempotent."""
        with self._lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
            self._pidfd = -2

    def _same_start(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.NoSuchProcess:
            return False


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
    #: The worker as the stop path signals it (None: it was gone before the launch returned).
    ref: ProcessRef | None = None

    def rerank(self, global_rank: int) -> None:
        """The worker lives on in a round where it has ``global_rank`` (in-process recovery)."""
        self.global_rank = global_rank
        if self.label is not None:
            self.label.set(global_rank)

    @property
    def pgid(self) -> int:
        # Every launcher makes the worker the leader of a new session, so its group id is its own pid.
        return self.proc.pid


def end_workers(
    workers: list[RunningWorker],
    grace_s: float,
    markers: Sequence[tuple[str, str]] = (),
) -> None:
    """SIGTERM the workers' groups and descendants, wait up to ``grace_s``, SIGKILL what is left, wait
    (bounded) until their watcher threads saw them exit, and reap the descendants that became the agent's
    children. ``markers``: ``(variable, prefix)`` pairs of the initial environment (``/proc/PID/environ``)
    that tell the agent's children that descend from these workers (reparented to the subreaper agent)."""
    deadline = time.monotonic() + max(grace_s, 0.0)
    descendants = _descendants(workers, markers)
    for w in workers:
        _signal_group(w, signal.SIGTERM)
    _signal_refs(descendants, signal.SIGTERM)
    # A stopped worker (SIGSTOP, a hang verdict) acts on SIGTERM only once continued.
    for w in workers:
        _signal_group(w, signal.SIGCONT)
    _signal_refs(descendants, signal.SIGCONT)
    for w in workers:
        if w.watcher is not None:
            w.watcher.join(timeout=max(deadline - time.monotonic(), 0.0))
    _wait_gone(descendants, deadline)

    # Grace is over: kill what is left, including children spawned during the grace period.
    late = _descendants(workers, markers, known=descendants)
    for w in workers:
        _signal_group(w, signal.SIGKILL)
    everyone = descendants + late
    _signal_refs(everyone, signal.SIGKILL)
    for w in workers:
        if w.watcher is not None:
            w.watcher.join(timeout=REAP_TIMEOUT_S)
            if w.watcher.is_alive():
                logger.warning("worker pid %d did not exit after SIGKILL", w.proc.pid)
    left = _wait_gone(everyone, time.monotonic() + REAP_TIMEOUT_S)
    _reap(everyone, workers, time.monotonic() + REAP_TIMEOUT_S)
    if left:
        logger.warning(
            "descendants of the workers did not exit after SIGKILL: pids %s", [r.pid for r in left]
        )
    for ref in everyone:
        ref.close()


def _signal_group(worker: RunningWorker, sig: signal.Signals) -> None:
    """Signal the worker's process group, unless its id's PID now belongs to another process."""
    ref = worker.ref
    if ref is not None and not ref.holds_pid() and psutil.pid_exists(worker.pgid):
        # The worker is reaped and its PID taken since: the group of that id is the new process's (an
        # empty group frees its id; one with members keeps the PID from reuse).
        return
    # ProcessLookupError: the group is empty, the worker and all its children are gone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.pgid, sig)


def _descendants(
    workers: list[RunningWorker],
    markers: Sequence[tuple[str, str]],
    known: Sequence[ProcessRef] = (),
) -> list[ProcessRef]:
    """All live descendants of the workers (found by parentage, not process group), and the agent's
    children that carry one of ``markers`` (descendants of the workers reparented to the subreaper agent)
    with theirs; none of ``known`` (already found) and none of the workers themselves."""
    seen = {(r.pid, r.started) for r in known}
    worker_pids = {w.proc.pid for w in workers}
    found: list[psutil.Process] = []
    for w in workers:
        if w.ref is None or not w.ref.holds_pid():
            continue  # reaped: its PID may be another process's, whose children are not ours
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(w.proc.pid)
            if proc.create_time() == w.ref.started:  # still the worker (not reaped since the check)
                found.extend(proc.children(recursive=True))
    if markers:
        found.extend(_marked_children(markers, worker_pids))
    refs: list[ProcessRef] = []
    for proc in found:
        if proc.pid in worker_pids:
            continue
        ref = ProcessRef.of(proc)
        if ref is None or (ref.pid, ref.started) in seen:
            if ref is not None:
                ref.close()
            continue
        seen.add((ref.pid, ref.started))
        refs.append(ref)
    return refs


def _marked_children(
    markers: Sequence[tuple[str, str]], skip: set[int] | frozenset[int]
) -> list[psutil.Process]:
    """The agent's children (other than ``skip``) whose environment has one of ``markers`` (a variable
    whose value starts with a prefix), with all their descendants. A process whose environment cannot be
    read is left alone."""
    found: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid in skip:
                continue
            try:
                env = child.environ()
                if not any(
                    (value := env.get(name)) is not None and value.startswith(prefix)
                    for name, prefix in markers
                ):
                    continue
                found.append(child)
                found.extend(child.children(recursive=True))
            except (psutil.Error, OSError):
                continue  # gone, a zombie, or not readable: not known to be a worker's
    return found


def _wait_gone(refs: list[ProcessRef], deadline: float) -> list[ProcessRef]:
    """Wait until ``refs`` are dead or ``deadline`` passes; return those still alive.

    Descendants are not (all) our children, so there is nothing to block on: poll. A zombie counts as gone
    (:func:`_reap` collects the agent's own).
    """
    alive = [r for r in refs if r.alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(min(_DESCENDANT_POLL_S, max(deadline - time.monotonic(), 0.0)))
        alive = [r for r in alive if r.alive()]
    return alive


def _reap(refs: list[ProcessRef], workers: list[RunningWorker], deadline: float) -> None:
    """Reap those of ``refs`` that are (or become, when their parent dies) the agent's exited children,
    until each is reaped by the agent or by its own parent, or ``deadline`` passes. One whose parent is
    neither the agent nor one of these processes is its parent's to reap (init's, after a double fork
    where the agent is no subreaper): not waited for."""
    family = {os.getpid()} | {r.pid for r in refs} | {w.proc.pid for w in workers}
    pending = [r for r in refs if not r.alive()]
    while pending:
        pending = [r for r in pending if not r.reap() and r.holds_pid() and _parent(r) in family]
        if not pending or time.monotonic() >= deadline:
            return
        # A zombie whose parent is still being reaped: reparented to the agent within moments.
        time.sleep(_DESCENDANT_POLL_S)


def _parent(ref: ProcessRef) -> int | None:
    try:
        return psutil.Process(ref.pid).ppid()
    except psutil.NoSuchProcess:
        return None


def _signal_refs(refs: list[ProcessRef], sig: signal.Signals) -> None:
    for ref in refs:
        ref.signal(sig)  # nothing reaches a process that took a reaped one's PID


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
