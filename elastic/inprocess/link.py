"""The worker's end of the in-process control channel (:mod:`elastic.inprocess.wire`).

A daemon thread reads the agent's messages. ``pause`` sets :attr:`AgentLink.pausing` at once (the
training loop leaves at its next commit) and, if the loop has not left within the leave grace, calls
``on_stuck`` (which releases the process group, so a collective blocked on a vanished peer raises). The
grace is what is left, since the last commit, of one and a half times the last step's duration (a healthy
world, e.g. one that a node joins, then finishes its step instead of wasting it), at most
:data:`MAX_LEAVE_GRACE_S` (a collective blocked on a vanished peer is released within a second), and at
least ``leave_grace_s``; a step already twice that late is blocked, and is released at once.
``resume`` hands the next round's environment to :meth:`AgentLink.wait_resume`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic import contract
from elastic.errors import WorkerError
from elastic.inprocess import wire

log = logging.getLogger(__name__)

#: The longest wait for the loop to reach its commit before the group is released.
MAX_LEAVE_GRACE_S = 0.8


class AgentGone(WorkerError, RuntimeError):
    """The agent closed the control connection (it is stopping this worker, or it died)."""


class AgentLink:
    """One worker's control connection to its agent."""

    def __init__(self, sock: socket.socket, leave_grace_s: float, on_stuck: Callable[[], None]) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._leave_grace_s = leave_grace_s
        self._on_stuck = on_stuck
        self._cond = threading.Condition()
        self._resume: dict[str, Any] | None = None
        self._closed = False
        self._left = threading.Event()  # the training loop left the step it was in
        self._last_commit: float | None = None
        self._step_s = 0.0  # the duration of the last step (between two commits)
        #: Set when the agent asked to leave the current step; cleared by :meth:`wait_resume`.
        self.pausing = threading.Event()
        self.pause_round: int | None = None
        threading.Thread(target=self._read, name="elastic-inprocess-link", daemon=True).start()

    @classmethod
    def connect(cls, leave_grace_s: float, on_stuck: Callable[[], None]) -> AgentLink | None:
        """Connect and say hello; None when no agent offers in-process recovery (plain torchrun)."""
        path = os.environ.get(contract.INPROCESS_SOCKET)
        if not path:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            log.warning(
                "cannot reach the agent's in-process socket %s (%s): recovery restarts this process",
                path,
                exc,
            )
            return None
        link = cls(sock, leave_grace_s, on_stuck)
        local_rank = int(
            os.environ.get(contract.ELASTIC_LOCAL_RANK) or os.environ.get(contract.LOCAL_RANK, "0")
        )
        link.send(wire.HELLO, local_rank=local_rank, pid=os.getpid())
        return link

    def send(self, op: str, **fields: Any) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(wire.encode(op, **fields))

    def committed(self) -> None:
        """A step was committed now: its duration sizes the leave grace."""
        now = time.monotonic()
        if self._last_commit is not None:
            self._step_s = now - self._last_commit
        self._last_commit = now

    def leave_grace_s(self, now: float | None = None) -> float:
        """How long a pause at ``now`` waits for the loop to reach its commit: what is left, since the last
        commit, of one and a half times the last step's duration (at most :data:`MAX_LEAVE_GRACE_S`), and
        at least the configured grace; nothing when the step has run twice that long already. Such a step
        is blocked (a stopped or cut-off peer: the pause that follows a hang verdict comes seconds into
        it), so its group is released at once instead of a step and a half later."""
        allowed = max(self._leave_grace_s, min(MAX_LEAVE_GRACE_S, 1.5 * self._step_s))
        if self._last_commit is None:
            return allowed
        elapsed = (time.monotonic() if now is None else now) - self._last_commit
        if elapsed >= 2.0 * allowed:
            return 0.0
        return max(self._leave_grace_s, allowed - elapsed)

    def left_step(self) -> None:
        """The training loop left its step (a commit saw the pause, or a collective raised)."""
        self._left.set()

    def wait_resume(self, timeout_s: float | None) -> dict[str, Any]:
        """The next round's ``resume`` message; :class:`AgentGone` if the agent closed the connection,
        :class:`TimeoutError` after ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._resume is not None or self._closed, timeout_s):
                raise TimeoutError(f"no new round from the agent within {timeout_s}s")
            if self._resume is None:
                raise AgentGone("the agent closed the in-process connection")
            resume, self._resume = self._resume, None
            # A pause of a later round may have come right behind this resume (a round that opened while
            # this one formed): it stands, and the group of this round is not formed at all.
            pause_round, resume_round = self.pause_round, resume.get("round")
            if pause_round is None or not isinstance(resume_round, int) or pause_round <= resume_round:
                self.pausing.clear()
                self._left.clear()
            self._last_commit = None  # the first step of the next world includes its forming
            return resume

    def wait_pause(self, timeout_s: float | None) -> bool:
        """Wait for the agent's ``pause`` (after this worker reported a broken collective)."""
        return self.pausing.wait(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # ends the reader thread's receive too
        with contextlib.suppress(OSError):
            self._sock.close()

    def _read(self) -> None:
        for message in wire.LineReader(self._sock, wire.AGENT_OPS).messages(log):
            self._handle(message)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.pausing.set()  # whatever the loop waits for, it is not coming

    def _handle(self, message: dict[str, Any]) -> None:
        if message["op"] == wire.PAUSE:
            self.pause_round = message.get("round")
            if not self.pausing.is_set():
                self.pausing.set()
                threading.Thread(
                    target=self._release_if_stuck, name="elastic-inprocess-leave", daemon=True
                ).start()
        elif message["op"] == wire.RESUME:
            with self._cond:
                self._resume = message
                self._cond.notify_all()
        elif message["op"] == wire.ERROR:  # the agent closes the connection next
            log.warning("the agent refused a message of this worker: %r", message["error"])

    def _release_if_stuck(self) -> None:
        grace = self.leave_grace_s()
        if not self._left.wait(grace):
            log.info("still in its step %.2fs after the pause: releasing the process group", grace)
            self._on_stuck()
