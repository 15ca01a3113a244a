"""The agent's calls to its master: calls the executor needs answered, and the long-poll threads.

Nothing here decides what the agent does next. A call that fails for good becomes an event for the
machine (agent.machine.decisions): :class:`~agent.machine.events.NodeUnknown` (404 unknown_node: rejoin),
:class:`~agent.machine.events.Rejected` (a final refusal: the agent stops) or
:class:`~agent.machine.events.MasterUnreachable` (how long no master answered; the machine compares it
with ``--master-timeout``). The long-poll threads post their answers, tagged with their worker generation,
and end when that generation is over or the agent closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from agent.errors import EXIT_CONFIG, EXIT_FAILED, AgentError
from agent.executor.tls_trouble import TLSTrouble
from agent.machine.events import (
    AgentEvent,
    CommandReceived,
    JobFinished,
    MasterUnreachable,
    NodeUnknown,
    Rejected,
    RoundAssigned,
)
from agent.settings import AgentSettings
from elastic.control.client import (
    Backoff,
    MasterClient,
    MasterError,
    MasterRejectedError,
    MasterTLSError,
    MasterUnreachableError,
)
from elastic.control.error_table import Disposition
from elastic.control.protocol import Command, JobInfo

log = logging.getLogger(__name__)

#: How long one long-poll (round, watch) may wait at the master.
LONG_POLL_S = 20.0

T = TypeVar("T")


class CallFailed(MasterError):
    """A call the executor needed failed for good; ``event`` says how, for the machine."""

    def __init__(self, event: AgentEvent) -> None:
        super().__init__(event)
        self.event = event


class MasterLink:
    """This node's conversation with the job master: contact time, refusals, the long-poll threads."""

    def __init__(
        self,
        settings: AgentSettings,
        client: MasterClient,
        tls_trouble: TLSTrouble,
        post: Callable[[AgentEvent], None],
        generation: Callable[[], int],
        closing: threading.Event,
    ) -> None:
        self.settings = settings
        self.client = client
        self.tls_trouble = tls_trouble
        self._post = post  # queues an event for the main thread (safe from any thread)
        self._generation = generation  # the machine's current worker generation
        self._closing = closing
        self.heartbeat_interval = settings.job.heartbeat_interval_s
        self.last_contact = time.monotonic()
        #: A final refusal a background thread got (e.g. 403: another agent has this node id): the next
        #: call of the main thread fails with it, even while it is retrying.
        self.final_refusal: Rejected | None = None

    def check_job(self) -> JobInfo:
        """The master's job settings; an :class:`AgentError` when this agent's --nnodes disagrees."""
        info = self.client.info()
        self.heartbeat_interval = info.heartbeat_interval_s
        want = self.settings.job
        if (info.min_nodes, info.max_nodes) != (want.min_nodes, want.max_nodes):
            raise AgentError(
                f"--nnodes {want.min_nodes}:{want.max_nodes} disagrees with the master of job {info.job_id}, "
                f"which runs {info.min_nodes}:{info.max_nodes}; use the same --nnodes on every node",
                EXIT_CONFIG,
            )
        return info

    # -- contact -------------------------------------------------------------------------------------
    def contact(self) -> None:
        """A master answered."""
        self.last_contact = time.monotonic()
        self.tls_trouble.answered()

    def unreachable(self, generation: int | None = None) -> MasterUnreachable:
        """The event for a failed call: how long no master answered, and the line to stop with."""
        silent = time.monotonic() - self.last_contact
        message = self.tls_trouble.lost(silent, self.settings.master_timeout_s, self.client.addresses)
        return MasterUnreachable(silent, message, generation=generation)

    def refused(self, exc: MasterRejectedError, what: str, generation: int) -> None:
        """A background thread's call was refused: post NodeUnknown (rejoin) or, when final, Rejected."""
        if exc.disposition is Disposition.REJOIN:
            self._post(NodeUnknown(exc.message, generation=generation))
        else:
            self.final_refusal = rejection(exc, what)
            self._post(self.final_refusal)

    # -- calls the main thread waits for -------------------------------------------------------------
    def call(self, call: Callable[[], T], what: str) -> T:
        """``call``, retried (backoff with jitter) while no master answers, and while the error table
        says to retry a refusal (elastic.control.error_table; e.g. 409 duplicate_node: another live agent uses
        this node id), for at most --master-timeout. Raises :class:`CallFailed` otherwise."""
        retry = Backoff(0.1, 2.0)
        refused_since: float | None = None
        timeout = self.settings.master_timeout_s
        while True:
            if self.final_refusal is not None:  # e.g. a heartbeat learnt that another agent has this id
                raise CallFailed(self.final_refusal)
            try:
                reply = call()
                self.contact()
                return reply
            except MasterRejectedError as exc:
                if exc.disposition is Disposition.REJOIN:
                    raise CallFailed(NodeUnknown(exc.message)) from None
                if exc.disposition is Disposition.FINAL:
                    raise CallFailed(rejection(exc, what)) from None
                now = time.monotonic()
                if refused_since is None:
                    refused_since = now
                    log.warning(
                        "master refused the %s (%s: %s); retrying for at most %gs (--master-timeout)",
                        what,
                        exc.code,
                        exc.message,
                        timeout,
                    )
                if now - refused_since > timeout:
                    message = (
                        f"master refused the {what} for {now - refused_since:.0f}s (--master-timeout "
                        f"{timeout:g}s): {exc.message}"
                    )
                    raise CallFailed(Rejected(message, exit_code(exc))) from None
                time.sleep(retry.next())
            except (MasterUnreachableError, MasterTLSError) as exc:
                # TLS too: after the first contact, a certificate that stops verifying may be a failover
                # under way (agent.executor.tls_trouble); the workers train on while it is retried.
                self.tls_trouble.failed(exc)
                silent = time.monotonic() - self.last_contact
                if silent > timeout:
                    if self.tls_trouble.reason is None:
                        raise CallFailed(MasterUnreachable(silent, str(exc))) from None
                    raise CallFailed(self.unreachable()) from None
                time.sleep(retry.next())

    # -- long-poll threads ---------------------------------------------------------------------------
    def start_round_wait(self, generation: int, after: int) -> None:
        """Long-poll (thread ``rendezvous``) for this node's first assignment after round ``after``."""
        threading.Thread(
            target=self._await_assignment, args=(generation, after), name="rendezvous", daemon=True
        ).start()

    def start_watch(self, generation: int, round_number: int) -> None:
        """Long-poll (thread ``watch``) so that a new round is learnt at once, not at the next heartbeat."""
        threading.Thread(
            target=self._watch, args=(generation, round_number), name="watch", daemon=True
        ).start()

    def _current(self, generation: int) -> bool:
        return generation == self._generation() and not self._closing.is_set()

    def _await_assignment(self, generation: int, after: int) -> None:
        retry = Backoff(0.1, min(1.0, self.heartbeat_interval))  # while the master is away
        while self._current(generation):
            try:
                reply = self.client.next_round(self.settings.node_id, after, LONG_POLL_S)
            except MasterRejectedError as exc:
                if exc.disposition is not Disposition.RETRY:
                    self.refused(exc, "rendezvous", generation)
                    return
                self._post(self.unreachable(generation))
                time.sleep(retry.next())
                continue
            except MasterError as exc:
                self.tls_trouble.failed(exc)
                self._post(self.unreachable(generation))
                time.sleep(retry.next())
                continue
            self.contact()
            retry.reset()
            if reply.status == "assigned" and reply.assignment is not None:
                self._post(RoundAssigned(reply.assignment, generation=generation))
                return
            if reply.status == "finished":
                self._post(JobFinished(reply.outcome, generation=generation))
                return

    def _watch(self, generation: int, round_number: int) -> None:
        retry = Backoff(0.1, min(1.0, self.heartbeat_interval))  # while the master is away
        while self._current(generation):
            try:
                reply = self.client.watch(self.settings.node_id, round_number, LONG_POLL_S)
            except MasterRejectedError as exc:
                if exc.disposition is not Disposition.RETRY:
                    self.refused(exc, "watch", generation)
                    return
                time.sleep(self.heartbeat_interval)
                continue
            except MasterError as exc:
                self.tls_trouble.failed(exc)
                self._post(self.unreachable(generation))
                time.sleep(retry.next())
                continue
            self.contact()
            retry.reset()
            if reply.command is not Command.CONTINUE:
                self._post(CommandReceived(reply, generation=generation))
                return


def exit_code(exc: MasterRejectedError) -> int:
    """A configuration problem (token, node id, --nnodes, job id) exits 2, anything else 1."""
    return EXIT_CONFIG if exc.status in (401, 403, 409, 422) else EXIT_FAILED


def rejection(exc: MasterRejectedError, what: str) -> Rejected:
    """The one line an agent stops with when the master refuses a call for good."""
    return Rejected(f"master rejected the {what}: {exc.message}", exit_code(exc))
