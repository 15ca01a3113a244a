"""Orphan protection: a sentinel process that kills the agent's worker process groups if the agent dies.

``PR_SET_PDEATHSIG`` (set on every worker by :mod:`agent.workers.group`) only reaches the worker itself. Its
own children — DataLoader workers, a shell's background jobs — would outlive a SIGKILLed agent. The reaper
closes that gap: it is a tiny stdlib-only process connected to the agent by a pipe. The agent registers each
worker's process group on spawn and unregisters it after stopping the group; when the pipe reaches EOF (the
agent exited in any way, including SIGKILL) the reaper SIGKILLs every group still registered and exits.

A group is registered with its leader's start time: a worker reaped while the agent ran, whose PID another
process took since, is not killed as a group (the newcomer's group, if it leads one, is not the worker's).

Limits: a descendant that leaves its worker's process group (``setsid``) is not covered; a worker killed in
the microseconds between its fork and its registration relies on PDEATHSIG alone.
"""

import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

from agent.workers._reaper_proc import start_ticks
from elastic import errors

logger = logging.getLogger(__name__)

_SENTINEL_SOURCE = Path(__file__).with_name("_reaper_proc.py")


class ReaperError(errors.WorkerError, RuntimeError):
    """The reaper sentinel could not be started."""


class Reaper:
    """Owns the sentinel process; one per agent, shared by its worker groups.

    The sentinel is started by the constructor. It runs in its own session without PDEATHSIG, so neither a
    terminal SIGINT to the agent's process group nor the agent's own death ends it before it did its work.
    Thread-safe.
    """

    def __init__(self, python: str = sys.executable) -> None:
        """Start the sentinel with interpreter ``python`` (``-I -S``: no site, no env, fast start)."""
        try:
            source = _SENTINEL_SOURCE.read_text(encoding="utf-8")
            self._proc = subprocess.Popen(
                [python, "-I", "-S", "-c", source],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                bufsize=0,
                cwd="/",
                start_new_session=True,
            )
        except OSError as e:
            raise ReaperError(f"cannot start the reaper process: {e}") from e
        self._lock = threading.Lock()
        self._closed = False
        self._broken = False  # the pipe broke: the sentinel died on its own

    @property
    def pid(self) -> int:
        """PID of the sentinel process."""
        return self._proc.pid

    def register(self, pgid: int) -> None:
        """Ask the sentinel to SIGKILL process group ``pgid`` if the agent goes away, unless its leader's
        PID (``pgid``, a live worker now) belongs to another process by then."""
        ticks = start_ticks(pgid)
        self._send(f"+{pgid}:{ticks}\n" if ticks is not None else f"+{pgid}\n")

    def remove_on_exit(self, folder: str | os.PathLike[str]) -> None:
        """Ask the sentinel to remove the agent's temp ``folder`` when the agent is gone (also after a
        SIGKILL); an absolute ASCII path without newlines (tempfile's), else it is left to the agent."""
        path = os.fspath(folder)
        if os.path.isabs(path) and path.isascii() and "\n" not in path:
            self._send(f"={path}\n")

    def unregister(self, pgid: int) -> None:
        """Forget ``pgid``: the agent has stopped that group itself."""
        self._send(f"-{pgid}\n")

    def close(self, timeout: float = 5.0) -> None:
        """End the sentinel cleanly (idempotent).

        Closing the pipe is the same signal as the agent dying, so any group still registered is killed.
        Normally none is: worker groups unregister themselves in ``stop()``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._proc.stdin is not None and not self._broken:
                # BrokenPipeError: the sentinel is already gone; nothing was left to flush.
                with contextlib.suppress(BrokenPipeError):
                    self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("reaper pid %d did not exit within %.1fs; killing it", self._proc.pid, timeout)
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> "Reaper":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._closed or self._broken or self._proc.stdin is None:
                logger.warning("reaper is not running; not sending %r", line.strip())
                return
            try:
                # One small write is atomic on a pipe (< PIPE_BUF), and the pipe is unbuffered (bufsize=0).
                self._proc.stdin.write(line.encode("ascii"))
            except BrokenPipeError:
                # Losing the sentinel must not take training down; the workers just lose orphan protection.
                logger.warning(
                    "reaper pid %d is gone; worker groups are no longer protected from orphaning",
                    self._proc.pid,
                )
                self._broken = True
