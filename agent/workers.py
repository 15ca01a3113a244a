"""The local worker group: spawn, supervise and stop the training processes of one node.

Lifecycle: ``start(spec)`` spawns one process per local rank; ``wait_exit()`` reports each exit as it
happens (a thread per child blocks in ``wait()`` and pushes to a queue, so exits are seen at once);
``stop()`` ends every worker and everything it started; ``start()`` may then be called again for the next
rendezvous round; ``close()`` releases the group for good.

Every worker leads its own process group (and session), so ``stop()`` can signal the worker together with
its children. Orphans are prevented in three layers:

1. ``stop()``: SIGTERM (then SIGCONT, so that stopped ones act on it) to each group and to every psutil
   descendant, a grace period, then SIGKILL;
2. ``PR_SET_PDEATHSIG=SIGKILL`` in each worker: the kernel kills the worker when the agent dies;
3. the :class:`~agent.reaper.Reaper` sentinel: kills the workers' whole process groups when the agent dies.

How a worker process comes to be is a :class:`Launcher`'s job: :class:`ExecLauncher` (fork + exec with
``subprocess``, always available) or :class:`agent.warm.WarmLauncher` (forked from a zygote that has already
imported torch). With a warm launcher the group still falls back to exec, with one log line saying why,
whenever the warm path cannot take a start.

This module and its helpers import only the standard library and psutil — never torch — so the agent
starts fast. Linux only (prctl).
"""

import contextlib
import ctypes
import functools
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol, cast

import psutil

from agent.errors_file import error_file_path, message_from_stderr, prepare_error_file, read_error_file
from agent.filtered_log import FilteredLog, open_filtered_logs
from agent.output import STDERR_TAIL_LINES, OutputPolicy, start_forwarder
from agent.reaper import Reaper

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_PR_SET_PDEATHSIG = 1
# After SIGKILL a process normally disappears at once; this only bounds pathological cases (D state).
_REAP_TIMEOUT_S = 10.0
# Output still in flight after a worker exited; bounded because a descendant may still hold the pipe open
# (a DataLoader worker outlives its crashed parent for a few seconds).
_OUTPUT_DRAIN_TIMEOUT_S = 2.0
# The same wait on the failure path, where it delays the failure report: the lines a dead worker wrote are
# already in the pipe and read within milliseconds, only the EOF may come late.
_FAILURE_DRAIN_TIMEOUT_S = 0.5
_DESCENDANT_POLL_S = 0.02


class WorkerGroupError(RuntimeError):
    """The worker group was used wrongly or could not spawn its workers."""


class LauncherUnavailable(Exception):
    """A launcher cannot start this worker now (before anything was started); the group uses exec instead."""


@dataclass(frozen=True)
class WorkerSpec:
    """What to run on this node: one process per local rank.

    ``argv`` and ``envs`` are complete: the group adds only ``TORCHELASTIC_ERROR_FILE`` to each environment
    and inherits nothing from the agent. ``global_ranks[i]`` is the global rank of local rank ``i`` and
    names its output prefix, log folder and error file. With ``log_dir`` set, each worker's raw output is
    also written to ``log_dir/<attempt>/rank<global rank>/{stdout,stderr}.log``. ``output`` says which
    streams reach the agent's console and which lines are copied to ``log_dir/<attempt>/filtered_*.log``.
    """

    argv: list[str]
    envs: list[dict[str, str]]
    global_ranks: list[int]
    log_dir: Path | None = None
    attempt: str = "0"
    cwd: str | None = None
    output: OutputPolicy = OutputPolicy()

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("WorkerSpec.argv is empty")
        if not self.envs:
            raise ValueError("WorkerSpec.envs is empty: need one environment per local rank")
        if len(self.envs) != len(self.global_ranks):
            raise ValueError(
                f"WorkerSpec has {len(self.envs)} envs but {len(self.global_ranks)} global_ranks"
            )
        if len(set(self.global_ranks)) != len(self.global_ranks):
            raise ValueError(f"WorkerSpec.global_ranks has duplicates: {self.global_ranks}")
        if not self.attempt or "/" in self.attempt or self.attempt in (".", ".."):
            raise ValueError(f"WorkerSpec.attempt must be a plain folder name, got {self.attempt!r}")

    @property
    def nprocs(self) -> int:
        """Number of local workers."""
        return len(self.envs)


