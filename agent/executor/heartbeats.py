"""The agent's heartbeats: what a heartbeat says about this node, and the thread that sends one each interval.

The heartbeat thread reports the node's view (agent.executor.node_view.NodeView, written by the main thread
only) and posts what it learns as events for the machine (agent.machine.decisions): a non-``continue``
command while workers run, the master forgetting the node, a final refusal, or how long the master has been
silent. (Hangs are the hang-watch thread's: agent.executor.health.HangWatchThread.) Its beat is the poll
loop of agent.executor.master_link under the heartbeat's policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from agent.checkpoints import replication
from agent.checkpoints.keeper import CheckpointKeeper, ReplicationFields
from agent.executor.master_link import MasterLink, OnGiveUp, PollPolicy
from agent.executor.node_view import NodeView
from agent.machine.events import AgentEvent, CommandReceived, NodeUnknown
from agent.observe.channel import ProgressChannel
from elastic.control.protocol import (
    PERSIST_ERROR_MAX,
    Command,
    CommandReply,
    Finding,
    HeartbeatRequest,
    NodeState,
    WorkerProgress,
)


def heartbeat_request(
    node_id: str, view: NodeView, channel: ProgressChannel, keeper: CheckpointKeeper | None
) -> HeartbeatRequest:
    """This node's heartbeat now: its state, its workers' progress, its checkpoints."""
    progress = channel.snapshot() if view.state is NodeState.RUNNING else {}
    workers = []
    for i, pid in enumerate(view.pids):
        p = progress.get(i)
        workers.append(
            WorkerProgress(
                local_rank=i,
                pid=pid,
                step=p.step if p else None,
                step_time_s=p.step_time_s if p else None,
                compute_time_s=p.compute_time_s if p else None,
            )
        )
    persisted_step, persist_error = keeper.persist_status() if keeper else (None, "")
    now = time.monotonic()
    failure = view.failure
    if failure is not None and view.failed_at is not None:
        failure = failure.model_copy(update={"age_s": max(0.0, now - view.failed_at)})
    firsts = [t for p in progress.values() if (t := p.first_step_at) is not None]
    stepped = bool(firsts) and len(firsts) == len(progress) == len(view.pids)  # every worker stepped
    replication: ReplicationFields = keeper.replication_fields() if keeper else {}
    # Only when there are some: a master that predates the field refuses unknown fields.
    found = keeper.findings.pending() if keeper else []
    findings: dict[str, Any] = {"ckpt_corrupt": [Finding(**f.fields()) for f in found]}
    return HeartbeatRequest(
        node_id=node_id,
        round=view.round,
        state=view.state,
        workers=workers,
        failure=failure,
        ckpt_step=channel.checkpointed_step() if view.state is not NodeState.WAITING else None,
        node_check=view.node_check,
        persisted_step=persisted_step,
        persist_error=persist_error[-PERSIST_ERROR_MAX:],
        workers_started_age_s=max(0.0, now - view.started_at) if view.started_at is not None else None,
        first_step_age_s=max(0.0, now - max(firsts)) if stepped else None,
        **replication,
        **(findings if found else {}),
    )


class HeartbeatThread:
    """Sends a heartbeat every interval until the agent closes (thread ``heartbeat``)."""

    def __init__(
        self,
        link: MasterLink,
        request: Callable[[], HeartbeatRequest],
        view: Callable[[], NodeView],
        keeper: CheckpointKeeper | None,
        post: Callable[[AgentEvent], None],
        generation: Callable[[], int],
        call_timeout: float,
    ) -> None:
        self.link = link
        self._request = request  # this node's heartbeat now (heartbeat_request of the agent's view)
        self._view = view
        self._keeper = keeper
        self._post = post
        self._generation = generation
        self.call_timeout = call_timeout  # per address, for one heartbeat call
        self._tick = 0  # the worker generation of the current beat: its events belong to it

    def start(self) -> None:
        threading.Thread(target=self.run, name="heartbeat", daemon=True).start()

    def policy(self) -> PollPolicy:
        """A heartbeat every interval. After a failed one the next comes after a random 50-100% of the
        interval: jitter but no backoff, so that a master that just took over hears from every live node
        well within its grace period (one heartbeat timeout), yet not from all nodes at the same instant.
        A refusal that retrying may fix waits for the next beat; the others are posted, and it beats on."""
        interval = self.link.heartbeat_interval
        return PollPolicy(
            "heartbeat",
            backoff=(interval, interval),
            period_s=interval,
            refused_wait_s=interval,
            on_give_up=OnGiveUp.POST_AND_GO_ON,
        )

    def run(self) -> None:
        """Beat until the agent closes (the heartbeat thread's body)."""
        self.link.poll(self._beat, self.policy(), self._answered, generation=self._new_tick, post=self._relay)

    def _new_tick(self) -> int:
        self._tick = self._generation()
        return self._tick

    def _beat(self) -> CommandReply | None:
        """One beat: send the heartbeat (None: not joined yet)."""
        client = self.link.client
        if not client.has_joined(self.link.settings.node_id):
            return None  # no incarnation yet (the join is being retried): nothing to report for
        request = self._request()
        reply = client.heartbeat(request, timeout=self.call_timeout)
        if self._keeper is not None and request.ckpt_corrupt:  # answered: the master has these findings
            self._keeper.findings.delivered(c.id for c in request.ckpt_corrupt)
        return reply

    def _answered(self, reply: CommandReply) -> None:
        if self._keeper is not None and reply.command is Command.CONTINUE:
            # Peer replication's targets and keys (agent.checkpoints.replication).
            replication.follow_master(self._keeper, reply.peers, reply.peer_keys, reply.replication_key)
        if reply.command is not Command.CONTINUE and self._view().state is NodeState.RUNNING:
            self._post(CommandReceived(reply, generation=self._tick))

    def _relay(self, event: AgentEvent) -> None:
        # A node that waits (joining, or between rounds) is expected to be unknown for a moment: rejoining
        # is up to the calls it waits for.
        if isinstance(event, NodeUnknown) and self._view().state is NodeState.WAITING:
            return
        self._post(event)
