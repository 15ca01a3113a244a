"""Flapping nodes: count each node id's membership losses in a sliding window, exclude one that loses its
place more than ``limit`` times in it, re-admit it after a cool-down or by an operator. Pure: no I/O, time
is ``now`` (the master's clock, which reads Unix time: :func:`master.service.service.unix_monotonic`).

Losses are counted per node id, except for an agent whose id is elastic-run's default, ``HOSTNAME-PID``:
it gets a new id at every start, so a crash loop there never repeats an id. Its losses are counted per host
name and advertised address instead (:func:`flap_key`: ``HOSTNAME@ADDRESS``), and an exclusion refuses
every default-id agent of that host and address. Agents given ``--node-id`` are counted per id only:
several of them may run on one host (tests, the chaos harness, two slurmd on one machine).

A *loss* (a flap) is a dead verdict for the id, or a new agent replacing the id's previous one before the
master declared it dead (its agent restarted). A node that is not a member of the running round still
counts: a crash-looping agent that never makes it into a round is as disruptive (every join of it reopens
the round). An orderly leave is not a loss, nor a rejoin by the same agent (it holds its secret).

The job (:mod:`master.job.job`) calls :meth:`FlapCounter.note` at each loss; an :class:`Exclusion` it returns
is durable state (the job snapshot holds :meth:`FlapCounter.snapshot`), so a master taking over keeps both
the counters and the exclusions.

Other policies exclude a node through the same store (:meth:`FlapCounter.exclude`, an exclusion with a
``cause``: an evicted straggler, :mod:`master.job.stragglers`; suspect hardware, named the odd replica
too often by the integrity guard, :meth:`FlapCounter.note_suspect`, whose counter is durable here too), so
that one mechanism refuses its joins, tells its agent to exit 4, lifts it after the cool-down or at
``elastic-master readmit``, and survives a failover.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from elastic.control.job_settings import JobSettings

#: Seconds a node excluded as suspect hardware stays excluded unless an operator re-admits it first.
SUSPECT_EXCLUSION_S = 30 * 24 * 3600.0


@dataclass(frozen=True)
class FlapPolicy:
    """More than ``limit`` losses within ``window_s`` seconds exclude a node for ``cooldown_s`` seconds;
    ``limit`` 0 turns the policy off."""

    limit: int
    window_s: float
    cooldown_s: float

    @classmethod
    def of(cls, settings: JobSettings) -> FlapPolicy:
        return cls(settings.flap_limit, settings.flap_window_s, settings.flap_cooldown_s)

    @property
    def enabled(self) -> bool:
        return self.limit > 0


def flap_key(node_id: str, address: str, default_id: bool) -> str:
    """What a node's losses are counted under: its id, or for a default id (``HOSTNAME-PID``, see the
    module docstring) ``HOSTNAME@ADDRESS`` with the address it advertises."""
    if not default_id:
        return node_id
    return f"{node_id.rsplit('-', 1)[0]}@{address}"


@dataclass(frozen=True)
class Exclusion:
    """A node excluded for flapping: ``count`` losses within the window ending ``since``, until ``until``."""

    node_id: str
    count: int
    since: float
    until: float
    window_s: float
    limit: int
    host: str = ""
    nproc: int = 0
    #: ``node_id`` is a :func:`flap_key` ``HOSTNAME@ADDRESS``: every default-id agent there is excluded.
    by_host: bool = False
    #: Why, in words, for an exclusion by another policy (:meth:`FlapCounter.exclude`); "" for flapping.
    cause: str = ""

    @property
    def who(self) -> str:
        """Who is excluded, in words."""
        if self.by_host:
            return f"the agents with default node ids (HOSTNAME-PID) at {self.node_id}"
        return f"node {self.node_id}"

    def event_line(self) -> str:
        """The event's line: who, how often (or why), and how it ends."""
        if self.cause:
            return (
                f"{self.who} excluded: {self.cause}; re-admitted at {clock_time(self.until)} or by "
                f"'elastic-master readmit {self.node_id}'"
            )
        return (
            f"{self.who} excluded for flapping: lost {self.count} times within "
            f"{self.window_s:g}s (more than --flap-limit {self.limit}); re-admitted at "
            f"{clock_time(self.until)} or by 'elastic-master readmit {self.node_id}'"
        )

    def readmitted_line(self) -> str:
        """The event's line when the cool-down is over."""
        if self.cause:
            return f"node {self.node_id} re-admitted: its cool-down of {self.until - self.since:g}s is over"
        return (
            f"node {self.node_id} re-admitted: its flapping cool-down of {self.until - self.since:g}s is over"
        )

    def event_data(self) -> dict[str, float | int]:
        """The event's data fields."""
        if self.cause:
            return {"until": self.until}
        return {"count": self.count, "window_s": self.window_s, "until": self.until}

    def reason(self) -> str:
        """Why, in a few words (the status view's reason)."""
        if self.cause:
            return f"{self.cause}; re-admitted at {clock_time(self.until)}"
        return (
            f"flapping: lost {self.count} times within {self.window_s:g}s (--flap-limit {self.limit}); "
            f"re-admitted at {clock_time(self.until)}"
        )

    def message(self, job_id: str) -> str:
        """The line a refused agent exits with: why, until when, and the operator's command."""
        if self.cause:
            return (
                f"{self.who} is excluded from job {job_id}: {self.cause}; its joins are refused until "
                f"{clock_time(self.until)}, or until an operator runs 'elastic-master readmit {self.node_id} "
                f"--job-id {job_id} --master ADDR --token-file FILE'"
            )
        verb, lost, its = ("are", "they were", "their") if self.by_host else ("is", "it was", "its")
        return (
            f"{self.who} {verb} excluded from job {job_id} for flapping: {lost} lost {self.count} "
            f"times within {self.window_s:g}s (more than --flap-limit {self.limit}); {its} joins are refused "
            f"until {clock_time(self.until)}, or until an operator runs 'elastic-master readmit "
            f"{self.node_id} --job-id {job_id} --master ADDR --token-file FILE'"
        )


