"""Straggler report: which nodes are slower than ``factor`` times the nodes' median. Pure: no I/O, no clock.

A node's pace is the median of its workers' recent step times, as its agent reports them in heartbeats
(the node is as slow as its slowest worker). The reference is the *lower* median of the nodes' paces, so
that in a two-node job the faster node is the reference and a node twice as slow is flagged.

Which time: in synchronous data-parallel training every rank's step lasts as long as the slowest rank's
(the gradient all-reduce waits for it), so wall-clock step times are equal on every node and cannot name
the straggler. Workers that call :func:`elastic.track_ddp` also report their *compute* time (the step
minus the time the all-reduce waited for other ranks); when every measured node has it, it is what is
compared. Otherwise wall-clock step times are (useful when nodes do not run in lock step).

A flagged node stays flagged until its pace falls below ``CLEAR_RATIO`` of the threshold (hysteresis),
so a node near the threshold does not flap between the two states at every heartbeat.

**Policy** (``--straggler-policy``, :class:`StragglerWatch`, consulted by the tracker at each assessment).
With ``report`` (the default) a flag is all. With ``evict`` a node that stays flagged for
``--straggler-window`` of its own steps is removed from the next round and excluded for
``--straggler-cooldown`` seconds, while at least ``--nnodes`` MIN members remain; with ``replace`` only when
a hot spare waits to take its slot at the next round (the world keeps its size). The exclusion goes through
:meth:`master.job.flapping.FlapCounter.exclude`: durable, its agent told to exit 4, lifted after the
cool-down or by ``elastic-master readmit``.

Why these numbers: the flag is a median over 20 steps, so neither one slow step (a checkpoint save, a 3x
outlier on a loaded machine) nor a slow phase of fewer than about 10 steps ever raises it; the window (5
steps by default) asks for more than the flag, and lets a node whose first steps after a restart are slow
(its median then covers a few steps only) clear before it counts. Steps are the node's own (its slowest
worker's step count); a node that reports no step count is timed instead, ``window`` times its own step
time. bench/stragglers.py replays recorded load through this code (figures in docs/benchmarks.md).

Which figure: compute times (``elastic.track_ddp``) name the straggler in lock-step DDP training; without
them the flag comes from wall-clock step times, which DDP makes equal on every node.
:meth:`StragglerWatch.observe` therefore says once, as soon as a running member reports step times without
compute times, that the policy cannot name stragglers there.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import WorkerProgress
from master.job.events import EventKind

#: A flagged node is cleared only once its pace is below this fraction of the threshold.
CLEAR_RATIO = 0.9


@dataclass(frozen=True)
class Pace:
    """One node's recent speed: seconds per step, wall clock and (when measured) compute only."""

    step_time_s: float | None
    compute_time_s: float | None = None


#: The pace of a node whose workers reported no step time yet.
NO_PACE = Pace(None)


def node_pace(workers: Iterable[WorkerProgress]) -> Pace:
    """A node's pace from its workers' reports: the slowest worker's figures. Computed once per heartbeat
    (:attr:`master.job.progress.NodeInfo.pace`), so a single pass."""
    step = compute = None
    for w in workers:
        if w.step_time_s is not None and (step is None or w.step_time_s > step):
            step = w.step_time_s
        if w.compute_time_s is not None and (compute is None or w.compute_time_s > compute):
            compute = w.compute_time_s
    return Pace(step, compute) if step is not None or compute is not None else NO_PACE


@dataclass(frozen=True)
class Assessment:
    """The verdict over all nodes at one moment."""

    flagged: frozenset[str]
    metric: str  # "compute time" | "step time"
    median_s: float | None
    times: Mapping[str, float]  # the compared figure per measured node


