"""The agent's heartbeats: what a heartbeat says about this node, and the thread that sends one each interval.

The heartbeat thread reports the node's view (agent.executor.node_view.NodeView, written by the main thread
only), checks the running workers for hangs (agent.executor.health.HangMonitor) and posts what it learns as
events for the machine (agent.machine.decisions): a non-``continue`` command while workers run, a hang, the
master forgetting the node, a final refusal, or how long the master has been silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.checkpoints.keeper import CheckpointKeeper
from agent.executor.health import HangMonitor
from agent.executor.master_link import MasterLink
from agent.executor.node_view import NodeView
from agent.machine.events import AgentEvent, CommandReceived, HangSeen, NodeUnknown
from agent.observe.channel import ProgressChannel
from elastic.control.client import Backoff, MasterError, MasterRejectedError
from elastic.control.error_table import Disposition
from elastic.control.protocol import PERSIST_ERROR_MAX, Command, HeartbeatRequest, NodeState, WorkerProgress


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
    firsts = [p.first_step_at for p in progress.values()]
    stepped = bool(firsts) and len(firsts) == len(view.pids) and None not in firsts
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
        **(keeper.replication_fields() if keeper else {}),
    )


class HeartbeatThread:
    """Sends a heartbeat every interval until ``closing`` is set (thread ``heartbeat``)."""

    def __init__(
        self,
        link: MasterLink,
        request: Callable[[], HeartbeatRequest],
        view: Callable[[], NodeView],
        hangs: HangMonitor,
        keeper: CheckpointKeeper | None,
        post: Callable[[AgentEvent], None],
        generation: Callable[[], int],
        closing: threading.Event,
        call_timeout: float,
    ) -> None:
        self.link = link
        self._request = request  # this node's heartbeat now (heartbeat_request of the agent's view)
        self._view = view
        self._hangs = hangs
        self._keeper = keeper
        self._post = post
        self._generation = generation
        self._closing = closing
        self.call_timeout = call_timeout  # per address, for one heartbeat call

    def start(self) -> None:
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    def _loop(self) -> None:
        link, client, node_id = self.link, self.link.client, self.link.settings.node_id
        interval = link.heartbeat_interval
        # After a failed heartbeat the next one comes after a random 50-100% of the interval: jitter but
        # no backoff, so that a master that just took over hears from every live node well within its
        # grace period (one heartbeat timeout), yet not from all nodes at the same instant.
        retry = Backoff(interval, interval)
        wait = interval
        while not self._closing.wait(wait):
            wait = interval
            generation = self._generation()
            if self._view().state is NodeState.RUNNING:
                hangs = self._hangs.check(generation)
                if hangs:
                    self._post(HangSeen(tuple(hangs), generation=generation))
            if not client.has_joined(node_id):
                continue  # no incarnation yet (the join is being retried): nothing to report for
            try:
                reply = client.heartbeat(self._request(), timeout=self.call_timeout)
            except MasterRejectedError as exc:
                if exc.disposition is Disposition.FINAL:
                    link.refused(exc, "heartbeat", generation)
                elif exc.disposition is Disposition.REJOIN and self._view().state is not NodeState.WAITING:
                    self._post(NodeUnknown(exc.message, generation=generation))
                continue
            except MasterError as exc:
                link.tls_trouble.failed(exc)
                self._post(link.unreachable(generation))
                wait = retry.next()
                continue
            link.contact()
            if self._keeper is not None and reply.command is Command.CONTINUE:
                self._keeper.set_replica_targets(
                    reply.peers
                )  # peer replication (agent.checkpoints.replication)
            if reply.command is not Command.CONTINUE and self._view().state is NodeState.RUNNING:
                self._post(CommandReceived(reply, generation=generation))
