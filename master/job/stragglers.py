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
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


class StragglerTracker:
    """Remembers the flagged nodes and turns changes into event lines ``(kind, message)``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.flagged: frozenset[str] = frozenset()

    def update(self, paces: Mapping[str, Pace]) -> list[tuple[EventKind, str]]:
        """Judge the nodes' current paces; one event per node that became or stopped being a straggler.

        A flagged node that has no figure any more (a new round started, or it left) is dropped silently:
        there is nothing measured to report about it.
        """
        result = assess(paces, self.factor, self.flagged)
        events: list[tuple[EventKind, str]] = []
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