@dataclass(frozen=True)
class WorkerExit:
    """One worker's exit. ``returncode`` is negative when a signal killed it (as in ``Popen``)."""

    local_rank: int
    global_rank: int
    pid: int
    returncode: int
    #: When the watcher thread saw the exit (time.monotonic): a failure's detection starts there.
    seen_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def succeeded(self) -> bool:
        """True when the worker exited with code 0."""
        return self.returncode == 0

    @property
    def signal_name(self) -> str | None:
        """Name of the signal that killed the worker (``"SIGKILL"``), or None if it exited by itself."""
        return signal_name(self.returncode)


#: Signals a worker raises itself when it crashes (a segfault, abort(), a bus error, a bad instruction...):
#: its last stderr lines (faulthandler's "Fatal Python error", C++'s "terminate called after ...") say why.
#: Any other signal came from outside (the OOM killer, an operator, a scheduler), and what the worker
#: printed before, such as a warning, is no root cause of it.
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP"})


@dataclass(frozen=True)
class FailureInfo:
    """Root cause of a failed worker, for the user-facing summary.

    Exactly one of ``exit_code`` (the worker exited) and ``signal`` (a signal killed it) is set.
    """

    local_rank: int
    global_rank: int
    exit_code: int | None
    signal: str | None
    message: str


