"""The node view: what this node's heartbeats report (agent.executor.heartbeats), written by the executor
(agent.executor.loop) as it performs the machine's actions."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.control.protocol import NodeCheckResult, NodeState, WorkerFailure


@dataclass
class NodeView:
    """What the heartbeat thread reports; written by the main thread only."""

    state: NodeState = NodeState.WAITING
    round: int = 0
    failure: WorkerFailure | None = None
    pids: list[int] = field(default_factory=list)
    node_check: NodeCheckResult | None = None  # its result in a node-check round
    started_at: float | None = None  # when this round's workers started (time.monotonic)
    failed_at: float | None = None  # when the agent saw ``failure`` (time.monotonic)