def assess(
    paces: Mapping[str, Pace], factor: float, previous: Iterable[str] = (), clear_ratio: float = CLEAR_RATIO
) -> Assessment:
    """Flag the nodes slower than ``factor`` times the lower median of the measured nodes.

    Nodes without a figure are not judged (and not flagged). At least two measured nodes are needed.
    ``previous`` are the nodes flagged so far: they stay flagged down to ``clear_ratio`` of the threshold.
    """
    computes = {n: p.compute_time_s for n, p in paces.items() if p.compute_time_s is not None}
    steps = {n: p.step_time_s for n, p in paces.items() if p.step_time_s is not None}
    if len(computes) >= 2 and len(computes) == len(steps):
        metric, times = "compute time", computes
    else:
        metric, times = "step time", steps
    times = {n: t for n, t in times.items() if t > 0}
    if len(times) < 2:
        return Assessment(frozenset(), metric, None, times)
    median = statistics.median_low(times.values())
    threshold = factor * median
    was = set(previous)
    flagged = frozenset(
        n for n, t in times.items() if t > threshold or (n in was and t > threshold * clear_ratio)
    )
    return Assessment(flagged, metric, median, times)


@dataclass(frozen=True)
class StragglerPolicy:
    """``mode`` report | evict | replace; a node flagged for ``window`` of its steps is acted on and then
    excluded for ``cooldown_s``; ``min_nodes`` members always remain (evict)."""

    mode: str
    window: int
    cooldown_s: float
    min_nodes: int

    @classmethod
    def of(cls, settings: JobSettings) -> StragglerPolicy:
        return cls(
            settings.straggler_policy,
            settings.straggler_window,
            settings.straggler_cooldown_s,
            settings.min_nodes,
        )

    @property
    def acts(self) -> bool:
        return self.mode != "report"


@dataclass
class Streak:
    """A node flagged without a break since ``at`` (its step then: ``step``), seen in ``seen`` assessments."""

    at: float
    step: int | None
    seen: int = 1
    ratio: float = 0.0  # its figure / the median, at the last assessment
    held: bool = False  # the policy said it keeps the node (too few members, no spare): said once


@dataclass(frozen=True)
class Eviction:
    """The decision to remove a straggler: who, by how much it was slower and for how long."""

    node_id: str
    mode: str
    metric: str  # "compute time" | "step time"
    time_s: float
    median_s: float
    steps: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.time_s / self.median_s

    def cause(self) -> str:
        """Why, in words (the exclusion's cause: the event, the status reason and the agent's last line)."""
        how = "replaced by a spare" if self.mode == "replace" else "evicted"
        return (
            f"straggler {how}: {self.metric} {self.time_s:.3f}s per step, {self.ratio:.2f}x the median "
            f"{self.median_s:.3f}s, for {self.steps} steps ({self.seconds:.1f}s; "
            f"--straggler-policy {self.mode})"
        )


@dataclass
class Decision:
    """What one observation decided: nodes to remove (slowest first) and one-line notices for events."""

    evict: list[Eviction] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


