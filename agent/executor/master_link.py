"""The agent's calls to its master: one poll loop (:meth:`MasterLink.poll`) under a named policy per call,
the calls the executor needs answered, and the long-poll threads.

Nothing here decides what the agent does next. Which failures are retried is the error table's word
(elastic.control.error_table): a ``retry`` refusal and no answer at all are retried; a ``rejoin`` or
``final`` refusal gives up. A failure becomes an event for the machine (agent.machine.decisions):
:class:`~agent.machine.events.NodeUnknown` (404 unknown_node: rejoin), :class:`~agent.machine.events.Rejected`
(a final refusal: the agent stops) or :class:`~agent.machine.events.MasterUnreachable` (how long no master
answered; the machine compares it with ``--master-timeout``). The long-poll threads post their answers,
tagged with their worker generation, and end when that generation is over or the agent closes.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

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
    NoLeaderError,
    describe_answers,
)
from elastic.control.error_table import Disposition, ErrorCode
from elastic.control.protocol import Command, CommandReply, JobInfo, RoundOpening, RoundReply, RoundStatus
from elastic.exit_codes import ExitCode

log = logging.getLogger(__name__)

#: How long one long-poll (round, watch) may wait at the master.
LONG_POLL_S = 20.0

#: Seconds between two lines of an agent that waits (for the master, for other nodes): steady, and far
#: apart enough that a long wait is a few lines, not one a heartbeat.
WAIT_LINE_INTERVAL_S = 10.0
#: How long a leaving node keeps telling the masters that it leaves while every one answers 503
#: not_leader (a takeover under way; an election ends within the lease TTL once etcd answers again): its
#: leave then reaches the new leader, which changes the membership at once, where a node gone silent is
#: declared dead only after the heartbeat timeout, counted from the takeover.
LEAVE_TAKEOVER_WAIT_S = 10.0


def master_wait_line(exc: Exception, waited_s: float, timeout_s: float) -> str:
    """``no answer from A:1 for 12 s; standby B:2 answers 503 not_leader; giving up after --master-timeout
    300 s``: what each master address answered while none leads."""
    answers: dict[str, str] = getattr(exc, "answers", {}) or {}
    parts = []
    for address, answer in answers.items():
        if answer.startswith("no answer"):
            parts.append(f"no answer from {address} for {waited_s:.0f} s")
        elif answer.endswith("not_leader"):
            parts.append(f"standby {address} answers {answer}")
        else:
            parts.append(f"{address} answers {answer}")
    said = "; ".join(parts) or f"no job master answered for {waited_s:.0f} s ({exc})"
    return f"{said}; waiting, giving up after --master-timeout {timeout_s:g} s"


#: A node waiting for its round says so this long after the wait began (well within 5 s), then every
#: :data:`WAIT_LINE_INTERVAL_S`: a round that closes sooner (every member straight back) prints no line.
WAIT_FIRST_LINE_S = 1.0

#: Causes of a round's opening that are worker failures (RoundOpening.cause; master.job.events.Cause).
FAILURE_CAUSES = ("worker_failure", "hang")


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def nodes_wait_line(reply: RoundReply) -> str | None:
    """``round 3: 2 of 3 nodes joined (min 2, max 3); last call ends in 1.4 s``: what a waiting node waits
    for, from a ``waiting`` round reply; None when the master sent no figures (an older master)."""
    joined, low, high = reply.joined, reply.min_nodes, reply.max_nodes
    if joined is None or low is None or high is None:
        return None
    bounds = f"(min {low}, max {high})"
    last_call = reply.last_call_ends_in_s
    if reply.running_nodes is not None:  # a round runs without this node
        head = f"round {reply.round} runs with {_nodes(reply.running_nodes)}; {joined} waiting {bounds}"
        if last_call is not None:
            return f"{head}; last call ends in {last_call:.1f} s, then a larger round opens"
        if reply.running_nodes >= high:
            return f"{head}; the maximum is reached: this node is a hot spare and takes a lost node's place"
        return f"{head}; waiting for enough nodes to enlarge the world (--node-unit)"
    back = reply.expected_back or 0
    if joined < low:
        more = low - joined
        also = f"; {_nodes(back)} of the last round not back yet" if back else ""
        return (
            f"round {reply.round}: {joined} of {low} nodes joined {bounds}; waiting for {more} more "
            f"{'node' if more == 1 else 'nodes'} to reach the minimum {low}{also}"
        )
    if back:
        members = "member" if back == 1 else "members"
        return (
            f"round {reply.round}: {joined} of {joined + back} nodes joined {bounds}; waiting for {back} "
            f"{members} of the last round to rejoin"
        )
    head = f"round {reply.round}: {joined} of {high} nodes joined {bounds}"
    if last_call is not None:
        return f"{head}; last call ends in {last_call:.1f} s"
    return f"{head}; the round closes now"


def restart_line(opening: RoundOpening) -> str:
    """``restarting workers (attempt 2 of 3 restarts): rank 1 ...`` or ``new round 4: admitting waiting
    nodes n-c (membership change, not charged)``: why this node restarts its workers, from the master."""
    budget = f"{opening.restart_count} of {opening.max_restarts} restarts"
    if opening.charged:
        return f"restarting workers (attempt {budget}): {opening.why}"
    if opening.cause in FAILURE_CAUSES:  # a failure the budget could not pay for
        return (
            f"no restart left ({budget} spent): {opening.why}; the job fails unless a lost node explains "
            "the failure"
        )
    free = "membership change, not charged" if opening.cause else "not charged"
    return f"new round {opening.round}: {opening.why} ({free})"


class RoundWaitLines:
    """The lines of a node that waits for its round (times in the poll's clock, passed in): why it
    restarts its workers, once, from the first reply; how the rendezvous stands, :data:`WAIT_FIRST_LINE_S`
    after the wait began, then every :data:`WAIT_LINE_INTERVAL_S`. The round long-poll lasts until the
    next line is due (:meth:`poll_timeout`), so each line reads counts that are fresh.

    ``restarting``: this node ran workers in an earlier round; ``plain``: the line to print when the master
    says nothing about the round's opening (an older master), or None."""

    def __init__(self, started_at: float, restarting: bool, plain: str | None = None) -> None:
        self.next_line_at = started_at + WAIT_FIRST_LINE_S
        self.restarting = restarting
        self.plain = plain
        self.first = True  # no reply yet

    def poll_timeout(self, now: float) -> float:
        """How long the next round long-poll may wait: until the next line is due, at most LONG_POLL_S."""
        return min(LONG_POLL_S, max(0.0, self.next_line_at - now))

    def lines(self, reply: RoundReply, now: float) -> list[tuple[int, str]]:
        """``(level, text)`` of the lines ``reply``, answered at ``now``, calls for."""
        out: list[tuple[int, str]] = []
        if self.first:
            self.first = False
            opening = reply.assignment.opening if reply.assignment is not None else reply.opening
            if opening is not None and self.restarting:
                failure = opening.charged or opening.cause in FAILURE_CAUSES
                out.append((logging.WARNING if failure else logging.INFO, restart_line(opening)))
            elif self.plain is not None:
                out.append((logging.INFO, self.plain))
        if reply.status is RoundStatus.WAITING and now >= self.next_line_at:
            self.next_line_at = now + WAIT_LINE_INTERVAL_S
            line = nodes_wait_line(reply)
            if line is not None:
                out.append((logging.INFO, line))
        return out


T = TypeVar("T")
R = TypeVar("R")


class CallFailed(MasterError):
    """A call the executor needed failed for good; ``event`` says how, for the machine."""

    def __init__(self, event: AgentEvent) -> None:
        super().__init__(event)
        self.event = event


class Clock(Protocol):
    """Time as the poll loop sees it (a fake in tests: no sleep)."""

    def monotonic(self) -> float: ...

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, less when the agent closes meanwhile; True when it closes."""
        ...


@dataclass(frozen=True)
class SystemClock:
    """time.monotonic, and sleeps that end when the agent closes."""

    closing: threading.Event

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, seconds: float) -> bool:
        return self.closing.wait(seconds)


class OnGiveUp(enum.Enum):
    """What a poll does with a failure it does not retry: a ``rejoin`` or ``final`` refusal, or failures
    that lasted past its deadline."""

    RAISE = "raise"  # the caller waits for the answer: raise CallFailed(event)
    POST_AND_END = "post_and_end"  # a long-poll thread: post the event for the machine; the poll ends
    POST_AND_GO_ON = "post_and_go_on"  # the heartbeat: post it and keep beating


@dataclass(frozen=True)
class PollPolicy:
    """How one kind of call to the master repeats and retries (see :meth:`MasterLink.poll`)."""

    what: str  # the call, as messages name it ("join", "heartbeat")
    backoff: tuple[float, float]  # first and longest delay after a failure (doubling, jittered: Backoff)
    #: How long failures may last before the poll gives up (MasterUnreachable, or Rejected for refusals);
    #: None: it never does, and posts each failure as MasterUnreachable: the machine judges the silence.
    deadline_s: float | None = None
    period_s: float = 0.0  # wait before each call (also the first) unless a failure set another delay
    refused_wait_s: float | None = None  # wait after a ``retry`` refusal; None: the backoff
    report_refusals: bool = False  # with no deadline: a ``retry`` refusal is posted as MasterUnreachable too
    #: The errors that mean no master answered (retried); any other error propagates.
    unanswered: tuple[type[MasterError], ...] = (MasterError,)
    on_give_up: OnGiveUp = OnGiveUp.POST_AND_END


class MasterLink:
    """This node's conversation with the job master: contact time, refusals, the poll loop, the long-poll
    threads."""

    def __init__(
        self,
        settings: AgentSettings,
        client: MasterClient,
        tls_trouble: TLSTrouble,
        post: Callable[[AgentEvent], None],
        generation: Callable[[], int],
        closing: threading.Event,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.tls_trouble = tls_trouble
        self._post = post  # queues an event for the main thread (safe from any thread)
        self._generation = generation  # the machine's current worker generation
        self._closing = closing
        self.clock: Clock = clock or SystemClock(closing)
        self.heartbeat_interval = settings.job.heartbeat_interval_s
        self.last_contact = self.clock.monotonic()
        #: A final refusal a background thread got (e.g. 403: another agent has this node id): the next
        #: call of the main thread fails with it, even while it is retrying.
        self.final_refusal: Rejected | None = None
        #: What each master address answered in the newest call that none answered as the leader.
        self.last_answers: dict[str, str] = {}
        self._standbys_said = False  # the "only standbys answer" line was logged since the last contact
        self._silence_said_at: float | None = None  # when the newest "lost the job master" line was logged

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
        now = self.clock.monotonic()
        if self._silence_said_at is not None:
            self._silence_said_at = None
            log.warning("the job master answers again after %.0f s of silence", now - self.last_contact)
        self.last_contact = now
        self.tls_trouble.answered()
        self.last_answers = {}
        if self._standbys_said:
            self._standbys_said = False
            log.info("a job master leads again; the job goes on")

    def unanswered(self, exc: Exception) -> None:
        """A call that no master answered as the leader: remember what each address said, and say once
        when every one of them answered 503 not_leader (up and standing by while none leads: an election
        or a takeover under way, not masters that are gone)."""
        now = self.clock.monotonic()
        if self._silence_said_at is None or now - self._silence_said_at >= WAIT_LINE_INTERVAL_S:
            # At once (the first failed call after an answer: within a heartbeat interval of the loss),
            # then at a steady interval while the silence lasts.
            self._silence_said_at = now
            standbys_first = isinstance(exc, NoLeaderError) and exc.only_standbys and not self._standbys_said
            if not standbys_first:  # that case has its own first line, below
                log.warning(
                    "lost the job master: %s; the workers keep training meanwhile",
                    master_wait_line(exc, now - self.last_contact, self.settings.master_timeout_s),
                )
        if not isinstance(exc, NoLeaderError):
            return
        self.last_answers = exc.answers
        if exc.only_standbys and not self._standbys_said:
            self._standbys_said = True
            log.warning(
                "every job master answers 503 not_leader (%s): they stand by and none leads yet; the "
                "workers keep training while one takes over, for at most --master-timeout %gs",
                ", ".join(exc.answers),
                self.settings.master_timeout_s,
            )

    def unreachable(self, generation: int | None = None) -> MasterUnreachable:
        """The event for a failed call: how long no master answered, and the line to stop with."""
        silent = self.clock.monotonic() - self.last_contact
        message = self.tls_trouble.lost(silent, self.settings.master_timeout_s, self.client.addresses)
        if self.last_answers and self.tls_trouble.reason is None:
            message += f" (last answers: {describe_answers(self.last_answers)})"
        return MasterUnreachable(silent, message, generation=generation)

    # -- the poll loop -------------------------------------------------------------------------------
    def poll(
        self,
        call: Callable[[], T | None],
        policy: PollPolicy,
        on_answer: Callable[[T], R | None],
        *,
        wanted: Callable[[], bool] = lambda: True,
        generation: Callable[[], int | None] = lambda: None,
        post: Callable[[AgentEvent], None] | None = None,
    ) -> R | None:
        """Call ``call`` until ``on_answer`` makes something of an answer (returned), ``wanted`` says the
        poll is over or the agent closes (None), or it gives up (``policy.on_give_up``). ``call`` returns
        None when it had nothing to send this time (no answer to count). Events are tagged with
        ``generation()`` of their attempt and posted with ``post`` (default: the main thread's queue)."""
        post = post or self._post
        backoff = Backoff(*policy.backoff)
        refused_since: float | None = None  # the first ``retry`` refusal in a row (a poll with a deadline)
        delay = policy.period_s
        while True:
            if delay > 0 and self.clock.wait(delay):
                return None  # the agent closes
            if not wanted():
                return None
            delay, tag = policy.period_s, generation()
            if self.final_refusal is not None and policy.on_give_up is OnGiveUp.RAISE:
                raise CallFailed(self.final_refusal)  # e.g. a heartbeat learnt that another agent has this id
            try:
                reply = call()
            except MasterRejectedError as exc:
                if exc.disposition is not Disposition.RETRY:
                    event: AgentEvent = (
                        NodeUnknown(exc.message, generation=tag)
                        if exc.disposition is Disposition.REJOIN
                        else rejection(exc, policy.what)
                    )
                    if self._give_up(event, policy, post):
                        return None
                    continue
                if policy.deadline_s is None:
                    if policy.report_refusals:
                        post(self.unreachable(tag))
                else:
                    now = self.clock.monotonic()
                    if refused_since is None:
                        refused_since = now
                        log.warning(
                            "master refused the %s (%s: %s); retrying for at most %gs (--master-timeout)",
                            policy.what,
                            exc.code,
                            exc.message,
                            policy.deadline_s,
                        )
                    if now - refused_since > policy.deadline_s:
                        message = (
                            f"master refused the {policy.what} for {now - refused_since:.0f}s "
                            f"(--master-timeout {policy.deadline_s:g}s): {exc.message}"
                        )
                        if self._give_up(Rejected(message, exit_code(exc)), policy, post):
                            return None
                        continue
                delay = policy.refused_wait_s if policy.refused_wait_s is not None else backoff.next()
                continue
            except policy.unanswered as exc:
                # TLS too: after the first contact, a certificate that stops verifying may be a failover
                # under way (agent.executor.tls_trouble); the workers train on while it is retried.
                self.tls_trouble.failed(exc)
                self.unanswered(exc)
                delay = backoff.next()
                if policy.deadline_s is None:
                    post(self.unreachable(tag))
                    continue
                silent = self.clock.monotonic() - self.last_contact
                if silent > policy.deadline_s:
                    lost = MasterUnreachable(silent, str(exc)) if self.tls_trouble.reason is None else None
                    if self._give_up(lost or self.unreachable(), policy, post):
                        return None
                continue
            if reply is None:
                continue  # nothing was sent
            self.contact()
            backoff.reset()
            refused_since = None
            result = on_answer(reply)
            if result is not None:
                return result

    def _give_up(self, event: AgentEvent, policy: PollPolicy, post: Callable[[AgentEvent], None]) -> bool:
        """Hand ``event`` on as ``policy`` says; True when the poll ends."""
        if policy.on_give_up is OnGiveUp.RAISE:
            raise CallFailed(event)
        if isinstance(event, Rejected):
            self.final_refusal = event  # the main thread's next call fails with it too
        post(event)
        return policy.on_give_up is OnGiveUp.POST_AND_END

    # -- calls the main thread waits for -------------------------------------------------------------
    def call(self, call: Callable[[], T], what: str) -> T:
        """``call``, retried (backoff with jitter) while no master answers, and while the error table
        says to retry a refusal (e.g. 409 duplicate_node: another live agent uses this node id), for at
        most --master-timeout. Raises :class:`CallFailed` otherwise."""
        policy = PollPolicy(
            what,
            backoff=(0.1, 2.0),
            deadline_s=self.settings.master_timeout_s,
            unanswered=(MasterUnreachableError, MasterTLSError),
            on_give_up=OnGiveUp.RAISE,
        )
        answer = self.poll(call, policy, lambda reply: reply)  # every answer ends it (a reply is never None)
        if answer is None:  # a poll that raises ends with an answer or an error
            raise AssertionError(f"the {what} poll ended without an answer")
        return answer

    def leave(self, call: Callable[[], object]) -> None:
        """Tell the master that this node leaves (``call``): retried while every master answers 503
        not_leader, for at most :data:`LEAVE_TAKEOVER_WAIT_S`; raises the last error otherwise (no master
        at all answers, a refusal, or the takeover took longer)."""
        deadline = self.clock.monotonic() + LEAVE_TAKEOVER_WAIT_S
        delay = 0.1
        while True:
            try:
                call()
                return
            except NoLeaderError as exc:
                left = deadline - self.clock.monotonic()
                if not exc.only_standbys or left <= 0 or self.clock.wait(min(delay, left)):
                    raise
                delay = min(2 * delay, 1.0)

    # -- long-poll threads ---------------------------------------------------------------------------
    def start_round_wait(
        self, generation: int, after: int, restarting: bool = False, plain: str | None = None
    ) -> None:
        """Long-poll (thread ``rendezvous``) for this node's first assignment after round ``after``, saying
        why it waits (:class:`RoundWaitLines`: ``restarting`` and ``plain`` are its)."""
        lines = RoundWaitLines(self.clock.monotonic(), restarting, plain)
        threading.Thread(
            target=self._await_assignment, args=(generation, after, lines), name="rendezvous", daemon=True
        ).start()

    def start_watch(self, generation: int, round_number: int) -> None:
        """Long-poll (thread ``watch``) so that a new round is learnt at once, not at the next heartbeat."""
        threading.Thread(
            target=self._watch, args=(generation, round_number), name="watch", daemon=True
        ).start()

    def _current(self, generation: int) -> bool:
        return generation == self._generation() and not self._closing.is_set()

    def _long_poll_backoff(self) -> tuple[float, float]:
        return (0.1, min(1.0, self.heartbeat_interval))  # while the master is away

    def _await_assignment(self, generation: int, after: int, lines: RoundWaitLines) -> None:
        def answered(reply: RoundReply) -> bool | None:
            for level, text in lines.lines(reply, self.clock.monotonic()):
                log.log(level, "%s", text)
            if reply.status == RoundStatus.ASSIGNED and reply.assignment is not None:
                self._post(RoundAssigned(reply.assignment, generation=generation))
                return True
            if reply.status == RoundStatus.FINISHED:
                self._post(JobFinished(reply.outcome, generation=generation))
                return True
            return None  # still waiting: ask again

        policy = PollPolicy("rendezvous", self._long_poll_backoff(), report_refusals=True)
        node_id = self.settings.node_id
        self.poll(
            lambda: self.client.next_round(node_id, after, lines.poll_timeout(self.clock.monotonic())),
            policy,
            answered,
            wanted=lambda: self._current(generation),
            generation=lambda: generation,
        )

    def _watch(self, generation: int, round_number: int) -> None:
        def answered(reply: CommandReply) -> bool | None:
            if reply.command is Command.CONTINUE:
                return None  # keep watching
            self._post(CommandReceived(reply, generation=generation))
            return True

        policy = PollPolicy("watch", self._long_poll_backoff(), refused_wait_s=self.heartbeat_interval)
        node_id = self.settings.node_id
        self.poll(
            lambda: self.client.watch(node_id, round_number, LONG_POLL_S),
            policy,
            answered,
            wanted=lambda: self._current(generation),
            generation=lambda: generation,
        )


def exit_code(exc: MasterRejectedError) -> int:
    """A configuration problem (token, node id, --nnodes, job id) exits 2, a node excluded as unhealthy
    (flapping, a failed node check) 4, anything else 1."""
    if exc.code == ErrorCode.NODE_EXCLUDED:
        return ExitCode.NODE_UNHEALTHY
    return EXIT_CONFIG if exc.status in (401, 403, 409, 422) else EXIT_FAILED


def rejection(exc: MasterRejectedError, what: str) -> Rejected:
    """The one line an agent stops with when the master refuses a call for good."""
    return Rejected(f"master rejected the {what}: {exc.message}", exit_code(exc))
