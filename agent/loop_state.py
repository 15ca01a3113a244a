"""The agent loop's shared state types: its queued events and the node view its heartbeats report.

Their own module so that the loop (agent.loop) and its health duties (agent.health) share them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.protocol import NodeCheckResult, NodeState, WorkerFailure


@dataclass
class QueuedEvent:
    """One item of the agent loop's queue: what happened, for which worker generation, and its data."""

    # assigned | finished | exit | command | signal | master_lost | node_unknown | hang | check_timeout
    # | launcher_ready | rejected (a final refusal by the master: payload is the AgentError to stop with)
    kind: str
    generation: int
    payload: Any = None


@dataclass
class NodeView:
    """What the heartbeat thread reports; written by the main thread only."""

    state: NodeState = NodeState.WAITING
    round: int = 0
    failure: WorkerFailure | None = None
    pids: list[int] = field(default_factory=list)
    node_check: NodeCheckResult | None = None  # this node's result in a node-check round (agent.health)
    started_at: float | None = None  # when this round's workers started (time.monotonic)
    failed_at: float | None = None  # when the agent saw ``failure`` (time.monotonic)


class NodeUnknownError(Exception):
    """The master answered 404 unknown_node to a call the loop needed (see ``_on_node_unknown``)."""