@dataclass
class StragglerWatch:
    """Follows the flagged nodes' streaks and decides evictions (:meth:`observe`). Soft state: a master
    taking over starts the streaks afresh (the flags themselves are soft state)."""

    policy: StragglerPolicy
    streaks: dict[str, Streak] = field(default_factory=dict)
    blind_said: bool = False

    def observe(
        self,
        result: Assessment,
        paces: Mapping[str, Pace],
        steps: Mapping[str, int | None],
        now: float,
        members: int,
        spares: int,
    ) -> Decision:
        """One assessment of the running members (``members`` of them, ``paces`` and ``steps`` by node) at
        ``now``, with ``spares`` hot spares waiting: the nodes to remove now, slowest first."""
        decision = Decision()
        policy = self.policy
        if not policy.acts:
            return decision
        if not self.blind_said:
            blind = sorted(
                n for n, p in paces.items() if p.step_time_s is not None and p.compute_time_s is None
            )
            if blind:
                self.blind_said = True
                decision.notices.append(
                    f"straggler policy {policy.mode} cannot name stragglers from compute time: node "
                    f"{blind[0]} reports step times without compute times (its script does not call "
                    "elastic.track_ddp); in lock-step DDP training step times are equal on every node, "
                    "so it cannot act there"
                )
        for node_id in [n for n in self.streaks if n not in result.flagged]:
            del self.streaks[node_id]
        if result.median_s is None:
            return decision
        due: list[tuple[float, Eviction]] = []
        for node_id in sorted(result.flagged):
            time_s = result.times[node_id]
            streak = self.streaks.get(node_id)
            if streak is None:
                streak = self.streaks[node_id] = Streak(now, steps.get(node_id))
            else:
                streak.seen += 1
            streak.ratio = time_s / result.median_s
            step, since = steps.get(node_id), streak.step
            if step is not None and since is not None:
                sustained = step - since
            else:  # no step count: timed in its own steps
                sustained = int((now - streak.at) / time_s) if time_s > 0 else 0
            if streak.seen >= 2 and sustained >= policy.window:
                eviction = Eviction(
                    node_id, policy.mode, result.metric, time_s, result.median_s, sustained, now - streak.at
                )
                due.append((streak.ratio, eviction))
        room = members - policy.min_nodes if policy.mode == "evict" else spares
        for _, eviction in sorted(due, key=lambda item: -item[0]):
            streak = self.streaks[eviction.node_id]
            if room > 0:
                room -= 1
                decision.evict.append(eviction)
                del self.streaks[eviction.node_id]
            elif not streak.held:
                streak.held = True
                why = (
                    f"removing it would leave fewer than {policy.min_nodes} nodes (--nnodes MIN)"
                    if policy.mode == "evict"
                    else "no spare is waiting to take its slot"
                )
                decision.notices.append(
                    f"straggler policy {policy.mode} keeps node {eviction.node_id} "
                    f"({eviction.ratio:.2f}x the median for {eviction.steps} steps): {why}"
                )
        return decision


class StragglerTracker:
    """Remembers the flagged nodes and turns changes into event lines ``(kind, message)``; with a policy
    that acts, also the evictions it decided (:meth:`take_evictions`)."""

    def __init__(self, factor: float, policy: StragglerPolicy | None = None) -> None:
        self.factor = factor
        self.flagged: frozenset[str] = frozenset()
        self.watch = StragglerWatch(policy) if policy is not None else None
        self._evictions: list[Eviction] = []

    def update(
        self,
        paces: Mapping[str, Pace],
        now: float = 0.0,
        steps: Mapping[str, int | None] | None = None,
        members: int = 0,
        spares: int = 0,
    ) -> list[tuple[EventKind, str]]:
        """Judge the nodes' current paces; one event per node that became or stopped being a straggler,
        and one per notice of the policy (:meth:`StragglerWatch.observe`, given
        ``now``, the nodes' ``steps``, the round's ``members`` count and the ``spares`` waiting).

        A flagged node that has no figure any more (a new round started, or it left) is dropped silently:
        there is nothing measured to report about it.
        """
        result = assess(paces, self.factor, self.flagged)
        events: list[tuple[EventKind, str]] = []
        if self.watch is not None:
            decision = self.watch.observe(result, paces, steps or {}, now, members, spares)
            events.extend((EventKind.STRAGGLER_POLICY, notice) for notice in decision.notices)
            self._evictions.extend(decision.evict)
        if result.median_s is not None:
            median, count = result.median_s, len(result.times)
            for node_id in sorted(result.flagged - self.flagged):
                t = result.times[node_id]
                events.append(
                    (
                        EventKind.STRAGGLER,
                        f"node {node_id} is a straggler: {result.metric} {t:.3f}s per step, "
                        f"{t / median:.1f}x the median {median:.3f}s of {count} nodes "
                        f"(--straggler-factor {self.factor:g})",
                    )
                )
            for node_id in sorted((self.flagged - result.flagged) & result.times.keys()):
                t = result.times[node_id]
                events.append(
                    (
                        EventKind.STRAGGLER_CLEARED,
                        f"node {node_id} is no longer a straggler: {result.metric} {t:.3f}s per step, "
                        f"median {median:.3f}s of {count} nodes",
                    )
                )
        self.flagged = result.flagged
        return events

    def take_evictions(self) -> list[Eviction]:
        """The evictions decided since the last call (the job removes those nodes)."""
        taken, self._evictions = self._evictions, []
        return taken
