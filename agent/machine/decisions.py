"""The agent's decisions as a pure state machine: events in, actions out, time passed in.

:class:`AgentMachine` holds every decision of a node's agent (when to join, start, stop, report, rejoin
or exit, and with which code) and the data they need (the worker generation, the last round, which
workers succeeded). It does no I/O: the executor (agent.executor.loop) feeds it the events of
agent.machine.events and performs the actions it returns, in order. An action that is a call to the
master (join, a report, a serve watch) is answered by the executor feeding the reply (or the call's
failure) back before it reads any other event. Tests drive it with a fake clock
(tests/unit/agent/test_agent_machine.py).

In-process recovery: a node that leaves its round for the next (a new round, a failure reported, the
master forgetting it) first asks the executor whether its live workers can leave their step
(:class:`~agent.machine.events.WorkersProbed`). The machine pauses them when they all can (they are kept
while the node joins), stops them when they cannot, and falls back to process restarts when the last
re-form failed or when they do not leave their step within --stop-grace of the pause
(:class:`~agent.machine.events.PauseSettled`, in state PAUSED, once the next round is assigned).

Worker generations: every worker start, stop, pause, join and zygote wait begins a new generation; an event
tagged with an older one is stale (an exit caused by a stop, a long-poll answer for a round that is over)
and ignored. Signals and final refusals carry no generation: they always count.
"""

from __future__ import annotations

import enum
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.machine.events import (
    Action,
    AgentEvent,
    AwaitLauncher,
    AwaitPaused,
    AwaitRound,
    CheckDone,
    CheckTimeout,
    CollectCheckResult,
    CollectiveBroken,
    CommandReceived,
    EventKind,
    Excluded,
    Exit,
    FallBack,
    Finish,
    HangSeen,
    Ignored,
    JobFinished,
    Join,
    Joined,
    LauncherReady,
    Leave,
    MasterReplied,
    MasterUnreachable,
    NodeUnknown,
    Note,
    PauseSettled,
    PauseWorkers,
    ProbeWorkers,
    RecordRestart,
    Rejected,
    ReportBroken,
    ReportCheck,
    ReportCrash,
    ReportHang,
    ReportSuccess,
    RoundAssigned,
    Serve,
    SignalReceived,
    StartCheck,
    Started,
    StartHeartbeats,
    StartWorkers,
    StopCheck,
    StopWorkers,
    WorkerExited,
    WorkersProbed,
)
from elastic.control.protocol import (
    Assignment,
    Command,
    CommandReply,
    NodeCheckResult,
    NodeCheckStage,
    Outcome,
)

#: The agent gives up on its node-check process (result: ``timeout``) after this long; its collectives
#: time out after CHECK_PG_TIMEOUT_S, so a node that breaks its part makes its peers fail within it.
CHECK_PG_TIMEOUT_S = 60.0
CHECK_TIMEOUT_S = CHECK_PG_TIMEOUT_S + 60.0

SUCCESS = Outcome(succeeded=True, exit_code=0)

FORGOTTEN = (
    "the master no longer knows this node (it was restarted without a durable store, or it declared this "
    "node dead); stopping workers and rejoining"
)


class AgentState(enum.Enum):
    """Where a node's agent is. The lifecycle, start to end::

        STARTING ─► WARMING ─► JOINING ─► WAITING_ROUND ─► TRAINING ─► REPORTING_FAILURE ─► LEAVING ─► JOINING
                 └──────────────►┘              │  │         └─► REPORTING_SUCCESS ─► SERVING ─► DONE
                                                │  └─► PAUSED ─► TRAINING  (its workers paused when it left)
                                                └─► CHECKING ─► REPORTING_CHECK ─► AWAITING_VERDICT ─► JOINING

    TRAINING or REPORTING_FAILURE go to LEAVING when the node leaves its round for the next: the live
    workers pause (kept; JOINING, then PAUSED until they left their step) or stop (JOINING). A command to
    rejoin, or the master forgetting the node, leads from any other working state back to JOINING; a stop
    command, a signal, an unreachable master or a final refusal leads to DONE.
    """

    STARTING = "starting"  # start: nothing fed yet
    WARMING = "warming"  # waiting for the warm-start zygote before joining (running nodes train on)
    JOINING = "joining"  # the join call is under way
    WAITING_ROUND = "waiting_round"  # joined; long-polling for this node's assignment
    TRAINING = "training"  # this round's workers run
    REPORTING_FAILURE = "reporting_failure"  # a crash or hang is being reported (before stopping)
    LEAVING = "leaving"  # leaving the round for the next: can the live workers leave their step?
    PAUSED = "paused"  # the next round is assigned; the paused workers finish leaving their step
    REPORTING_SUCCESS = "reporting_success"  # every local worker succeeded; reporting it
    SERVING = "serving"  # done here, but this agent hosts the master: watching until the job stops
    CHECKING = "checking"  # the node-check process of a check round runs
    REPORTING_CHECK = "reporting_check"  # the check's figures are being reported
    AWAITING_VERDICT = "awaiting_verdict"  # reported; the master judges once every node has
    DONE = "done"  # terminal: an Exit was returned


