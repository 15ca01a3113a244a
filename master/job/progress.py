"""What heartbeats tell the master: each node's record (:class:`NodeInfo`) and the job's checkpoint steps
(:class:`CheckpointProgress`, with the members' step floor :class:`StepFloor`).

A node's record holds durable facts (id, host, workers, failures, credential hash) and soft state its
heartbeats bring (progress, checkpoint, persist and replication). Of its workers' progress reports the
master keeps the figures it uses (the slowest worker's step and pace), not the reports: a 10,000-node job
would otherwise hold 80,000 report objects, replaced at every heartbeat, for the garbage collector to go
through.

The checkpoint steps are soft state (rebuilt from heartbeats after a failover): nothing here is a reason to
write the store. The committed step is the newest checkpoint step that *every* member of the running round
holds, the smallest of the members' reported steps once each member reported one. Heartbeats report steps
one node at a time, so :class:`StepFloor` keeps that minimum up to date in O(1) (amortized) per report
instead of the job scanning every member (O(N) per look, which a 10,000-node job cannot do per heartbeat,
nor at each of many removals in one tick).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from elastic.control.protocol import NodeState, WorkerFailure, WorkerProgress
from master.job.stragglers import NO_PACE, Pace, node_pace


@dataclass
class NodeInfo:
    """One node of the job (an agent); see the module docstring for which fields are durable."""

    node_id: str
    host: str
    nproc: int
    state: NodeState = NodeState.WAITING
    round: int = 0
    failures: int = 0
    #: Soft state from its workers' reports (:meth:`note_workers`): the slowest worker's step, and the
    #: workers' pace (master.job.stragglers.node_pace), judged over all nodes every aggregate period.
    step: int | None = None
    pace: Pace = NO_PACE
    ckpt_step: int | None = None
    #: Hash of the current incarnation's secret (durable; master.job.liveness); never the secret itself.
    secret_hash: str = ""
    #: Its id is elastic-run's default HOSTNAME-PID (durable): losses count per host (master.job.flapping).
    default_id: bool = False
    # Soft state from heartbeats (never stored): the node's durable checkpoint and its persist trouble.
    persisted_step: int | None = None
    persist_error: str = ""
    corrupt_seen: frozenset[str] = frozenset()  # ids of the damaged-checkpoint reports of its last heartbeat
    # Soft state: peer replication of its memory checkpoints (agent.checkpoints.replication).
    replication_port: int | None = None
    replicated_step: int | None = None
    replication_lag: int | None = None
    replication_error: str = ""
    joined_at: float | None = None  # when it last joined (a scale-up's detection starts there)
    #: Soft, never stored: (secret_hash, the secret) last checked against that hash (Job.authenticate), so
    #: that a steady heartbeat compares the secret instead of hashing it.
    verified: tuple[str, bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def step_time_s(self) -> float | None:
        return self.pace.step_time_s  # the node is as slow as its slowest worker

    def note_workers(self, workers: Sequence[WorkerProgress]) -> None:
        """Keep what the master uses of a heartbeat's worker reports."""
        steps = [w.step for w in workers if w.step is not None]
        self.step = min(steps) if steps else None
        pace = node_pace(workers)
        if pace != self.pace:  # an equal one stays: no object kept per heartbeat then
            self.pace = pace


def describe_failure(node_id: str, failure: WorkerFailure) -> str:
    """A worker failure in a few words (the cause an event and an outcome name)."""
    text = f"rank {failure.rank} (local rank {failure.local_rank} on node {node_id})"
    if failure.kind == "hang":
        text += " hung"  # the message says how (no step for ..., process stopped ...)
    else:
        how = f"signal {failure.signal}" if failure.signal else f"exit code {failure.exit_code}"
        text += f" failed with {how}"
    if failure.message:
        text += f": {failure.message.strip()}"
    return text


class StepFloor:
    """The smallest step reported by the members of one round, once each of them has reported one."""

    def __init__(self) -> None:
        self._members: frozenset[str] = frozenset()
        self._steps: dict[str, int] = {}  # member -> its reported step
        self._count: Counter[int] = Counter()  # step -> members reporting it (few distinct steps)
        self._lowest: int | None = None  # min(self._count), None when it must be recomputed
        self._lost = False  # a member was removed: its step is never reported again in this round

    def reset(self, members: Iterable[str]) -> None:
        """A round with these members begins (O(members), once per round): no step reported yet."""
        self._members = frozenset(members)
        self._steps.clear()
        self._count.clear()
        self._lowest = None
        self._lost = False

    def report(self, node_id: str, step: int) -> None:
        """``node_id`` holds checkpoint ``step`` (reports of non-members are ignored)."""
        if node_id not in self._members:
            return
        old = self._steps.get(node_id)
        if old == step:
            return
        self._steps[node_id] = step
        if old is not None:
            self._count[old] -= 1
            if not self._count[old]:
                del self._count[old]
                if old == self._lowest:
                    self._lowest = None
        self._count[step] += 1
        if self._lowest is not None and step < self._lowest:
            self._lowest = step

    def lose(self, node_id: str) -> None:
        """A member was removed: until the next round, no step is held by every member."""
        if node_id in self._members:
            self._lost = True

    def floor(self) -> int | None:
        """The newest step every member holds; None until each reported one (or after a member's loss)."""
        if self._lost or not self._members or len(self._steps) < len(self._members):
            return None
        if self._lowest is None:
            self._lowest = min(self._count)  # O(distinct steps): members checkpoint the same steps
        return self._lowest


class CheckpointProgress:
    """The job's checkpoint steps (soft state): the committed step, which only moves forward, and the newest
    step some node made durable (persisted), with when it last moved forward."""

    def __init__(self, committed_step: int | None = None) -> None:
        #: Newest checkpoint step every rank holds (kept in the snapshot when written: a new leader's
        #: first assignments then name a step to restore before heartbeats have reported one).
        self.committed_step = committed_step
        self.floor = StepFloor()  # the running round's members' checkpoint steps
        self.persisted_newest: int | None = None  # newest persisted step any node reported
        self._persisted_high: int | None = None  # newest persisted step counted (see count_persisted)
        self.persisted_at: float | None = None  # when the newest persisted step last moved forward

    def commit(self) -> bool:
        """Move the committed step up to the members' floor (call while a round runs); whether it moved."""
        newest = self.floor.floor()
        if newest is None or (self.committed_step is not None and newest <= self.committed_step):
            return False
        self.committed_step = newest
        return True

    def persisted(self, step: int) -> None:
        """A node reports ``step`` durable."""
        if self.persisted_newest is None or step > self.persisted_newest:
            self.persisted_newest = step

    def count_persisted(self, now: float) -> bool:
        """Whether the newest persisted step moved forward since the last call (the first one seen is
        not counted: it may be from before this master)."""
        newest = self.persisted_newest
        if newest is None or (self._persisted_high is not None and newest <= self._persisted_high):
            return False
        first = self._persisted_high is None
        self._persisted_high, self.persisted_at = newest, now
        return not first
