"""A worker forked by the warm-start zygote, seen from the agent, and the bookkeeping of its start.

The worker is the zygote's child, not the agent's: its exit is watched through a pidfd, and its return
code comes from the zygote (which reaps it) in an ``exit`` message (:mod:`agent.warm.zygote_ops`).
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import BinaryIO

from agent.warm.zygote_ops import Spawned, SpawnFailed


class Pending:
    """A spawn request waiting for the zygote's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Spawned | SpawnFailed | None = None  # None after done: the zygote went away
        self.fds: list[int] = []
        self.exit: ExitBox | None = None


class ExitBox:
    """A warm worker's return code, as the zygote (its parent) reports it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._returncode: int | None = None

    def set(self, returncode: int | None) -> None:
        if not self._done.is_set():
            self._returncode = returncode
            self._done.set()

    def wait(self) -> int | None:
        """The return code; None when the zygote died before reporting it."""
        self._done.wait()
        return self._returncode


class WarmProcess:
    """A forked worker seen from the agent: not our child, so its exit is watched through a pidfd."""

    def __init__(self, pid: int, pidfd: int, stdout: BinaryIO, stderr: BinaryIO, exit_box: ExitBox) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = pidfd
        self._pidfd_lock = threading.Lock()  # send_signal() never uses a closed (or reused) descriptor
        self._exit = exit_box
        self._returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        """Signal the worker through its pidfd: never another process that reuses the pid."""
        with self._pidfd_lock:
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, sig)

    def wait(self) -> int:
        if self._returncode is not None:
            return self._returncode
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        while not poller.poll():  # readable once the process has exited; retried on EINTR by Python
            pass
        returncode = self._exit.wait()
        with self._pidfd_lock:
            os.close(self._pidfd)
            self._pidfd = -1
        if returncode is None:
            # The zygote died before reporting; the worker died with it (PR_SET_PDEATHSIG=SIGKILL).
            returncode = -int(signal.SIGKILL)
        self._returncode = returncode
        return returncode