def signal_name(returncode: int) -> str | None:
    """``"SIGKILL"`` for ``-9``; None for a non-negative return code."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


class WorkerProcess(Protocol):
    """A started worker as a launcher hands it to the group (``subprocess.Popen`` is one)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> BinaryIO | None: ...

    @property
    def stderr(self) -> BinaryIO | None: ...

    def wait(self) -> int:
        """Block until the process exited; its return code (negative: killed by that signal)."""
        ...

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process (not its children); nothing once it has been reaped."""
        ...


class Launcher:
    """Creates worker processes for a :class:`WorkerGroup`.

    ``launch`` must give the process exactly what the exec path gives: the environment ``env`` and nothing
    else, ``argv``, working directory ``cwd`` (None: the agent's), stdin from /dev/null, stdout and stderr
    as pipes to the agent, its own session (so its pid is its process group id), and death when the
    agent dies. The group registers the pid with the reaper and watches it through ``wait()``.
    """

    #: Short name for logs ("exec", "warm").
    name = "launcher"

    def unavailable_reason(self, spec: "WorkerSpec") -> str | None:
        """Why this launcher cannot start ``spec``'s workers now, or None when it can."""
        return None

    def warm_up_left_s(self) -> float:
        """Seconds worth waiting for this launcher to become ready before falling back to exec: 0 when it
        is ready, failed, or needs no warm-up."""
        return 0.0

    def wait_warm(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the warm-up to end (ready or failed); True when it ended."""
        return True

    def launch(self, argv: list[str], env: dict[str, str], cwd: str | None) -> WorkerProcess:
        """Start one worker. Raises OSError/ValueError/SubprocessError if the command cannot be started,
        LauncherUnavailable if this launcher (not the command) failed before anything was started."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the launcher's resources; idempotent."""


class ExecLauncher(Launcher):
    """Today's path: ``subprocess.Popen`` (fork + exec) with a new session and PR_SET_PDEATHSIG."""

    name = "exec"

    def launch(self, argv: list[str], env: dict[str, str], cwd: str | None) -> WorkerProcess:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: stop() and the reaper kill it as a whole
            preexec_fn=_make_child_setup(os.getpid()),
            close_fds=True,
        )


@dataclass
class _Worker:
    """Runtime state of one spawned worker."""

    local_rank: int
    global_rank: int
    proc: WorkerProcess
    error_file: Path
    stderr_tail: "deque[str]"
    readers: list[threading.Thread] = field(default_factory=list)
    watcher: threading.Thread | None = None
    returncode: int | None = None  # set by the watcher thread, under the group's lock

    @property
    def pgid(self) -> int:
        # Every launcher makes the worker the leader of a new session, so its group id is its own pid.
        return self.proc.pid


class WorkerGroup:
    """Spawns, supervises and stops the workers of one node.

    Meant to be driven by one thread (the agent loop); ``stop()`` may also be called from another thread,
    which wakes a blocked ``wait_exit()``. ``start()`` must run on a long-lived thread, see there.
    """

    def __init__(
        self, reaper: Reaper | None = None, error_dir: Path | None = None, launcher: Launcher | None = None
    ) -> None:
        """Create an idle group.

        ``reaper``: the agent's sentinel; each worker's process group is registered with it (not owned:
        the caller closes it). ``error_dir``: root of the workers' error files; by default a temporary
        folder that ``close()`` removes. ``launcher``: how workers are started, by default
        :class:`ExecLauncher`; another one (a :class:`~agent.warm.WarmLauncher`) is used whenever it can
        take a start, exec otherwise. Not owned either: the caller closes it after the group.
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
        self._workers: list[_Worker] = []
        self._events: queue.Queue[WorkerExit | None] = queue.Queue()
        self._pending = 0  # exits that will still be reported by wait_exit()
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

        ``on_exit`` (optional) is called from a watcher thread for every exit that ``wait_exit()`` would
        report, the moment it happens; with it the caller needs no thread blocked in ``wait_exit()``.

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
        events: queue.Queue[WorkerExit | None] = queue.Queue()
        with self._lock:
            self._workers = []
            self._events = events
            self._pending = 0
            self._stopping = False
            self._stopped = False
            self._on_exit = on_exit
            self._launched_by = None
        launcher = self._launcher
        if launcher is not self._exec:
            reason = launcher.unavailable_reason(spec)
            if reason is not None:
                logger.info("%s start not used: %s; starting workers with exec", launcher.name, reason)
                launcher = self._exec
        used: list[str] = []
        for local_rank, (env, global_rank) in enumerate(zip(spec.envs, spec.global_ranks, strict=True)):
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
            if launcher.name not in used:
                used.append(launcher.name)
            with self._lock:
                self._workers.append(worker)
                self._pending += 1
                self._launched_by = "+".join(used)
            worker.watcher = threading.Thread(
                target=self._watch, args=(worker, events), name=f"worker-rank{global_rank}-wait", daemon=True
            )
            worker.watcher.start()
        how = "+".join(used)
        logger.info("started %d workers (attempt %s, %s): pids %s", spec.nprocs, spec.attempt, how, self.pids)

    def wait_exit(self, timeout: float | None) -> WorkerExit | None:
        """Block until the next worker exits and return it; None on timeout.

        Returns None at once when no exit is left to report (nothing started, all reported, or stopped):
        exits caused by ``stop()`` are not reported. ``timeout=None`` waits without limit.
        """
        with self._lock:
            if self._pending <= 0:
                return None
            events = self._events
        try:
            event = events.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is not None:
            with self._lock:
                self._pending -= 1
        return event

    def signal_workers(self, sig: int) -> list[int]:
        """Send ``sig`` to every worker process still running (not to its children: a DataLoader worker
        would die of a SIGUSR1 its parent handles); the pids signalled. Nothing while a stop is under way."""
        with self._lock:
            live = [] if self._stopping else [w for w in self._workers if w.returncode is None]
        sent = []
        for w in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                w.proc.send_signal(sig)
                sent.append(w.proc.pid)
        return sent

    def failure_info(self, exit: WorkerExit) -> FailureInfo:
        """Root cause of the worker exit ``exit``, which must come from this group's last ``start()``.

        The message is, in order of preference: the worker's error file (torch's ``@record``), the last
        exception line of its stderr (``RuntimeError: boom``), its last stderr line, or a generic line.
        A worker killed by a signal from outside (SIGKILL, SIGTERM...: not one of :data:`CRASH_SIGNALS`)
        gets the generic ``killed by SIGKILL``: whatever it printed before says nothing about the kill.
        """
        worker = self._find(exit)
        # The exit can overtake the last lines of output; give the stderr reader a moment to drain.
        if len(worker.readers) > 1:
            worker.readers[1].join(timeout=_FAILURE_DRAIN_TIMEOUT_S)
        sig = exit.signal_name
        message = read_error_file(worker.error_file)
        if message is None and (sig is None or sig in CRASH_SIGNALS):
            message = message_from_stderr(list(worker.stderr_tail))
        if message is None:
            message = f"killed by {sig}" if sig else f"exited with code {exit.returncode}"
        return FailureInfo(
            local_rank=exit.local_rank,
            global_rank=exit.global_rank,
            exit_code=None if sig else exit.returncode,
            signal=sig,
            message=message,
        )

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker and its descendants; idempotent, and a no-op when nothing runs.

        SIGTERM goes to each worker's process group and to every descendant found with psutil (also those
        that left the group). After up to ``grace_s`` seconds the groups and the surviving descendants get
        SIGKILL. Then all workers are reaped, unregistered from the reaper, and their output is drained.
        Unreported exits are dropped.
        """
        with self._lifecycle:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopping = True
            self._pending = 0
            workers = list(self._workers)
            events = self._events
        events.put(None)  # wake a wait_exit() blocked in another thread
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
                w.watcher.join(timeout=_REAP_TIMEOUT_S)
                if w.watcher.is_alive():
                    logger.warning("worker pid %d did not exit after SIGKILL", w.proc.pid)
        _wait_gone(alive + late, time.monotonic() + _REAP_TIMEOUT_S)

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

    def _spawn(
        self,
        spec: WorkerSpec,
        local_rank: int,
        global_rank: int,
        env: dict[str, str],
        launcher: Launcher,
    ) -> _Worker:
        error_file = error_file_path(self._error_dir, spec.attempt, global_rank)
        prepare_error_file(error_file)
        log_files = _open_logs(spec, global_rank)
        try:
            proc = launcher.launch(list(spec.argv), {**env, ERROR_FILE_ENV: str(error_file)}, spec.cwd)
        except BaseException:
            for log_file in log_files:
                if log_file is not None:
                    log_file.close()
            raise
        if self._reaper is not None:
            self._reaper.register(proc.pid)
        worker = _Worker(
            local_rank=local_rank,
            global_rank=global_rank,
            proc=proc,
            error_file=error_file,
            stderr_tail=deque(maxlen=STDERR_TAIL_LINES),
        )
        # Both are pipes to the agent: every launcher guarantees it.
        stdout, stderr = cast(BinaryIO, proc.stdout), cast(BinaryIO, proc.stderr)
        logged = spec.log_dir is not None
        worker.readers = [
            start_forwarder(
                stdout,
                global_rank=global_rank,
                stream="stdout",
                log_file=log_files[0],
                console=spec.output.shows(local_rank, "stdout", logged),
                filtered=self._filtered.get("stdout"),
            ),
            start_forwarder(
                stderr,
                global_rank=global_rank,
                stream="stderr",
                log_file=log_files[1],
                tail=worker.stderr_tail,
                console=spec.output.shows(local_rank, "stderr", logged),
                filtered=self._filtered.get("stderr"),
            ),
        ]
        return worker

    def _watch(self, worker: _Worker, events: "queue.Queue[WorkerExit | None]") -> None:
        """Watcher thread: block in wait() and report the exit, unless stop() caused it."""
        returncode = worker.proc.wait()
        event = WorkerExit(worker.local_rank, worker.global_rank, worker.proc.pid, returncode)
        with self._lock:
            worker.returncode = returncode
            if self._stopping or events is not self._events:
                return
            events.put(event)
            callback = self._on_exit
        if callback is not None:
            callback(event)
        if returncode != 0:
            logger.info(
                "worker rank %d (pid %d) exited with %d", worker.global_rank, worker.proc.pid, returncode
            )

    def _find(self, exit: WorkerExit) -> _Worker:
        with self._lock:
            for w in self._workers:
                if w.proc.pid == exit.pid and w.local_rank == exit.local_rank:
                    return w
        raise ValueError(f"{exit} is not an exit of this group's current workers")


def _open_logs(spec: WorkerSpec, global_rank: int) -> tuple[BinaryIO | None, BinaryIO | None]:
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


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # ProcessLookupError: the group is empty, the worker and all its children are gone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(workers: list[_Worker]) -> list[psutil.Process]:
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


def _make_child_setup(parent_pid: int) -> Callable[[], None] | None:
    """The ``preexec_fn`` that makes a worker die with the agent (PR_SET_PDEATHSIG=SIGKILL).

    prctl is resolved here, in the parent, so the child runs no dynamic loading between fork and exec.
    """
    prctl = _load_prctl()
    if prctl is None:
        return None
    sigkill = int(signal.SIGKILL)

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        # The agent may have died between fork and prctl; PDEATHSIG would then never fire.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigkill)

    return setup


@functools.cache
def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError) as e:
        logger.warning("prctl unavailable (%s): workers will not die with the agent by themselves", e)
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return cast(Callable[..., int], prctl)
