"""What the master knows of one node: durable facts (id, host, workers, state in its round, failures,
credential hash) and soft state its heartbeats bring (progress, checkpoint, persist and replication)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.protocol import NodeState, WorkerFailure, WorkerProgress


@dataclass
class NodeInfo:
    """One node of the job (an agent); see the module docstring for which fields are durable."""

    node_id: str
    host: str
    nproc: int
    state: NodeState = NodeState.WAITING
    round: int = 0
    failures: int = 0
    workers: list[WorkerProgress] = field(default_factory=list)
    ckpt_step: int | None = None
    #: Hash of the current incarnation's secret (durable; master.credentials); never the secret itself.
    secret_hash: str = ""
    # Soft state from heartbeats (never stored): the node's durable checkpoint and its persist trouble.
    persisted_step: int | None = None
    persist_error: str = ""
    # Soft state: peer replication of its memory checkpoints (agent.replication).
    replication_port: int | None = None
    replicated_step: int | None = None
    replication_lag: int | None = None
    replication_error: str = ""
    joined_at: float | None = None  # when it last joined (a scale-up's detection starts there)

    @property
    def step(self) -> int | None:
        steps = [w.step for w in self.workers if w.step is not None]
        return min(steps) if steps else None

    @property
    def step_time_s(self) -> float | None:
        times = [w.step_time_s for w in self.workers if w.step_time_s is not None]
        return max(times) if times else None  # the node is as slow as its slowest worker


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
