"""The executor's in-process recovery steps (agent.loop performs them; agent.inprocess_hub talks to the
workers): pause the live workers instead of stopping them, start the next round keeping them, and word
a worker's broken collective as its failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.events import EventLog
from agent.inprocess_hub import InProcessHub
from agent.proc_start import last_created_at
from agent.settings import AgentSettings
from agent.workers import FailureInfo, WorkerExit, WorkerGroup, WorkerSpec
from elastic.protocol import Assignment

log = logging.getLogger(__name__)


def pause_workers(
    group: WorkerGroup,
    hub: InProcessHub,
    running: list[int],
    assignment: Assignment | None,
    settings: AgentSettings,
    event_log: EventLog,
) -> bool:
    """Ask the live workers (local ranks ``running``) to leave their step and keep them for the next
    round. False when they do not all run the in-process API, or do not pause within --stop-grace: then
    the caller stops them, the fallback to a process restart (with an event and a log line saying why)."""
    pids = group.pids
    live = [pids[r] for r in running]
    round_number = assignment.round if assignment is not None else 0
    if (failed := hub.take_fallback()) is not None:
        return _fall_back(hub, live, round_number, failed, event_log)
    if not hub.covers(live):
        return False

    def alive(pid: int) -> bool:
        current = group.pids
        return any(current[r] == pid for r in group.running())

    began = time.monotonic()
    trouble = hub.pause(live, round_number, settings.stop_grace_s, alive)
    if trouble is not None:
        return _fall_back(hub, live, round_number, trouble, event_log)
    paused = [r for r in running if alive(pids[r])]
    log.info("paused local ranks %s in process (%.3fs)", paused, time.monotonic() - began)
    event_log.record("workers_paused", round=round_number, local_ranks=paused)
    return True


def _fall_back(hub: InProcessHub, live: list[int], round_number: int, why: str, event_log: EventLog) -> bool:
    log.warning("in-process recovery failed (%s); restarting the workers' processes instead", why)
    event_log.record("inprocess_fallback", round=round_number, reason=why)
    hub.forget(live)
    return False


def start_or_resume(
    group: WorkerGroup,
    hub: InProcessHub,
    spec: WorkerSpec,
    round_number: int,
    on_exit: Callable[[WorkerExit], None],
) -> tuple[list[int], list[int], float]:
    """Start the round's workers: keep the paused ones (sent their new environment) and start the others,
    or start all. Returns the pids by local rank, the local ranks kept, and when the workers started."""
    kept: list[int] = []
    if hub.paused_pids():
        kept, spawned = group.keep_and_start(spec, on_exit=on_exit)
        pids = list(group.pids)
        for local_rank in kept:
            if not hub.resume(pids[local_rank], round_number, spec.envs[local_rank]):
                log.warning("local rank %d (pid %d) is gone before its resume", local_rank, pids[local_rank])
        new_pids = [pids[r] for r in spawned]
    else:
        group.start(spec, on_exit=on_exit)
        pids = new_pids = list(group.pids)
    returned = time.monotonic()
    # The kernel's creation time of the last new worker, not the start call's return (bookkeeping after
    # the fork): where the master's recovery phase ``restart`` ends. Kept workers resume now.
    created = last_created_at(new_pids) if new_pids else None
    return pids, kept, (min(created, returned) if created is not None else returned)


#: How long a broken collective's report waits for the exit of a local worker that explains it (a killed
#: peer on this node: its exit is seen milliseconds after the survivor's collective fails).
LOCAL_EXIT_WAIT_S = 0.1


def local_exit(group: WorkerGroup, wait_s: float = LOCAL_EXIT_WAIT_S) -> WorkerExit | None:
    """A local worker of the current start that failed, if one does within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        pids, codes = group.pids, group.exit_codes()
        for local_rank, code in enumerate(codes):
            if code is not None and code != 0:
                return WorkerExit(local_rank, -1, pids[local_rank], code)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def broken_cause(
    group: WorkerGroup, assignment: Assignment | None, local_rank: int, message: str, seen_at: float
) -> tuple[FailureInfo, float]:
    """What to report for a worker whose collective broke, and since when: the failure of a local worker
    that exited (the root cause, when it is on this node), else the broken collective itself."""
    if (exited := local_exit(group)) is not None:
        return group.failure_info(exited), exited.seen_at
    pids = group.pids
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