@dataclass(frozen=True)
class MachineConfig:
    """The settings the decisions depend on."""

    nproc: int  # workers per node: all of them must succeed for the node to succeed
    master_timeout_s: float  # how long the master may stay silent before the agent gives up
    stop_grace_s: float  # --stop-grace: also how long paused workers may take to leave their step
    hosts_master: bool = False  # this agent serves the master for other nodes: it stays until the job ends
    ckpt_reset: bool = False  # --ckpt-reset: the first start (only) ignores saved checkpoints


# Each handler takes the event class of its kind (the table pairs them): Any, as Callable is contravariant.
_Handler = Callable[["AgentMachine", Any, float], list[Action]]


@dataclass(frozen=True)
class Pause:
    """Live workers asked to leave their step of ``round`` (kept for the next round) by ``deadline``."""

    round: int
    deadline: float


class AgentMachine:
    """The agent's decisions: :meth:`handle` an event at time ``now``, get the actions to perform."""

    def __init__(self, config: MachineConfig) -> None:
        self.config = config
        self.state = AgentState.STARTING
        #: The current worker generation; the executor tags its threads' events with it.
        self.generation = 0
        self.after = 0  # the last round this node was assigned: it waits for a later one
        self.assignment: Assignment | None = None  # the round it works in
        self.succeeded: set[int] = set()  # local ranks of this round that exited 0
        self.workers_started = False
        self.pause: Pause | None = None  # the live workers are paused, not stopped: kept at the next start

    # -- the entry point -----------------------------------------------------------------------------
    def handle(self, event: AgentEvent, now: float) -> list[Action]:
        """The actions for ``event`` (seen at ``now``, time.monotonic); an :class:`Ignored` when none."""
        if self.state is AgentState.DONE:
            return [Ignored("the agent is done")]
        if event.generation is not None and event.generation != self.generation:
            return [Ignored(f"stale {event.kind.value} of generation {event.generation}")]
        handler = _TABLE[self.state].get(event.kind)
        if handler is not None:
            return handler(self, event, now)
        common = _COMMON.get(event.kind)
        if common is not None:
            return common(self, event, now)
        return [Ignored(f"{event.kind.value} does not matter while {self.state.value}")]

    # -- helpers -------------------------------------------------------------------------------------
    def _next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def _exit(self, code: int, error: str | None = None) -> list[Action]:
        self.state = AgentState.DONE
        return [Exit(code, error)]

    def _finish(self, outcome: Outcome | None) -> list[Action]:
        return [Finish(outcome), *self._exit(0 if outcome is None else outcome.exit_code)]

    def _stop(self) -> Action:
        self.pause = None  # paused workers are stopped too
        return StopWorkers(self._next_generation())

    def _start(self, assignment: Assignment, keep: bool = False) -> list[Action]:
        reset = self.config.ckpt_reset and not self.workers_started  # a restart restores what was saved
        self.workers_started = True
        self.state = AgentState.TRAINING
        return [StartWorkers(self._next_generation(), assignment, reset, keep)]

    def _leave_round(self, *first: Action) -> list[Action]:
        """Leave this round for the next; the live workers pause or stop once the executor says whether
        they can leave their step (:meth:`_on_probed`)."""
        self.state = AgentState.LEAVING
        return [*first, ProbeWorkers()]

    def _join(self) -> list[Action]:
        self.state = AgentState.JOINING
        return [Join(self._next_generation())]

    def _report(self, state: AgentState, action: Action) -> list[Action]:
        self.state = state
        return [action]

    # -- start-up ------------------------------------------------------------------------------------
    def _on_started(self, event: Started, now: float) -> list[Action]:
        if event.warm_up_s <= 0:
            return [StartHeartbeats(), *self._join()]
        # A join opens a round that stops the running nodes' workers, and this node's could start only
        # once its zygote is ready: so the running nodes keep training while it warms up.
        self.state = AgentState.WARMING
        note = f"joining once the warm-start zygote has imported torch (at most {event.warm_up_s:.0f}s)"
        return [Note(note), AwaitLauncher(self._next_generation(), event.warm_up_s)]

    def _on_launcher_ready(self, event: LauncherReady, now: float) -> list[Action]:
        return [StartHeartbeats(), *self._join()]

    def _on_signal_before_join(self, event: SignalReceived, now: float) -> list[Action]:
        name = signal.Signals(event.signum).name
        return [
            Note(f"received {name} before joining; exiting", logging.WARNING),
            *self._exit(128 + event.signum),
        ]

    # -- rendezvous ----------------------------------------------------------------------------------
    def _on_joined(self, event: Joined, now: float) -> list[Action]:
        notes: list[Action] = [Note(f"joined: waiting for round {event.round} (master {event.master_id})")]
        if event.round <= self.after:
            # Rounds only grow, so the master restarted without its state (memory store): wait for its
            # rounds, not for a round past the last one this node saw.
            text = (
                f"master {event.master_id} is at round {event.round}, not past this node's last round "
                f"{self.after}: it lost the job's state (restarted without a durable store); joining its "
                "rounds afresh"
            )
            notes.append(Note(text, logging.WARNING))
            self.after = event.round - 1
        self.state = AgentState.WAITING_ROUND
        return [*notes, AwaitRound(self.generation, self.after)]

    def _on_join_forgotten(self, event: NodeUnknown, now: float) -> list[Action]:
        return self._exit(1, f"master rejected the join: {event.message}")

    def _on_assigned(self, event: RoundAssigned, now: float) -> list[Action]:
        assignment = self.assignment = event.assignment
        self.after = assignment.round
        self.succeeded = set()
        if assignment.check:
            # A node check runs in a process of its own: paused workers are stopped first.
            stop = [self._stop()] if self.pause is not None else []
            self.state = AgentState.CHECKING
            return [*stop, StartCheck(self._next_generation(), assignment)]
        if self.pause is not None:
            self.state = AgentState.PAUSED  # they had from the pause until its deadline to leave their step
            return [AwaitPaused(max(0.0, self.pause.deadline - now))]
        return self._start(assignment)

    def _on_finished(self, event: JobFinished, now: float) -> list[Action]:
        return self._finish(event.outcome)

    def _on_rejoin(self, event: NodeUnknown, now: float) -> list[Action]:
        return self._join()  # no workers run yet

    # -- training ------------------------------------------------------------------------------------
    def _on_exit(self, event: WorkerExited, now: float) -> list[Action]:
        round_ = self._round()
        if not event.succeeded:
            return self._report(AgentState.REPORTING_FAILURE, ReportCrash(round_, event.exit, event.seen_at))
        self.succeeded.add(event.local_rank)
        if len(self.succeeded) < self.config.nproc:
            return []  # the others still run
        return self._report(AgentState.REPORTING_SUCCESS, ReportSuccess(round_))

    def _on_broken(self, event: CollectiveBroken, now: float) -> list[Action]:
        action = ReportBroken(self._round(), event.local_rank, event.message, event.seen_at)
        return self._report(AgentState.REPORTING_FAILURE, action)

    def _on_hang(self, event: HangSeen, now: float) -> list[Action]:
        # Detection starts at the hung worker's last progress (the stall's beginning).
        seen_at = now - event.hangs[0].stalled_s
        action = ReportHang(self._current(), event.hangs, seen_at)
        return self._report(AgentState.REPORTING_FAILURE, action)

    def _on_training_command(self, event: CommandReceived, now: float) -> list[Action]:
        reply = event.reply
        if reply.command is Command.STOP:
            return [self._stop(), *self._finish(reply.outcome)]
        return self._leave_round(RecordRestart(reply.round))

    # -- in-process recovery -------------------------------------------------------------------------
    def _on_probed(self, event: WorkersProbed, now: float) -> list[Action]:
        if event.failed is not None:
            # A group could not re-form: this time every local rank restarts its process.
            return [FallBack(self._round(), event.failed), self._stop(), *self._join()]
        if not event.can_leave:  # a script without the in-process API (or nothing runs): the usual stop
            return [self._stop(), *self._join()]
        # The node joins the next round while its workers leave their step (at most --stop-grace).
        self.pause = Pause(self._round(), now + self.config.stop_grace_s)
        pause = PauseWorkers(self._next_generation(), self._round(), event.local_ranks)
        return [pause, *self._join()]

    def _on_settled(self, event: PauseSettled, now: float) -> list[Action]:
        pause, assignment = self.pause, self._current()
        if not event.waiting or pause is None:
            self.pause = None
            return self._start(assignment, keep=pause is not None)
        ranks = ", ".join(map(str, event.waiting))
        why = f"local ranks {ranks} did not leave their step within {self.config.stop_grace_s:g}s"
        return [FallBack(pause.round, why, tuple(event.waiting)), self._stop(), *self._start(assignment)]

    # -- outcomes ------------------------------------------------------------------------------------
    def _on_failure_reply(self, event: MasterReplied, now: float) -> list[Action]:
        # Reported before stopping the others, so that the other nodes start stopping in parallel.
        if event.reply.command is Command.STOP:
            return [self._stop(), *self._finish(event.reply.outcome)]
        return self._leave_round()

    def _on_success_reply(self, event: MasterReplied, now: float) -> list[Action]:
        reply = event.reply
        if reply.command is Command.STOP or not self.config.hosts_master:
            return self._finish(reply.outcome or SUCCESS)
        # This agent hosts the master for other nodes: keep serving until the whole job is over.
        return self._report(AgentState.SERVING, Serve(self._round()))

    def _on_serve_reply(self, event: MasterReplied, now: float) -> list[Action]:
        if event.reply.command is Command.STOP:
            return self._finish(event.reply.outcome or SUCCESS)
        return [Serve(self._round())]

    def _on_forgotten(self, event: NodeUnknown, now: float) -> list[Action]:
        # Never keep training in a world the master no longer tracks (split brain).
        return [Note(FORGOTTEN, logging.WARNING), self._stop(), *self._join()]

    def _on_forgotten_training(self, event: NodeUnknown, now: float) -> list[Action]:
        # As _on_forgotten, but live training workers may pause (leave their step) instead of stopping.
        return self._leave_round(Note(FORGOTTEN, logging.WARNING))

    # -- node check ----------------------------------------------------------------------------------
    def _on_check_exit(self, event: WorkerExited, now: float) -> list[Action]:
        return [CollectCheckResult(event.exit)]

    def _on_check_done(self, event: CheckDone, now: float) -> list[Action]:
        return self._check_result(event.result)

    def _on_check_timeout(self, event: CheckTimeout, now: float) -> list[Action]:
        error = f"no result within {CHECK_TIMEOUT_S:g}s"
        return self._check_result(NodeCheckResult(ok=False, stage=NodeCheckStage.TIMEOUT, error=error))

    def _on_check_hang(self, event: HangSeen, now: float) -> list[Action]:
        result = NodeCheckResult(ok=False, stage=NodeCheckStage.HANG, error=event.hangs[0].reason[:2000])
        return self._check_result(result)

    def _check_result(self, result: NodeCheckResult) -> list[Action]:
        # StopCheck, not StopWorkers: the check round's watch long-poll must go on.
        self.state = AgentState.REPORTING_CHECK
        return [StopCheck(), ReportCheck(self._round(), result)]

    def _on_check_reply(self, event: MasterReplied, now: float) -> list[Action]:
        if event.reply.command is Command.CONTINUE:
            self.state = AgentState.AWAITING_VERDICT  # the master decides once every node has reported
            return []
        return self._verdict(event.reply)

    def _on_verdict(self, event: CommandReceived, now: float) -> list[Action]:
        return self._verdict(event.reply)

    def _verdict(self, reply: CommandReply) -> list[Action]:
        stop = self._stop()
        if reply.command is Command.EXCLUDE:
            outcome = reply.outcome
            summary = outcome.summary if outcome else "this node was excluded from the job by the node check"
            return [stop, Excluded(summary), *self._exit(outcome.exit_code if outcome else 1)]
        if reply.command is Command.STOP:
            return [stop, *self._finish(reply.outcome)]
        return [stop, Note(f"node check done; master opened round {reply.round}"), *self._join()]

    # -- in any state --------------------------------------------------------------------------------
    def _on_signal(self, event: SignalReceived, now: float) -> list[Action]:
        name = signal.Signals(event.signum).name
        note = Note(f"received {name}; stopping workers", logging.WARNING)
        return [note, self._stop(), Leave(event.signum), *self._exit(128 + event.signum)]

    def _on_unreachable(self, event: MasterUnreachable, now: float) -> list[Action]:
        if event.silent_s < self.config.master_timeout_s:
            return [Ignored(f"the master has been silent for {event.silent_s:.1f}s only; retrying")]
        return self._exit(1, event.message)

    def _on_rejected(self, event: Rejected, now: float) -> list[Action]:
        return self._exit(event.exit_code, event.message)

    def _round(self) -> int:
        return self.assignment.round if self.assignment is not None else 0

    def _current(self) -> Assignment:
        if self.assignment is None:  # a state that runs workers always has one
            raise RuntimeError(f"no assignment while {self.state.value}")
        return self.assignment