def clock_time(at: float) -> str:
    """A reading of the master's clock (Unix time) as a UTC time of day an operator can compare."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


@dataclass
class FlapCounter:
    """Per node id: the times of its recent losses, and the ids excluded for flapping."""

    policy: FlapPolicy
    losses: dict[str, list[float]] = field(default_factory=dict)
    excluded: dict[str, Exclusion] = field(default_factory=dict)
    #: Per node id: when the integrity guard named it the odd replica (master.job.findings), in a window.
    suspects: dict[str, list[float]] = field(default_factory=dict)

    def note(
        self, node_id: str, now: float, host: str = "", nproc: int = 0, by_host: bool = False
    ) -> Exclusion | None:
        """Count one loss of ``node_id`` (a :func:`flap_key`; ``by_host`` when it is a default id's) at
        ``now``; the :class:`Exclusion` when it makes more than ``limit`` within the window (the count
        then starts afresh), else None. Nothing while off, and nothing for a key already excluded."""
        policy = self.policy
        if not policy.enabled or node_id in self.excluded:
            return None
        times = [t for t in self.losses.pop(node_id, []) if t > now - policy.window_s]
        times.append(now)
        if len(times) <= policy.limit:
            self.losses[node_id] = times  # (re)inserted last: the ids are in the order of their last loss
            return None
        exclusion = Exclusion(
            node_id, len(times), now, now + policy.cooldown_s, policy.window_s, policy.limit, host, nproc
        )
        if by_host:
            exclusion = replace(exclusion, by_host=True)
        self.excluded[node_id] = exclusion
        return exclusion

    def exclude(
        self, node_id: str, now: float, cooldown_s: float, cause: str, host: str = "", nproc: int = 0
    ) -> Exclusion | None:
        """Exclude ``node_id`` for ``cooldown_s`` seconds from ``now`` for another policy's ``cause`` (a few
        words: why); the :class:`Exclusion`, or None when the id is excluded already (that one stands).
        Works whether or not the flapping policy is on: the store is shared, the counting is not."""
        if node_id in self.excluded:
            return None
        exclusion = Exclusion(node_id, 0, now, now + cooldown_s, 0.0, 0, host, nproc, cause=cause)
        self.excluded[node_id] = exclusion
        return exclusion

    def note_suspect(
        self, node_id: str, now: float, settings: JobSettings, host: str = "", nproc: int = 0
    ) -> Exclusion | None:
        """Count one naming of ``node_id`` as the odd replica by the integrity guard (master.job.findings) at
        ``now``; when that makes ``--suspect-count`` within ``--suspect-window``, exclude it as suspect
        hardware for :data:`SUSPECT_EXCLUSION_S` (or until readmitted) and return the :class:`Exclusion`
        (the count then starts afresh). Nothing while the count is 0, nor for an id already excluded."""
        limit, window_s = settings.suspect_count, settings.suspect_window_s
        if limit <= 0 or node_id in self.excluded:
            return None
        times = [t for t in self.suspects.pop(node_id, []) if t > now - window_s]
        times.append(now)
        if len(times) < limit:
            self.suspects[node_id] = times
            return None
        cause = (
            f"suspect hardware: named the odd replica {len(times)} times within {window_s:g}s "
            "(--suspect-count, --suspect-window; docs/integrity.md)"
        )
        return self.exclude(node_id, now, SUSPECT_EXCLUSION_S, cause, host, nproc)

    def count(self, node_id: str, now: float) -> int:
        """Losses of ``node_id`` within the window ending ``now``."""
        return sum(1 for t in self.losses.get(node_id, []) if t > now - self.policy.window_s)

    def expired(self, now: float) -> list[Exclusion]:
        """Lift (and return) the exclusions whose cool-down is over at ``now``; drop losses that left the
        window (so the counters stay small)."""
        over = [e for e in self.excluded.values() if e.until <= now]
        for exclusion in over:
            del self.excluded[exclusion.node_id]
        stale = []  # the ids whose last loss left the window: a prefix (see note), so O(stale) per tick
        for node_id, times in self.losses.items():
            if times[-1] > now - self.policy.window_s:
                break
            stale.append(node_id)
        for node_id in stale:
            del self.losses[node_id]
        return over

    def readmit(self, node_id: str) -> Exclusion | None:
        """Lift ``node_id``'s exclusion now (the operator's command); None when it is not excluded."""
        return self.excluded.pop(node_id, None)

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "losses": {n: list(times) for n, times in self.losses.items()},
            "excluded": [asdict(e) for e in self.excluded.values()],
            "suspects": {n: list(times) for n, times in self.suspects.items()},
        }

    def restore(self, data: dict | None) -> None:
        """Load :meth:`snapshot` output (nothing for state written before flap counters existed)."""
        if not data:
            return
        losses = {n: [float(t) for t in times] for n, times in data.get("losses", {}).items() if times}
        self.losses = dict(sorted(losses.items(), key=lambda item: item[1][-1]))  # by last loss (note)
        self.excluded = {e["node_id"]: Exclusion(**e) for e in data.get("excluded", [])}
        self.suspects = {
            n: [float(t) for t in times] for n, times in data.get("suspects", {}).items() if times
        }
