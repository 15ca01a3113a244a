"""Goodput: the share of the job's wall-clock time that was training. Pure: time is passed in.

*Training time* is the time during which the workers of a full round were stepping: it starts when every
member of a round has reported its first step in that round (``first_step`` event), and ends at the
earliest moment the world is known to have broken (the worker exit the agent saw, a hung worker's last
progress, a lost node's last heartbeat), at a round opened for a membership change, or at the job's end.
*Wall time* runs from the job's start (``job_started`` event) to now, or to the job's end once it ended.
``goodput = training time / wall time``. Rendezvous, restarts, restores, the first step of every round
and the time a broken world took to be detected all count as lost. The same figures can be recomputed
from the event log: the events that start or stop training carry ``data.training`` (``started`` or
``stopped``) and the exact moment in ``data.training_at``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GoodputAccount:
    """Training time and wall time of one job; durable through :meth:`snapshot` (Unix-anchored times)."""

    started_at: float
    training_s: float = 0.0
    training_since: float | None = None  # set while a full world is stepping
    ended_at: float | None = None

    @property
    def training(self) -> bool:
        return self.training_since is not None

    def start(self, at: float) -> bool:
        """The full world steps from ``at`` on; False when it already did (nothing changes)."""
        if self.training or self.ended_at is not None:
            return False
        self.training_since = at
        return True

    def stop(self, at: float) -> bool:
        """Training stopped at ``at`` (possibly before now: a failure seen earlier); False if it was not
        training. A stop before the start (clock noise between nodes) counts as no training."""
        if self.training_since is None:
            return False
        self.training_s += max(0.0, at - self.training_since)
        self.training_since = None
        return True

    def end(self, at: float) -> None:
        """The job ended: training stops and the wall time stops growing."""
        self.stop(at)
        if self.ended_at is None:
            self.ended_at = at

    def training_time(self, now: float) -> float:
        running = max(0.0, now - self.training_since) if self.training_since is not None else 0.0
        return self.training_s + running

    def ratio(self, now: float) -> float | None:
        """Training time / wall time since the start; None before any wall time passed."""
        until = self.ended_at if self.ended_at is not None else now
        wall = until - self.started_at
        if wall <= 0:
            return None
        return min(1.0, self.training_time(until) / wall)

    def snapshot(self) -> dict:
        return {
            "started_at": self.started_at,
            "training_s": self.training_s,
            "training_since": self.training_since,
            "ended_at": self.ended_at,
        }

    @classmethod
    def restore(cls, data: dict | None, now: float) -> GoodputAccount:
        """From :meth:`snapshot`; a snapshot without it (an older master) starts counting at ``now``."""
        if not data:
            return cls(started_at=now)
        return cls(
            started_at=float(data["started_at"]),
            training_s=float(data.get("training_s", 0.0)),
            training_since=data.get("training_since"),
            ended_at=data.get("ended_at"),
        )
