"""The local worker group: spawn, supervise and stop the training processes of one node.

Lifecycle: ``start(spec, on_exit)`` spawns one process per local rank (its error file, log files, the
launch, the threads forwarding its output); ``on_exit`` gets each exit as it happens (a thread per child
blocks in ``wait()``, so exits are seen at once); ``stop()`` ends every worker and everything it started;
``start()`` may then be called again for the next rendezvous round; ``close()`` releases the group for
good.

Every worker leads its own process group (and session), so ``stop()`` can signal the worker together with
its children. Orphans are prevented in three layers:

1. ``stop()``: SIGTERM (then SIGCONT, so that stopped ones act on it) to each group and to every psutil
   descendant, also one that started its own session and lost its parent (the agent is a child subreaper,
   so it inherits such a process), a grace period, then SIGKILL;
2. ``PR_SET_PDEATHSIG=SIGKILL`` in each worker: the kernel kills the worker when the agent dies;
3. the :class:`~agent.workers.reaper.Reaper` sentinel: kills the workers' whole process groups when the agent
dies.

How a worker process comes to be is a :class:`Launcher`'s job: :class:`ExecLauncher` (fork + exec with
``subprocess``, always available) or :class:`agent.warm.starter.WarmLauncher` (forked from a zygote that has
already imported torch). With a warm launcher the group still falls back to exec, with one log line saying
why, whenever the warm path cannot take a start.

This module and its helpers import only the standard library and psutil — never torch — so the agent
starts fast. Linux only (prctl).
"""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

from agent.workers.errors_file import error_file_path, prepare_error_file
from agent.workers.filtered_log import FilteredLog, open_filtered_logs
from agent.workers.launchers import ExecLauncher, Launcher, WorkerProcess
from agent.workers.output import STDERR_TAIL_LINES, RankLabel, start_forwarder
from agent.workers.reaper import Reaper
from agent.workers.tree import ProcessRef, RunningWorker, end_workers, failure_of
from agent.workers.types import (
    CRASH_SIGNALS,
    FailureInfo,
    LauncherUnavailable,
    WorkerExit,
    WorkerGroupError,
    WorkerSpec,
    signal_name,
)
from elastic.contract import ERROR_FILE

# the group's types live in agent.workers.types and agent.workers.launchers; importable from here too
__all__ = [
    "CRASH_SIGNALS",
    "ERROR_FILE_ENV",
    "ExecLauncher",
    "FailureInfo",
    "Launcher",
    "LauncherUnavailable",
    "Reaper",
    "WorkerExit",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerProcess",
    "WorkerSpec",
    "signal_name",
]

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = ERROR_FILE
# Output still in flight after a worker exited; bounded because a descendant may still hold the pipe open
# (a DataLoader worker outlives its crashed parent for a few seconds).
_OUTPUT_DRAIN_TIMEOUT_S = 2.0
# The same wait on the failure path, where it delays the failure report: the lines a dead worker wrote are
# already in the pipe and read within milliseconds, only the EOF may come late.
_FAILURE_DRAIN_TIMEOUT_S = 0.5