S, K, M = AgentState, EventKind, AgentMachine

#: Per state, the event kinds it acts on; :data:`_COMMON` covers the rest, anything else is ignored.
_TABLE: dict[AgentState, dict[EventKind, _Handler]] = {
    S.STARTING: {K.STARTED: M._on_started, K.SIGNAL: M._on_signal_before_join},
    S.WARMING: {K.LAUNCHER_READY: M._on_launcher_ready, K.SIGNAL: M._on_signal_before_join},
    S.JOINING: {K.JOINED: M._on_joined, K.UNKNOWN_NODE: M._on_join_forgotten},
    S.WAITING_ROUND: {
        K.ROUND_ASSIGNED: M._on_assigned,
        K.JOB_FINISHED: M._on_finished,
        K.UNKNOWN_NODE: M._on_rejoin,
    },
    S.TRAINING: {
        K.WORKER_EXITED: M._on_exit,
        K.COLLECTIVE_BROKEN: M._on_broken,
        K.HANG_SEEN: M._on_hang,
        K.COMMAND_RECEIVED: M._on_training_command,
        K.UNKNOWN_NODE: M._on_forgotten_training,
    },
    S.REPORTING_FAILURE: {K.MASTER_REPLIED: M._on_failure_reply, K.UNKNOWN_NODE: M._on_forgotten_training},
    # The executor answers the probe before any other event: a second reason to leave changes nothing.
    S.LEAVING: {K.WORKERS_PROBED: M._on_probed},
    S.PAUSED: {K.PAUSE_SETTLED: M._on_settled, K.UNKNOWN_NODE: M._on_forgotten},
    S.REPORTING_SUCCESS: {K.MASTER_REPLIED: M._on_success_reply, K.UNKNOWN_NODE: M._on_forgotten},
    S.SERVING: {K.MASTER_REPLIED: M._on_serve_reply, K.UNKNOWN_NODE: M._on_forgotten},
    S.CHECKING: {
        K.WORKER_EXITED: M._on_check_exit,
        K.CHECK_DONE: M._on_check_done,
        K.CHECK_TIMEOUT: M._on_check_timeout,
        K.HANG_SEEN: M._on_check_hang,
        K.COMMAND_RECEIVED: M._on_verdict,
        K.UNKNOWN_NODE: M._on_forgotten,
    },
    S.REPORTING_CHECK: {K.MASTER_REPLIED: M._on_check_reply, K.UNKNOWN_NODE: M._on_forgotten},
    S.AWAITING_VERDICT: {K.COMMAND_RECEIVED: M._on_verdict, K.UNKNOWN_NODE: M._on_forgotten},
    S.DONE: {},
}

#: Events every state but DONE acts on the same way, unless its row says otherwise.
_COMMON: dict[EventKind, _Handler] = {
    K.SIGNAL: M._on_signal,
    K.MASTER_UNREACHABLE: M._on_unreachable,
    K.REJECTED: M._on_rejected,
}
