"""The executor's in-process recovery steps (agent.executor.loop performs them; agent.executor.inprocess_hub
talks to the workers): pause the live workers instead of stopping them, start the next round keeping them,
fall back
to process restarts when that fails, and word a worker's broken collective as its failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.executor.inprocess_hub import InProcessHub
from agent.observe.events import EventLog
from agent.workers.group import FailureInfo, WorkerExit, WorkerGroup, WorkerSpec
from agent.workers.proc_start import last_created_at
from elastic.control.protocol import Assignment

log = logging.getLogger(__name__)

#: How long a broken collective's report waits for the exit of a local worker that explains it (a killed
#: peer on this node: its exit is seen milliseconds after the survivor's collective fails).
LOCAL_EXIT_WAIT_S = 0.1


@dataclass(frozen=True)
class _Pause:
    """A pause asked of the live workers; the agent joins the next round while they leave their step."""

    local_ranks: list[int]
    pids: list[int]
    round: int
    deadline: float  # --stop-grace after the ask
    began: float


class InProcessSteps:
    """Pause instead of stop, resume instead of start, for a node whose live workers all use the API."""

    def __init__(self, hub: InProcessHub, group: WorkerGroup, grace_s: float, event_log: EventLog) -> None:
        self.hub = hub
        self.group = group
        self.grace_s = grace_s  # --stop-grace: how long workers may take to leave their step
        self.event_log = event_log
        self._pause: _Pause | None = None

    def pause(self, running: list[int], assignment: Assignment | None) -> bool:
        """Ask the live workers (local ranks ``running``) to leave their step; True when they will be kept
        (the caller must not stop them). False when they do not all run the API, or the last in-process
        recovery failed: the caller stops them (the fallback, logged with its reason)."""
        pids = self.group.pids
        live = [pids[r] for r in running]
        round_number = assignment.round if assignment is not None else 0
        if (failed := self.hub.take_fallback()) is not None:
            return self._fall_back(live, round_number, failed)
        if not self.hub.covers(live):
            self._pause = None
            return False
        self.hub.send_pause(live, round_number)
        now = time.monotonic()
        self._pause = _Pause(running, live, round_number, now + self.grace_s, now)
        return True

    def settle(self, keep: bool = True) -> None:
        """Before the next start: wait until the paused workers left their step (the agent joined the
        next round meanwhile). Workers that do not leave in time, or any when ``keep`` is False (a node
        check needs fresh processes), are stopped: their local ranks start anew."""
        pause, self._pause = self._pause, None
        if pause is None:
            return
        trouble = self.hub.wait_paused(pause.pids, max(0.0, pause.deadline - time.monotonic()), self._alive)
        if trouble is None and keep:
            paused = [r for r, pid in zip(pause.local_ranks, pause.pids, strict=True) if self._alive(pid)]
            log.info("paused local ranks %s in process (%.3fs)", paused, time.monotonic() - pause.began)
            self.event_log.record("workers_paused", round=pause.round, local_ranks=paused)
            return
        if trouble is not None:
            self._fall_back(pause.pids, pause.round, trouble)
        self.hub.forget(pause.pids)
        self.group.stop(self.grace_s)

    def stopped(self) -> None:
        """The workers were stopped: nothing is paused any more."""
        self._pause = None
        self.hub.forget(self.group.pids)

    def start(
        self, spec: WorkerSpec, round_number: int, on_exit: Callable[[WorkerExit], None]
    ) -> tuple[list[int], list[int], float]:
        """Start the round's workers: keep the paused ones (sent their new environment) and start the
        others, or start all. Returns the pids by local rank, the local ranks kept, and when they started."""
        self.settle()
        kept: list[int] = []
        if self.hub.paused_pids():
            kept, spawned = self.group.keep_and_start(spec, on_exit=on_exit)
            pids = list(self.group.pids)
            for r in kept:
                if not self.hub.resume(pids[r], round_number, spec.envs[r]):
                    log.warning("local rank %d (pid %d) is gone before its resume", r, pids[r])
            new_pids = [pids[r] for r in spawned]
        else:
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
    def _fall_back(self, pids: list[int], round_number: int, why: str) -> bool:
        log.warning("in-process recovery failed (%s); restarting the workers' processes instead", why)
        self.event_log.record("inprocess_fallback", round=round_number, reason=why)
        self.hub.forget(pids)
        self._pause = None
        return False

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