class WorkerGroup:
    """Spawns, supervises and stops the workers of one node.

    Meant to be driven by one thread (the agent loop); ``stop()`` may also be called from another thread
    (a signal handler's). ``start()`` must run on a long-lived thread, see there.
    """

    def __init__(
        self, reaper: Reaper | None = None, error_dir: Path | None = None, launcher: Launcher | None = None
    ) -> None:
        """Create an idle group.

        ``reaper``: the agent's sentinel; each worker's process group is registered with it (not owned:
        the caller closes it). ``error_dir``: root of the workers' error files; by default a temporary
        folder that ``close()`` removes. ``launcher``: how workers are started, by default
        :class:`ExecLauncher`; another one (a :class:`~agent.warm.starter.WarmLauncher`) is used whenever it
        can take a start, exec otherwise. Not owned either: the caller closes it after the group.
        """
        self._reaper = reaper
        self._exec = ExecLauncher()
        self._launcher = launcher or self._exec
        self._launched_by: str | None = None
        self._owns_error_dir = error_dir is None
        if error_dir is None:
            error_dir = Path(tempfile.mkdtemp(prefix="elastic-run-errors-"))
            if reaper is not None:
                reaper.remove_on_exit(error_dir)
        self._error_dir = error_dir
        self._lock = threading.Lock()  # guards the fields below, held briefly
        # Serializes start/stop/close, so that a stop() from a signal-handling thread and one from the loop
        # do not signal the same process groups concurrently.
        self._lifecycle = threading.RLock()
        self._workers: list[RunningWorker] = []
        self._stopping = False  # set by stop(): exits it causes are not reported
        self._stopped = True
        self._closed = False
        self._on_exit: Callable[[WorkerExit], None] | None = None
        self._filtered: dict[str, FilteredLog] = {}  # this attempt's filtered logs, closed by _stop()

    @property
    def error_dir(self) -> Path:
        """Root folder of the workers' error files."""
        return self._error_dir

    @property
    def launched_by(self) -> str | None:
        """Name of the launcher that started the last ``start()``'s workers ("exec", "warm", "warm+exec")."""
        with self._lock:
            return self._launched_by

    @property
    def pids(self) -> list[int]:
        """PIDs of the workers of the last ``start()``, by local rank."""
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def launcher_warm_up_left_s(self) -> float:
        """Seconds worth waiting before ``start()`` so that it can use the (still warming) launcher rather
        than exec; 0 when there is nothing to wait for (see :meth:`Launcher.warm_up_left_s`)."""
        return self._launcher.warm_up_left_s()

    def wait_launcher(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the launcher's warm-up to end; True when it ended."""
        return self._launcher.wait_warm(timeout)

    def running(self) -> list[int]:
        """Local ranks whose process has not exited yet."""
        with self._lock:
            return [w.local_rank for w in self._workers if w.returncode is None]

    def exit_codes(self) -> list[int | None]:
        """Exit codes of the last ``start()``'s workers by local rank (None: still running)."""
        with self._lock:
            return [w.returncode for w in self._workers]

    def start(self, spec: WorkerSpec, on_exit: Callable[[WorkerExit], None] | None = None) -> None:
        """Spawn one worker per local rank of ``spec``.

        ``on_exit`` (optional) is called from a watcher thread for every worker exit, the moment it happens;
        exits caused by ``stop()`` are not reported.

        Must be called from a long-lived thread (the main thread, or the agent loop's own): the kernel's
        PR_SET_PDEATHSIG fires when the *thread* that forked the worker exits, not the process. Workers of
        an earlier ``start()`` that all exited are cleaned up first (their descendants stopped).

        Raises WorkerGroupError if workers are still running, the group is closed, or a spawn fails (the
        workers already spawned are then stopped).
        """
        with self._lifecycle:
            self._start(spec, on_exit)

    def _start(self, spec: WorkerSpec, on_exit: Callable[[WorkerExit], None] | None) -> None:
        if self._closed:
            raise WorkerGroupError("the worker group is closed")
        if self.running():
            raise WorkerGroupError(f"workers still running (local ranks {self.running()}); call stop() first")
        if not self._stopped:
            self._stop(grace_s=5.0)
        policy = spec.output
        try:
            self._filtered = open_filtered_logs(
                spec.log_dir, spec.attempt, policy.stdout_filters, policy.stderr_filters
            )
        except OSError as e:
            raise WorkerGroupError(f"cannot create the filtered logs under {spec.log_dir}: {e}") from e
        with self._lock:
            self._workers = []
            self._stopping = False
            self._stopped = False
            self._on_exit = on_exit
            self._launched_by = None
        launcher = self._usable_launcher(spec)
        used: list[str] = []
        for local_rank in range(spec.nprocs):
            launcher = self._spawn_watched(spec, local_rank, launcher)
            if launcher.name not in used:
                used.append(launcher.name)
            with self._lock:
                self._launched_by = "+".join(used)
        how = "+".join(used)
        logger.info("started %d workers (attempt %s, %s): pids %s", spec.nprocs, spec.attempt, how, self.pids)

    def keep_and_start(
        self, spec: WorkerSpec, on_exit: Callable[[WorkerExit], None] | None = None
    ) -> tuple[list[int], list[int]]:
        """In-process recovery: keep the live workers (the caller sends their new environment), spawn the
        local ranks whose process is gone; returns (kept, spawned). Exits go to this call's ``on_exit``."""
        with self._lifecycle:
            if self._closed:
                raise WorkerGroupError("the worker group is closed")
            with self._lock:
                old = {w.local_rank: w for w in self._workers}
                kept = [r for r in range(spec.nprocs) if r in old and old[r].returncode is None]
                self._workers = [old[r] for r in kept]
                for r, w in old.items():
                    if r not in kept and w.ref is not None:
                        w.ref.close()  # exited: no longer one of the group's workers
                for w in self._workers:
                    w.rerank(spec.global_ranks[w.local_rank])
                self._stopping = False
                self._stopped = False
                self._on_exit = on_exit
            spawned = [r for r in range(spec.nprocs) if r not in kept]
            launcher = self._usable_launcher(spec) if spawned else self._exec
            for local_rank in spawned:
                launcher = self._spawn_watched(spec, local_rank, launcher)
            logger.info("kept local ranks %s in process, started %s: pids %s", kept, spawned, self.pids)
            return kept, spawned

    def signal_workers(self, sig: int) -> list[int]:
        """Send ``sig`` to every worker process still running (not to its children: a DataLoader worker
        would die of a SIGUSR1 its parent handles); the pids signalled. Nothing while a stop is under way."""
        with self._lock:
            live = [] if self._stopping else [w for w in self._workers if w.returncode is None]
        sent = []
        for w in live:
            if w.ref is not None:  # never the process that took a reaped worker's PID
                if w.ref.signal(sig):
                    sent.append(w.proc.pid)
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                w.proc.send_signal(sig)
                sent.append(w.proc.pid)
        return sent

    def kill_worker(self, local_rank: int) -> int | None:
        """SIGKILL one running worker (not its children: its exit ends them, as for any worker exit); its
        pid, or None when it is not running. Safe under PID reuse, as :meth:`signal_workers`."""
        with self._lock:
            live = [] if self._stopping else [w for w in self._workers if w.returncode is None]
        for w in live:
            if w.local_rank != local_rank:
                continue
            if w.ref is not None:
                return w.proc.pid if w.ref.signal(signal.SIGKILL) else None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                w.proc.send_signal(signal.SIGKILL)
                return w.proc.pid
        return None

    def failure_info(self, exit: WorkerExit) -> FailureInfo:
        """Root cause of the worker exit ``exit``, which must come from this group's last ``start()``.

        The message is, in order of preference: the worker's error file (torch's ``@record``), the last
        exception line of its stderr (``RuntimeError: boom``), its last stderr line, or a generic line.
        A worker killed by a signal from outside (SIGKILL, SIGTERM...: not one of :data:`CRASH_SIGNALS`)
        gets the generic ``killed by SIGKILL``: whatever it printed before says nothing about the kill.
        """
        return failure_of(self._find(exit), exit, _FAILURE_DRAIN_TIMEOUT_S)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker and its descendants; idempotent, and a no-op when nothing runs.

        SIGTERM goes to each worker's process group and to every descendant found with psutil (also those
        that left the group, and those the subreaper agent inherited from them). After up to ``grace_s``
        seconds the groups and the surviving descendants get SIGKILL. Then all workers and the inherited
        descendants are reaped, unregistered from the reaper, and their output is drained. Only processes
        the group started or found are signalled, never one that took a reaped one's PID
        (:class:`~agent.workers.tree.ProcessRef`).
        The exits it causes are not reported to ``on_exit``.
        """
        with self._lifecycle:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopping = True
            workers = list(self._workers)
        # The workers' descendants that the subreaper agent inherited carry the error-file variable in
        # their initial environment (a warm worker writes its own over the zygote's: agent.warm).
        end_workers(workers, grace_s, [(ERROR_FILE, str(self._error_dir) + os.sep)])
        for w in workers:
            if w.ref is not None:
                w.ref.close()
        if self._reaper is not None:
            for w in workers:
                self._reaper.unregister(w.pgid)
        drain_deadline = time.monotonic() + _OUTPUT_DRAIN_TIMEOUT_S
        for w in workers:
            for reader in w.readers:
                reader.join(timeout=max(drain_deadline - time.monotonic(), 0.0))
                if reader.is_alive():
                    # Some process outside our reach still holds the pipe; the daemon thread stays behind.
                    logger.warning("output of worker pid %d is still open after stop", w.proc.pid)
        for filtered in self._filtered.values():
            filtered.close()
        with self._lock:
            self._stopped = True
        logger.info("stopped %d workers", len(workers))

    def close(self) -> None:
        """Stop the workers and remove the error folder if the group created it. Idempotent.

        The launcher and the reaper are the caller's to close, after the group.
        """
        with self._lifecycle:
            if self._closed:
                return
            self._stop(grace_s=5.0)
            self._closed = True
            if self._owns_error_dir:
                shutil.rmtree(self._error_dir, ignore_errors=True)

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _usable_launcher(self, spec: WorkerSpec) -> Launcher:
        launcher = self._launcher
        if launcher is not self._exec and (reason := launcher.unavailable_reason(spec)) is not None:
            logger.info("%s start not used: %s; starting workers with exec", launcher.name, reason)
            return self._exec
        return launcher

    def _spawn_watched(self, spec: WorkerSpec, local_rank: int, launcher: Launcher) -> Launcher:
        """Spawn local rank ``local_rank`` of ``spec`` (with exec when ``launcher`` cannot), add it to the
        current workers with its watcher thread; returns the launcher that started it. A failed spawn
        stops the workers already started and raises WorkerGroupError."""
        env, global_rank = spec.envs[local_rank], spec.global_ranks[local_rank]
        try:
            try:
                worker = self._spawn(spec, local_rank, global_rank, env, launcher)
            except LauncherUnavailable as e:
                logger.warning(
                    "%s start of local rank %d failed (%s); starting workers with exec",
                    launcher.name,
                    local_rank,
                    e,
                )
                launcher = self._exec
                worker = self._spawn(spec, local_rank, global_rank, env, launcher)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            self._stop(grace_s=0.0)
            raise WorkerGroupError(
                f"cannot start worker local rank {local_rank} ({spec.argv[0]}): {e}"
            ) from e
        with self._lock:
            self._workers.append(worker)
            self._workers.sort(key=lambda w: w.local_rank)
        worker.watcher = threading.Thread(
            target=self._watch, args=(worker,), name=f"worker-rank{global_rank}-wait", daemon=True
        )
        worker.watcher.start()
        return launcher

    def _spawn(
        self, spec: WorkerSpec, local_rank: int, global_rank: int, env: dict[str, str], launcher: Launcher
    ) -> RunningWorker:
        """Start local rank ``local_rank`` of ``spec`` with ``launcher``, registered with the reaper, its
        output forwarded (console, ``spec.log_dir``, the filtered logs); raises what the launcher raises."""
        error_file = error_file_path(self._error_dir, spec.attempt, global_rank)
        prepare_error_file(error_file)
        log_files = _open_logs(spec, global_rank)
        try:
            proc = launcher.launch(list(spec.argv), {**env, ERROR_FILE: str(error_file)}, spec.cwd)
        except BaseException:
            for log_file in log_files:
                if log_file is not None:
                    log_file.close()
            raise
        if self._reaper is not None:
            self._reaper.register(proc.pid)
        worker = RunningWorker(
            ref=ProcessRef.of_pid(proc.pid),  # not reaped before its watcher starts: still this worker
            local_rank=local_rank,
            global_rank=global_rank,
            proc=proc,
            error_file=error_file,
            stderr_tail=deque(maxlen=STDERR_TAIL_LINES),
        )
        # Both are pipes to the agent: every launcher guarantees it.
        stdout, stderr = cast(BinaryIO, proc.stdout), cast(BinaryIO, proc.stderr)
        logged = spec.log_dir is not None
        worker.label = RankLabel(global_rank)
        worker.readers = [
            start_forwarder(
                stdout,
                global_rank=global_rank,
                stream="stdout",
                log_file=log_files[0],
                console=spec.output.shows(local_rank, "stdout", logged),
                filtered=self._filtered.get("stdout"),
                label=worker.label,
            ),
            start_forwarder(
                stderr,
                global_rank=global_rank,
                stream="stderr",
                log_file=log_files[1],
                tail=worker.stderr_tail,
                console=spec.output.shows(local_rank, "stderr", logged),
                filtered=self._filtered.get("stderr"),
                label=worker.label,
            ),
        ]
        return worker

    def _watch(self, worker: RunningWorker) -> None:
        """Watcher thread: block in wait() and report the exit, unless stop() caused it or the worker no
        longer belongs to the current start (the callback is read at the exit: a worker kept by
        :meth:`keep_and_start` reports to the newest)."""
        returncode = worker.proc.wait()
        with self._lock:
            worker.returncode = returncode
            if self._stopping or not any(w is worker for w in self._workers):
                return
            event = WorkerExit(worker.local_rank, worker.global_rank, worker.proc.pid, returncode)
            callback = self._on_exit
        if callback is not None:
            callback(event)
        if returncode != 0:
            logger.info(
                "worker rank %d (pid %d) exited with %d", worker.global_rank, worker.proc.pid, returncode
            )

    def _find(self, exit: WorkerExit) -> RunningWorker:
        with self._lock:
            for w in self._workers:
                if w.proc.pid == exit.pid and w.local_rank == exit.local_rank:
                    return w
        raise ValueError(f"{exit} is not an exit of this group's current workers")


def _open_logs(spec: WorkerSpec, global_rank: int) -> tuple[BinaryIO | None, BinaryIO | None]:
    """The worker's ``--log-dir`` files (``<attempt>/rank<R>/{stdout,stderr}.log``), or none."""
    if spec.log_dir is None:
        return None, None
    folder = spec.log_dir / spec.attempt / f"rank{global_rank}"
    folder.mkdir(parents=True, exist_ok=True)
    stdout_log = open(folder / "stdout.log", "wb")  # noqa: SIM115 - the forwarder thread closes it
    try:
        stderr_log = open(folder / "stderr.log", "wb")  # noqa: SIM115 - the forwarder thread closes it
    except OSError:
        stdout_log.close()
        raise
    return stdout_log, stderr_log
