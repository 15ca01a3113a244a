"""The agent's progress line: every ``--progress-interval`` seconds (default
:data:`DEFAULT_PROGRESS_INTERVAL_S`), one compact line on the agent's log::

    [agent.executor.loop] progress: round 3, step 1200, 4.9 steps/s, world 16 (2 nodes), restarts 1/3,
    checkpoint step 1100 (on disk 1000)

The figures come from what the agent knows already: its workers' progress channel (steps, step times,
checkpointed step), its round assignment (world, restarts) and its checkpoint keeper (step on disk).
:func:`progress_line` is pure; :class:`ProgressReporter` is the thread that samples and prints.
``--quiet`` (or an interval of 0) turns it off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds between two progress lines (``--progress-interval``; documented in docs/cli.md).
DEFAULT_PROGRESS_INTERVAL_S = 30.0


@dataclass(frozen=True)
class ProgressSample:
    """What the agent knows about its share of the job at one moment."""

    at: float  # time.monotonic()
    state: str  # the node's state (elastic.control.protocol.NodeState value)
    round: int = 0
    step: int | None = None  # the slowest local worker's step
    step_time_s: float | None = None  # the slowest local worker's median step time
    world_size: int | None = None
    nnodes: int | None = None
    restarts: int = 0
    max_restarts: int = 0
    ckpt_step: int | None = None  # newest step every local worker checkpointed (in memory)
    persisted_step: int | None = None  # newest step this node made durable on disk


def steps_per_s(sample: ProgressSample, previous: ProgressSample | None) -> float | None:
    """Steps per second since the previous line of the same round; else from the recent step time."""
    if (
        previous is not None
        and previous.round == sample.round
        and previous.step is not None
        and sample.step is not None
        and sample.at > previous.at
        and sample.step >= previous.step
    ):
        return (sample.step - previous.step) / (sample.at - previous.at)
    if sample.step_time_s:
        return 1.0 / sample.step_time_s
    return None


def progress_line(sample: ProgressSample, previous: ProgressSample | None = None) -> str:
    """``progress: round 3, step 1200, 4.9 steps/s, world 16 (2 nodes), restarts 1/3, checkpoint step 1100
    (on disk 1000)``; a node between rounds says what it is doing instead of the step."""
    parts = [f"round {sample.round}" if sample.round else "no round yet"]
    if sample.state == "running":
        parts.append("step -" if sample.step is None else f"step {sample.step}")
        rate = steps_per_s(sample, previous)
        if rate is not None:
            parts.append(f"{rate:.3g} steps/s")
    else:
        parts.append(sample.state)
    if sample.world_size is not None:
        parts.append(f"world {sample.world_size} ({sample.nnodes} node{'' if sample.nnodes == 1 else 's'})")
    parts.append(f"restarts {sample.restarts}/{sample.max_restarts}")
    checkpoint = "checkpoint " + ("-" if sample.ckpt_step is None else f"step {sample.ckpt_step}")
    if sample.persisted_step is not None:
        checkpoint += f" (on disk {sample.persisted_step})"
    parts.append(checkpoint)
    return "progress: " + ", ".join(parts)


class ProgressReporter:
    """Prints :func:`progress_line` of ``sample()`` every ``interval`` seconds (0: never) until stopped."""

    def __init__(
        self, interval: float, sample: Callable[[], ProgressSample], emit: Callable[[str], None]
    ) -> None:
        self.interval = interval
        self._sample, self._emit = sample, emit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        previous: ProgressSample | None = None
        while not self._stop.wait(self.interval):
            sample = self._sample()
            self._emit(progress_line(sample, previous))
            previous = sample


def sample_agent(agent) -> ProgressSample:
    """A :class:`ProgressSample` of an :class:`agent.executor.loop.ElasticAgent` (read from other threads:
    each
    attribute is replaced whole by the main thread, never changed in place)."""
    view, assignment = agent.view, getattr(agent, "assignment", None)
    running = view.state.value == "running"
    progress = agent.channel.snapshot() if running else {}
    steps = [p.step for p in progress.values()]
    times = [p.step_time_s for p in progress.values() if p.step_time_s is not None]
    persisted = agent.keeper.persist_status()[0] if agent.keeper is not None else None
    current = assignment if assignment is not None and assignment.round == view.round else None
    return ProgressSample(
        at=time.monotonic(),
        state=view.state.value,
        round=view.round,
        step=min(steps) if steps and None not in steps else None,
        step_time_s=max(times) if times else None,
        world_size=current.world_size if current is not None else None,
        nnodes=current.nnodes if current is not None else None,
        restarts=assignment.restart_count if assignment is not None else 0,
        max_restarts=assignment.max_restarts if assignment is not None else agent.settings.job.max_restarts,
        ckpt_step=agent.channel.checkpointed_step() if running else None,
        persisted_step=persisted,
    )
