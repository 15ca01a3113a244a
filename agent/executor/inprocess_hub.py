"""The agent's end of in-process recovery (:mod:`elastic.inprocess.wire`): which live workers can keep
their processes across rounds, and the pause/resume exchange with them.

A Unix stream socket in the agent's private folder. Each worker run by :func:`elastic.inprocess.run`
connects and says ``hello``; the agent then keeps it alive at the next round instead of stopping it, when
*every* live worker of the node did so (a script that does not use the API keeps the process-restart
path). A worker's ``broken`` report (its collective failed) is passed to ``on_broken`` for the agent to
report. Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.inprocess import wire

log = logging.getLogger(__name__)

SOCKET_NAME = "inprocess.sock"


def _hang_up(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer sees it at once: a plain close() does not end a receive that
    another thread of this process is blocked in, so the connection would stay up."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class _Worker:
    local_rank: int
    pid: int
    conn: socket.socket
    paused_step: int | None = None  # set by its ``paused`` report, cleared by a resume
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, op: str, **fields: Any) -> bool:
        with self.lock:
            try:
                self.conn.sendall(wire.encode(op, **fields))
            except OSError:
                return False
        return True


class InProcessHub:
    """Serves the workers' control connections; see the module docstring."""

    def __init__(self, folder: str | Path, on_broken: Callable[[int, int, str], None] | None = None) -> None:
        self.path = str(Path(folder) / SOCKET_NAME)
        self._on_broken = on_broken
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        os.chmod(self.path, 0o600)
        self._server.listen(64)
        self._cond = threading.Condition()
        self._workers: dict[int, _Worker] = {}  # by pid
        self._closed = False
        #: Why in-process recovery failed (a worker could not re-form its group): the next round restarts
        #: processes instead. Cleared by :meth:`take_fallback`.
        self._fallback: str | None = None
        threading.Thread(target=self._accept, name="inprocess-hub", daemon=True).start()

    # -- what the agent asks ---------------------------------------------------------------------------
    def covers(self, pids: list[int]) -> bool:
        """Every one of ``pids`` (a node's live workers; at least one) runs the in-process API."""
        with self._cond:
            return bool(pids) and all(pid in self._workers for pid in pids)

    def send_pause(self, pids: list[int], round_number: int) -> None:
        """Ask ``pids`` to leave their step: a new round is forming."""
        with self._cond:
            workers = [self._workers[pid] for pid in pids if pid in self._workers]
        for w in workers:
            w.send(wire.PAUSE, round=round_number)

    def wait_paused(self, pids: list[int], timeout_s: float, alive: Callable[[int], bool]) -> str | None:
        """Wait until each of ``pids`` paused or exited (``alive`` says which still run). None when they
        all did within ``timeout_s``, else why not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                waiting = [
                    self._workers[pid]
                    for pid in pids
                    if pid in self._workers and self._workers[pid].paused_step is None and alive(pid)
                ]
                if not waiting:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    ranks = ", ".join(str(w.local_rank) for w in waiting)
                    return f"local ranks {ranks} did not leave their step within {timeout_s:g}s"
                self._cond.wait(min(left, 0.05))  # also notices exits, which send nothing

    def take_fallback(self) -> str | None:
        """Why the last in-process recovery failed, once (None: it did not)."""
        with self._cond:
            reason, self._fallback = self._fallback, None
        return reason

    def paused_pids(self) -> list[int]:
        """Workers that paused and were not resumed since."""
        with self._cond:
            return [pid for pid, w in self._workers.items() if w.paused_step is not None]

    def resume(self, pid: int, round_number: int, env: dict[str, str]) -> bool:
        """Send the next round's environment to a paused worker; False if it is gone."""
        with self._cond:
            worker = self._workers.get(pid)
            if worker is None:
                return False
            worker.paused_step = None
        return worker.send(wire.RESUME, round=round_number, env=env)

    def forget(self, pids: list[int]) -> None:
        """Drop the connections of workers that were stopped (their process is gone or going)."""
        with self._cond:
            gone = [self._workers.pop(pid) for pid in pids if pid in self._workers]
        for w in gone:
            _hang_up(w.conn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            _hang_up(w.conn)
        _hang_up(self._server)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # -- threads ---------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="inprocess-worker", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        worker: _Worker | None = None
        for message in wire.LineReader(conn, wire.WORKER_OPS).messages(log):
            worker = self._handle(conn, worker, message)
        with contextlib.suppress(OSError):
            conn.close()
        if worker is not None:
            with self._cond:
                if self._workers.get(worker.pid) is worker:
                    del self._workers[worker.pid]
                self._cond.notify_all()

    def _handle(self, conn: socket.socket, worker: _Worker | None, message: dict[str, Any]) -> _Worker | None:
        op = message["op"]
        if op == wire.HELLO:
            worker = _Worker(int(message["local_rank"]), int(message["pid"]), conn)
            with self._cond:
                if self._closed:
                    return None
                self._workers[worker.pid] = worker
            log.debug("local rank %d (pid %d) recovers in process", worker.local_rank, worker.pid)
            return worker
        if worker is None:
            log.warning("in-process channel: %s before hello; ignored", op)
            return None
        if op == wire.PAUSED:
            with self._cond:
                worker.paused_step = int(message.get("step") or 0)
                self._cond.notify_all()
        elif op == wire.FAILED:
            with self._cond:
                self._fallback = (
                    f"local rank {worker.local_rank} could not re-form its group: {message.get('error')}"
                )
        elif op == wire.BROKEN and self._on_broken is not None:
            self._on_broken(worker.local_rank, worker.pid, str(message.get("error", "")))
        return worker
