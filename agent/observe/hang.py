"""Hang verdicts: which of this node's workers are hung, and why.

Without ``--hang-timeout`` (the default) the limit adapts to each worker's own steps: a worker is hung when
it makes no progress (no step, no forward pass, outside a checkpoint save) for ``max(3 x p99 step time,
2 s)`` after a warm-up, and its process-state limit is the same bound; see :mod:`agent.observe.hang_policy`
for the exact rule (what trips it and what does not). Steps come from ``elastic.report`` or, without user
code, from the optimizer-step hook of :mod:`elastic.autoprogress`.

A worker is *hung* when, with an explicit ``--hang-timeout T`` (0 turns verdicts off; the meaning of
releases before the adaptive bound, steps of the optimizer-step hook included):

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
hang-watch thread (agent.executor.health.HangWatchThread) feeds it every 0.1 s through :class:`HangWatch`,
which reads the progress channel and the processes' psutil states. So a hang is declared at most ``T`` +
0.1 s after the last step (or, for a stopped process, after the first check that saw it stopped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

from agent.observe.channel import RankProgress
from agent.observe.hang_policy import (
    DEFAULT_POLICY,
    AdaptiveHangPolicy,
    RankClock,
    adaptive_bound,
    verdict_limit,
)

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
    #: This worker's own limit (the adaptive bound), instead of the fixed timeout; None: the fixed one.
    limit_s: float | None = None
    #: How ``limit_s`` was chosen, for the verdict's reason (e.g. ``adaptive bound 2s = max(...)``).
    rule: str = ""
    #: The limit for a *stopped* process when it differs from ``limit_s``: the adaptive bound also during a
    #: checkpoint save (a stopped process saves nothing; a save may legitimately sleep on disk, not stop).
    stopped_limit_s: float | None = None


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
        limit_s = o.limit_s if o.limit_s is not None else timeout_s
        stuck_s = now - o.stuck_since if o.status in STUCK_STATES and o.stuck_since is not None else None
        idle_s = now - o.advanced_at if o.step is not None else None
        if o.status in STOPPED_STATES and o.stopped_limit_s is not None:
            limit_s = o.stopped_limit_s
        stuck = stuck_s is not None and stuck_s >= limit_s
        idle = idle_s is not None and idle_s >= limit_s
        if not (stuck or idle):
            if stuck_s is not None:
                stuck_peers.append((o, stuck_s))
            continue
        parts = []
        if idle_s is not None and idle and o.limit_s is not None:
            parts.append(f"no progress for {idle_s:.1f}s (last step {o.step}; {o.rule})")
        elif idle_s is not None and idle:
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
    """Observes one worker generation: psutil states with the time each stuck state was first seen.

    ``timeout_s``: the fixed ``--hang-timeout`` (0: no verdicts), or None for the adaptive bound of
    ``policy`` (each worker's own, from its recorded steps)."""

    def __init__(self, timeout_s: float | None, policy: AdaptiveHangPolicy = DEFAULT_POLICY) -> None:
        self.timeout_s = timeout_s
        self.policy = policy
        self._stuck: dict[int, float] = {}  # pid -> first check that saw it stopped or in disk sleep
        #: pid -> its psutil handle, kept while the pid is watched: the agent checks every 0.1 s, and a new
        #: handle reads /proc once more (its creation time) before each state read.
        self._procs: dict[int, psutil.Process] = {}

    def observe(
        self, now: float, progress: Mapping[int, RankProgress], pids: Mapping[int, int]
    ) -> list[WorkerObservation]:
        """Observations of the live workers ``pids`` (local rank -> pid), with their progress."""
        if len(self._procs) > len(pids):  # a worker left the watch: drop its handle
            watched = set(pids.values())
            self._procs = {pid: proc for pid, proc in self._procs.items() if pid in watched}
        observations = []
        for local_rank, pid in pids.items():
            try:
                proc = self._procs.get(pid)
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                status = proc.status()
            except psutil.Error:
                continue  # gone: its exit is reported on its own
            if status == psutil.STATUS_ZOMBIE:
                continue
            if status in STUCK_STATES:
                since = self._stuck.setdefault(pid, now)
            else:
                self._stuck.pop(pid, None)
                since = None
            observations.append(
                observe_progress(now, local_rank, progress.get(local_rank), status, since, self.adaptive)
            )
        return observations

    @property
    def adaptive(self) -> AdaptiveHangPolicy | None:
        """The adaptive policy in force; None with a fixed timeout."""
        return self.policy if self.timeout_s is None else None

    def check(self, now: float, progress: Mapping[int, RankProgress], pids: Mapping[int, int]) -> list[Hang]:
        """The hung workers now (see :func:`hung_workers`)."""
        if self.timeout_s is not None and self.timeout_s <= 0:
            return []
        timeout_s = self.policy.fallback_s if self.timeout_s is None else self.timeout_s
        return hung_workers(now, timeout_s, self.observe(now, progress, pids))


def observe_progress(
    now: float,
    local_rank: int,
    p: RankProgress | None,
    status: str | None = None,
    stuck_since: float | None = None,
    adaptive: AdaptiveHangPolicy | None = None,
) -> WorkerObservation:
    """One worker's observation from its progress; with ``adaptive``, its own limit (the adaptive rule)."""
    step = p.step if p is not None and not p.done else None
    advanced_at = p.advanced_at if p is not None else now
    limit_s, rule, stopped_limit_s = None, "", None
    if adaptive is not None and p is not None and step is not None:
        limit = verdict_limit(_clock(p), adaptive)
        if limit is not None:
            advanced_at, limit_s, rule = limit.since, limit.limit_s, limit.rule
        if limit is not None and not limit.adaptive:
            # A save in progress or the warm-up: a *stopped* process still gets the bound, or the floor
            # before the bound is known (start-up slowness never stops a process; a signal or a tracer
            # does). Before its first step a worker is judged on the fallback (a debugger attached early).
            bound = adaptive_bound(p.durations, adaptive)
            stopped_limit_s = bound if bound is not None else adaptive.floor_s
    return WorkerObservation(
        local_rank, step, advanced_at, status, stuck_since, limit_s, rule, stopped_limit_s
    )


def _clock(p: RankProgress) -> RankClock:
    """The adaptive rule's view of one rank's progress."""
    return RankClock(p.advanced_at, tuple(p.durations), p.alive_at, p.saving_since, p.resumed_at)
