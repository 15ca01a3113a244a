"""Hang verdicts: which of this node's workers are hung, and why.

A worker is *hung* when, with ``--hang-timeout T`` (0 turns verdicts off):

* it has reported at least one step (``elastic.report``) and its step has not advanced for ``T`` while
  its process is alive; or
* its process has been stopped (SIGSTOP, or a tracer's stop) or in uninterruptible disk sleep for longer
  than ``T``, as seen at every check since.

Workers that have not reported a step yet are judged on their process state only: start-up (imports,
CUDA initialisation, data loading, the process-group rendezvous) may take any time, and scripts that never
report are never judged on progress. So are workers that said their training is over
(``elastic.destroy_process_group()`` reports it): their teardown may take a while. A worker whose process
has exited is not judged (its exit is).

When some worker is hung and another one's process is stopped or in disk sleep, the latter is reported
too, first, even before its own timeout: when one rank stops, its peers stall in the next collective, and
the stopped one is the cause to name.

:func:`hung_workers` is the pure verdict, a function of (now, timeout, observations); the agent's
heartbeat thread feeds it every interval through :class:`HangWatch`, which reads the progress channel and
the processes' psutil states. So a hang is declared at most ``T`` + one heartbeat interval after the last
step (or, for a stopped process, after the first check that saw it stopped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

from agent.observe.channel import RankProgress

STOPPED_STATES = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})
STUCK_STATES = STOPPED_STATES | {psutil.STATUS_DISK_SLEEP}


@dataclass(frozen=True)
class WorkerObservation:
    """One live worker at one check."""

    local_rank: int
    step: int | None  # last reported step; None: none yet
    advanced_at: float  # monotonic time of the last step advance (the worker's start before any)
    status: str | None = None  # psutil status now (None: unknown)
    stuck_since: float | None = None  # since when it has been in a stopped/disk-sleep state (None: it is not)


@dataclass(frozen=True)
class Hang:
    """A hung worker: ``cause`` is ``stopped``, ``disk_sleep`` or ``no_progress``."""

    local_rank: int
    cause: str
    stalled_s: float
    reason: str


def hung_workers(now: float, timeout_s: float, observations: Iterable[WorkerObservation]) -> list[Hang]:
    """The hung workers among ``observations``, the likeliest root cause first.

    Order: workers whose process is stopped or in disk sleep first (when one rank stops, its peers stall
    in the next collective, so the stopped one is the cause), then the longest stalled, then by rank.
    """
    if timeout_s <= 0:
        return []
    observations = list(observations)
    found: list[tuple[tuple, Hang]] = []
    stuck_peers: list[tuple[WorkerObservation, float]] = []  # (observation, seconds stuck)
    for o in observations:
        stuck_s = now - o.stuck_since if o.status in STUCK_STATES and o.stuck_since is not None else None
        idle_s = now - o.advanced_at if o.step is not None else None
        stuck = stuck_s is not None and stuck_s >= timeout_s
        idle = idle_s is not None and idle_s >= timeout_s
        if not (stuck or idle):
            if stuck_s is not None:
                stuck_peers.append((o, stuck_s))
            continue
        parts = []
        if idle_s is not None and idle:
            parts.append(f"no step for {idle_s:.1f}s (last step {o.step}; --hang-timeout {timeout_s:g}s)")
        if stuck_s is not None:
            state = "stopped" if o.status in STOPPED_STATES else "in uninterruptible disk sleep"
            parts.append(f"its process has been {state} for {stuck_s:.1f}s")
        if o.status in STOPPED_STATES:
            cause = "stopped"
        elif o.status == psutil.STATUS_DISK_SLEEP:
            cause = "disk_sleep"
        else:
            cause = "no_progress"
        stalled_s = max(s for s in (idle_s, stuck_s) if s is not None)
        hang = Hang(o.local_rank, cause, stalled_s, "; ".join(parts))
        found.append(((cause == "no_progress", -stalled_s, o.local_rank), hang))
    if found:
        # The likely cause of its peers' stall, named although below its timeout.
        for o, stuck_s in stuck_peers:
            state = "stopped" if o.status in STOPPED_STATES else "in uninterruptible disk sleep"
            cause = "stopped" if o.status in STOPPED_STATES else "disk_sleep"
            reason = f"its process has been {state} for {stuck_s:.1f}s while its peers stalled"
            found.append(((False, -stuck_s, o.local_rank), Hang(o.local_rank, cause, stuck_s, reason)))
    return [hang for _, hang in sorted(found, key=lambda item: item[0])]


class HangWatch:
    """Observes one worker generation: psutil states with the time each stuck state was first seen."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stuck: dict[int, float] = {}  # pid -> first check that saw it stopped or in disk sleep

    def observe(
        self, now: float, progress: Mapping[int, RankProgress], pids: Mapping[int, int]
    ) -> list[WorkerObservation]:
        """Observations of the live workers ``pids`` (local rank -> pid), with their progress."""
        observations = []
        for local_rank, pid in pids.items():
            try:
                status = psutil.Process(pid).status()
            except psutil.Error:
                continue  # gone: its exit is reported on its own
            if status == psutil.STATUS_ZOMBIE:
                continue
            if status in STUCK_STATES:
                since = self._stuck.setdefault(pid, now)
            else:
                self._stuck.pop(pid, None)
                since = None
            p = progress.get(local_rank)
            observations.append(
                WorkerObservation(
                    local_rank,
                    p.step if p and not p.done else None,
                    p.advanced_at if p else now,
                    status,
                    since,
                )
            )
        return observations

    def check(self, now: float, progress: Mapping[int, RankProgress], pids: Mapping[int, int]) -> list[Hang]:
        """The hung workers now (see :func:`hung_workers`)."""
        if self.timeout_s <= 0:
            return []
        return hung_workers(now, self.timeout_s, self.observe(now, progress, pids))
