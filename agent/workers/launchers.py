"""How a worker process comes to be: the :class:`Launcher` interface and :class:`ExecLauncher`, and when
the kernel recorded its creation (:func:`last_created_at`).

A launcher returns a :class:`WorkerProcess` that leads its own session (so the group can signal the
worker with its children), has PR_SET_PDEATHSIG=SIGKILL towards the agent, and writes stdout and stderr
to pipes the agent reads. :class:`agent.warm.starter.WarmLauncher` is the other implementation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Protocol, cast

from agent.workers.types import WorkerSpec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_START_TIME_FIELD = 19  # field 22 of /proc/PID/stat, counted after the ")" that ends the command name


class WorkerProcess(Protocol):
    """A started worker as a launcher hands it to the group (``subprocess.Popen`` is one)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

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

    def unavailable_reason(self, spec: WorkerSpec) -> str | None:
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
            preexec_fn=make_child_setup(os.getpid()),
            close_fds=True,
        )


def make_child_setup(parent_pid: int) -> Callable[[], None] | None:
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


def become_child_subreaper() -> bool:
    """Make this process (the agent) a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose
    parent exits is reparented to it rather than to init, so a worker's child that started its own session
    and lost its parent is still found, stopped with the worker and reaped (:mod:`agent.workers.tree`).
    False (with a log line) where the kernel refuses or there is no prctl."""
    prctl = _load_prctl()
    if prctl is None:
        return False
    if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning(
            "cannot become a child subreaper (%s): a worker's descendant that leaves its session and its "
            "parent is not stopped with the worker",
            os.strerror(ctypes.get_errno()),
        )
        return False
    return True


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


# When worker processes were created, as the kernel recorded it, on the agent's monotonic clock. The
# recovery phase ``restart`` ends when the last member's workers started (docs/observability.md). The moment
# the launch returns comes later than the workers' creation by the start's own bookkeeping (with warm
# starts: the zygote's answer with the pid and a pidfd), tens of milliseconds on a loaded host; the kernel's
# record (``/proc/PID/stat`` field 22, in clock ticks since boot, 10 ms on Linux) does not depend on it.
# Elsewhere than Linux, or once a worker is gone, there is no record: None.
def created_at(pid: int) -> float | None:
    """When process ``pid`` was created, in ``time.monotonic()`` seconds, or None (no record)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat.rsplit(b")", 1)[1].split()[_START_TIME_FIELD])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        # CLOCK_BOOTTIME counts from boot like the record; the age converts it to the monotonic clock.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.monotonic() - max(0.0, age)


def last_created_at(pids: Iterable[int]) -> float | None:
    """When the last of ``pids`` was created (monotonic seconds); None when one has no record."""
    times = [created_at(pid) for pid in pids]
    if not times or None in times:
        return None
    return max(t for t in times if t is not None)
