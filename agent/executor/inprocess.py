"""The agent's end of in-process recovery (:mod:`elastic.inprocess.wire`): which live workers can keep
their processes across rounds, the pause/resume exchange with them, and the steps the executor
(agent.executor.loop) performs for the machine's in-process actions.

:class:`InProcessHub` is a Unix stream socket in the agent's private folder. Each worker run by
:func:`elastic.inprocess.run` connects and says ``hello``; the node's live workers can leave their step
(and be kept at the next round) only when *every* one of them did so (a script that does not use the API
keeps the process-restart path). A worker's ``broken`` report (its collective failed) is passed to
``on_broken`` for the agent to report; its ``failed`` report (its group could not re-form) is kept for the
next probe. A line that breaks the protocol (elastic.inprocess.wire.decode: malformed JSON, NaN, too deep,
a wrong field) is answered ``error`` and ends that worker's connection only (one log line, no traceback);
the worker then recovers by process restarts. :class:`InProcessSteps` probes, pauses, waits for the
pause, keeps paused workers at the next start and records a fallback; whether to pause, stop or fall back
is the machine's choice (agent.machine.decisions).
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

from agent.observe.events import EventLog
from agent.workers.group import FailureInfo, WorkerExit, WorkerGroup, WorkerSpec
from agent.workers.launchers import last_created_at
from elastic.control.protocol import Assignment
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

    def wait_paused(self, pids: list[int], timeout_s: float, alive: Callable[[int], bool]) -> list[int]:
        """Wait until each of ``pids`` paused or exited (``alive`` says which still run), at most
        ``timeout_s``. The local ranks still in their step then; empty when they all left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                waiting = [
                    self._workers[pid]
                    for pid in pids
                    if pid in self._workers and self._workers[pid].paused_step is None and alive(pid)
                ]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    return [w.local_rank for w in waiting]
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
        if op == wire.ERROR:  # the worker closes the connection next
            log.warning("in-process channel: a worker refused a message of this agent: %r", message["error"])
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


#: How long a broken collective's report waits for the exit of a local worker that explains it (a killed
#: peer on this node: its exit is seen milliseconds after the survivor's collective fails).
LOCAL_EXIT_WAIT_S = 0.1


@dataclass(frozen=True)
class _Pause:
    """A pause asked of the live workers; the agent joins the next round while they leave their step."""

    local_ranks: tuple[int, ...]
    pids: list[int]
    round: int
    began: float


