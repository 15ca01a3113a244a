"""What the master knows of one node: durable facts (id, host, workers, state in its round, failures,
credential hash) and soft state its heartbeats bring (progress, checkpoint, persist and replication).

Of its workers' progress reports the master keeps the figures it uses (the slowest worker's step and
pace), not the reports: a 10,000-node job would otherwise hold 80,000 report objects, replaced at every
heartbeat, for the garbage collector to go through."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    #: Hash of the current incarnation's secret (durable; master.job.credentials); never the secret itself.
    secret_hash: str = ""
    # Soft state from heartbeats (never stored): the node's durable checkpoint and its persist trouble.
    persisted_step: int | None = None
    persist_error: str = ""
    # Soft state: peer replication of its memory checkpoints (agent.checkpoints.replication).
    replication_port: int | None = None
    replicated_step: int | None = None
    replication_lag: int | None = None
    replication_error: str = ""
    joined_at: float | None = None  # when it last joined (a scale-up's detection starts there)

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
    text = f"rank {failure.rank} (local rank {failure.local_rank} on node {node_id})"
    if failure.kind == "hang":
        text += " hung"  # the message says how (no step for ..., process stopped ...)
    else:
        how = f"signal {failure.signal}" if failure.signal else f"exit code {failure.exit_code}"
        text += f" failed with {how}"
    if failure.message:
        text += f": {failure.message.strip()}"
    return text
