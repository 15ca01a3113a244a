"""Goodput: the share of the job's wall-clock time that was training. Pure: time is passed in.

*Training time* is the time during which the workers of a full round were stepping: it starts when every
member of a round has reported its first step in that round (``first_step`` event), and ends at the
earliest moment the world is known to have broken (the worker exit the agent saw, a hung worker's last
progress, a lost node's last heartbeat), at a round opened for a membership change, or at the job's end.
*Wall time* runs from the job's start (``job_started`` event) to now, or to the job's end once it ended.
``goodput = training time / wall time``. Rendezvous, restarts, restores, the first step of every round
and the time a broken world took to be detected all count as lost. The same figures can be recomputed
from the event log: the events that start or stop training carry ``data.training`` (``started`` or
``stopped``) and the exact moment in ``data.training_at``. A ``stopped`` mark while training is already
stopped moves the end of the last training period back to its ``training_at`` (never before that period's
start): the world turned out to have broken earlier than first known (a worker failure that followed a
node's loss: training stopped at the lost node's last heartbeat, :meth:`GoodputAccount.stop_earlier`).
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
    #: The last finished training period (start, end), which :meth:`stop_earlier` may shorten.
    last_period: tuple[float, float] | None = None

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
        self.last_period = (self.training_since, max(at, self.training_since))
        self.training_since = None
        return True

    def stop_earlier(self, at: float) -> float | None:
        """The last training period ended at ``at``, not when :meth:`stop` said (the world is found to have
        broken earlier). Returns the period's new end (``at``, but not before the period began), or None
        when nothing changes: training runs, no period ended yet, or it did not end after ``at``."""
        if self.training_since is not None or self.last_period is None:
            return None
        began, ended = self.last_period
        new_end = max(at, began)
        if new_end >= ended:
            return None
        self.training_s -= ended - new_end
        self.last_period = (began, new_end)
        return new_end

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
            "last_period": list(self.last_period) if self.last_period is not None else None,
        }

    @classmethod
    def restore(cls, data: dict | None, now: float) -> GoodputAccount:
        """From :meth:`snapshot`; a snapshot without it (an older master) starts counting at ``now``."""
        if not data:
            return cls(started_at=now)
        period = data.get("last_period")  # absent in an older snapshot
        return cls(
            started_at=float(data["started_at"]),
            training_s=float(data.get("training_s", 0.0)),
            training_since=data.get("training_since"),
            ended_at=data.get("ended_at"),
            last_period=(float(period[0]), float(period[1])) if period else None,
        )