class InProcessSteps:
    """The executor's in-process recovery steps: probe, pause, wait for the pause, keep, fall back."""

    def __init__(self, hub: InProcessHub, group: WorkerGroup, event_log: EventLog) -> None:
        self.hub = hub
        self.group = group
        self.event_log = event_log
        self._pause: _Pause | None = None

    def probe(self) -> tuple[tuple[int, ...], bool, str | None]:
        """The live workers (local ranks), whether they all run the in-process API (so they can leave
        their step), and why the last in-process recovery failed (once; None: it did not)."""
        running = tuple(self.group.running())
        pids = self.group.pids
        return running, self.hub.covers([pids[r] for r in running]), self.hub.take_fallback()

    def pause(self, local_ranks: tuple[int, ...], round_number: int) -> None:
        """Ask the workers ``local_ranks`` to leave their step of ``round_number``; they are kept."""
        pids = self.group.pids
        live = [pids[r] for r in local_ranks]
        self.hub.send_pause(live, round_number)
        self._pause = _Pause(local_ranks, live, round_number, time.monotonic())

    def await_paused(self, timeout_s: float) -> tuple[int, ...]:
        """Wait, at most ``timeout_s``, until the paused workers left their step or exited; the local
        ranks still in their step then (empty: all left)."""
        pause = self._pause
        if pause is None:
            return ()
        waiting = tuple(self.hub.wait_paused(pause.pids, timeout_s, self._alive))
        if not waiting:
            paused = [r for r, pid in zip(pause.local_ranks, pause.pids, strict=True) if self._alive(pid)]
            log.info("paused local ranks %s in process (%.3fs)", paused, time.monotonic() - pause.began)
            self.event_log.record("workers_paused", round=pause.round, local_ranks=paused)
        return waiting

    def fall_back(self, round_number: int, why: str, stacks: list[str] | None = None) -> None:
        """In-process recovery failed: say why (and where the stuck workers' Python stacks are); the workers
        are stopped next (their processes restart)."""
        where = f"; Python stacks in {', '.join(stacks)}" if stacks else ""
        log.warning(
            "in-process recovery failed (%s); restarting the workers' processes instead%s", why, where
        )
        self.event_log.record("inprocess_fallback", round=round_number, reason=why, stacks=stacks or [])

    def stopped(self) -> None:
        """The workers were stopped: nothing is paused any more."""
        self._pause = None
        self.hub.forget(self.group.pids)

    def keepable(self, keep: bool) -> list[int]:
        """The local ranks :meth:`start` would keep with ``keep``: the paused workers (before it runs)."""
        if not keep:
            return []
        paused = set(self.hub.paused_pids())
        return [r for r, pid in enumerate(self.group.pids) if pid in paused]

    def start(
        self, spec: WorkerSpec, round_number: int, on_exit: Callable[[WorkerExit], None], keep: bool
    ) -> tuple[list[int], list[int], float]:
        """Start the round's workers: with ``keep``, keep the paused ones (sent their new environment) and
        start the others; else start all. Returns the pids by local rank, the local ranks kept, and when
        they started."""
        self._pause = None
        kept: list[int] = []
        if keep and self.hub.paused_pids():
            kept, spawned = self.group.keep_and_start(spec, on_exit=on_exit)
            pids = list(self.group.pids)
            for r in kept:
                if not self.hub.resume(pids[r], round_number, spec.envs[r]):
                    log.warning("local rank %d (pid %d) is gone before its resume", r, pids[r])
            new_pids = [pids[r] for r in spawned]
        else:
            # Nothing is kept: end what is left first. A worker that died while it was asked to leave its
            # step settles the pause at once (it is gone), before its watcher has reaped it; starting over
            # it failed with "workers still running" and ended the agent.
            self.group.stop()
            self.group.start(spec, on_exit=on_exit)
            pids = new_pids = list(self.group.pids)
        returned = time.monotonic()
        # The kernel's creation time of the last new worker, not the start call's return (bookkeeping
        # after the fork): where the master's recovery phase ``restart`` ends. Kept workers resume now.
        created = last_created_at(new_pids) if new_pids else None
        return pids, kept, (min(created, returned) if created is not None else returned)

    def broken_cause(
        self, assignment: Assignment | None, local_rank: int, message: str, seen_at: float
    ) -> tuple[FailureInfo, float]:
        """What to report for a worker whose collective broke, and since when: the failure of a local
        worker that exited (the root cause, when it is on this node), else the broken collective."""
        if (exited := self._local_exit()) is not None:
            return self.group.failure_info(exited), exited.seen_at
        pids = self.group.pids
        offset = assignment.rank_offset if assignment is not None else 0
        pid = pids[local_rank] if local_rank < len(pids) else None
        info = FailureInfo(
            local_rank=local_rank,
            global_rank=offset + local_rank,
            exit_code=None,
            signal=None,
            message=f"collective failed in pid {pid} (it waits for the next round): {message}",
        )
        return info, seen_at

    # -- helpers ---------------------------------------------------------------------------------------
    def _alive(self, pid: int) -> bool:
        pids = self.group.pids
        return any(pids[r] == pid for r in self.group.running())

    def _local_exit(self, wait_s: float = LOCAL_EXIT_WAIT_S) -> WorkerExit | None:
        """A local worker of the current start that failed, if one does within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            pids, codes = self.group.pids, self.group.exit_codes()
            for local_rank, code in enumerate(codes):
                if code is not None and code != 0:
                    return WorkerExit(local_rank, -1, pids[local_rank], code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)  # the exit's watcher thread sets it: a poll with a deadline
