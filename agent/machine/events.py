"""The agent machine's vocabulary: the events it is fed and the actions it returns (see
agent.machine.decisions).

Both are closed unions of frozen dataclasses. Every event names its :class:`EventKind`; the executor
(agent.executor.loop) turns what happens (a worker exit, a long-poll's answer, a signal) into one of them and
performs each action in order. Standard library and ``elastic.control.protocol`` types only: the machine and
its tests never touch a thread, a process or a socket. Values the machine only hands back to the executor
(a worker's exit record, a hang verdict) travel as opaque ``object`` fields.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import ClassVar, Protocol

from elastic.control.protocol import Assignment, CommandReply, NodeCheckResult, Outcome


class EventKind(enum.Enum):
    """What happened. Events of a worker generation that is over are dropped (``generation``)."""

    STARTED = "started"  # the executor's first event: how long the warm-start zygote still needs
    LAUNCHER_READY = "launcher_ready"  # the zygote imported torch (or its wait ran out)
    JOINED = "joined"  # the master accepted this node's join
    ROUND_ASSIGNED = "round_assigned"  # the rendezvous long-poll returned this node's assignment
    JOB_FINISHED = "job_finished"  # the rendezvous long-poll returned the job's outcome
    WORKER_EXITED = "worker_exited"  # a worker process exited
    HANG_SEEN = "hang_seen"  # the heartbeat thread judged a running worker hung
    COMMAND_RECEIVED = "command_received"  # a watch or heartbeat reply carried a non-continue command
    MASTER_REPLIED = "master_replied"  # the answer to a call the machine asked for (report, serve)
    UNKNOWN_NODE = "unknown_node"  # the master answered 404 unknown_node: it forgot this node
    MASTER_UNREACHABLE = "master_unreachable"  # a call to the master failed; how long it has been silent
    REJECTED = "rejected"  # the master refused a call for good (or for longer than --master-timeout)
    SIGNAL = "signal"  # a shutdown signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT)
    CHECK_TIMEOUT = "check_timeout"  # the node-check process ran past its time
    CHECK_DONE = "check_done"  # the node-check process's figures were read (or could not be)
    COLLECTIVE_BROKEN = "collective_broken"  # an in-process worker's collective failed (a peer vanished)
    WORKERS_PROBED = "workers_probed"  # whether the live workers can leave their step (in-process recovery)
    PAUSE_SETTLED = "pause_settled"  # the paused workers left their step, or some did not in time


class HangLike(Protocol):
    """What the machine and the hang report read of a hang verdict (agent.observe.hang.Hang, frozen)."""

    @property
    def local_rank(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def stalled_s(self) -> float: ...


@dataclass(frozen=True)
class Event:
    """Base of every event. ``generation`` is the worker generation it belongs to; None: any."""

    kind: ClassVar[EventKind]


@dataclass(frozen=True)
class Started(Event):
    kind: ClassVar[EventKind] = EventKind.STARTED
    warm_up_s: float  # how long the zygote may still take to import torch; 0: join at once
    generation: int | None = None


@dataclass(frozen=True)
class LauncherReady(Event):
    kind: ClassVar[EventKind] = EventKind.LAUNCHER_READY
    generation: int | None = None


@dataclass(frozen=True)
class Joined(Event):
    kind: ClassVar[EventKind] = EventKind.JOINED
    round: int  # the master's current round
    master_id: str
    generation: int | None = None


@dataclass(frozen=True)
class RoundAssigned(Event):
    kind: ClassVar[EventKind] = EventKind.ROUND_ASSIGNED
    assignment: Assignment
    generation: int | None = None


@dataclass(frozen=True)
class JobFinished(Event):
    kind: ClassVar[EventKind] = EventKind.JOB_FINISHED
    outcome: Outcome | None
    generation: int | None = None


@dataclass(frozen=True)
class WorkerExited(Event):
    kind: ClassVar[EventKind] = EventKind.WORKER_EXITED
    local_rank: int
    succeeded: bool
    seen_at: float  # when the exit was seen (time.monotonic): a failure's detection starts there
    exit: object = None  # the executor's exit record (agent.workers.group.WorkerExit), handed back in actions
    generation: int | None = None


@dataclass(frozen=True)
class CollectiveBroken(Event):
    """A worker that recovers in process says its collective failed; it waits, alive, for a new round."""

    kind: ClassVar[EventKind] = EventKind.COLLECTIVE_BROKEN
    local_rank: int
    message: str
    seen_at: float
    generation: int | None = None


@dataclass(frozen=True)
class WorkersProbed(Event):
    """The answer to :class:`ProbeWorkers`: whether this node's live workers can leave their step and be
    kept for the next round (in-process recovery), instead of being stopped."""

    kind: ClassVar[EventKind] = EventKind.WORKERS_PROBED
    local_ranks: tuple[int, ...]  # the live workers
    can_leave: bool  # every one of them runs the in-process API (elastic.run); False when none runs
    failed: str | None = None  # why the last in-process recovery failed (a group could not re-form)
    generation: int | None = None


@dataclass(frozen=True)
class PauseSettled(Event):
    """The answer to :class:`AwaitPaused`: which paused workers are still in their step."""

    kind: ClassVar[EventKind] = EventKind.PAUSE_SETTLED
    waiting: tuple[int, ...]  # local ranks that did not leave their step in time; empty: all left (or exited)
    generation: int | None = None


@dataclass(frozen=True)
class HangSeen(Event):
    kind: ClassVar[EventKind] = EventKind.HANG_SEEN
    hangs: tuple[HangLike, ...]  # the first is the one to report
    generation: int | None = None


@dataclass(frozen=True)
class CommandReceived(Event):
    kind: ClassVar[EventKind] = EventKind.COMMAND_RECEIVED
    reply: CommandReply
    generation: int | None = None


@dataclass(frozen=True)
class MasterReplied(Event):
    kind: ClassVar[EventKind] = EventKind.MASTER_REPLIED
    reply: CommandReply
    generation: int | None = None


@dataclass(frozen=True)
class NodeUnknown(Event):
    kind: ClassVar[EventKind] = EventKind.UNKNOWN_NODE
    message: str
    generation: int | None = None


@dataclass(frozen=True)
class MasterUnreachable(Event):
    kind: ClassVar[EventKind] = EventKind.MASTER_UNREACHABLE
    silent_s: float  # since the last answer of any master
    message: str  # the one line to stop with (it names a TLS failure when there is one)
    generation: int | None = None


@dataclass(frozen=True)
class Rejected(Event):
    kind: ClassVar[EventKind] = EventKind.REJECTED
    message: str
    exit_code: int
    generation: int | None = None  # never stale: a final refusal ends the agent whatever it does


@dataclass(frozen=True)
class SignalReceived(Event):
    kind: ClassVar[EventKind] = EventKind.SIGNAL
    signum: int
    generation: int | None = None  # never stale


@dataclass(frozen=True)
class CheckTimeout(Event):
    kind: ClassVar[EventKind] = EventKind.CHECK_TIMEOUT
    generation: int | None = None


@dataclass(frozen=True)
class CheckDone(Event):
    kind: ClassVar[EventKind] = EventKind.CHECK_DONE
    result: NodeCheckResult
    generation: int | None = None


AgentEvent = (
    Started
    | LauncherReady
    | Joined
    | RoundAssigned
    | JobFinished
    | WorkerExited
    | CollectiveBroken
    | WorkersProbed
    | PauseSettled
    | HangSeen
    | CommandReceived
    | MasterReplied
    | NodeUnknown
    | MasterUnreachable
    | Rejected
    | SignalReceived
    | CheckTimeout
    | CheckDone
)


# -- actions: what the executor does, in the order given ----------------------------------------------
@dataclass(frozen=True)
class Ignored:
    """Nothing to do: the event does not matter in this state (``why`` is logged at debug level)."""

    why: str


@dataclass(frozen=True)
class Note:
    """Log one line (the decision's reason)."""

    text: str
    level: int = logging.INFO


@dataclass(frozen=True)
class StartHeartbeats:
    """Start the heartbeat thread and the progress line (once, when the node first joins)."""


@dataclass(frozen=True)
class AwaitLauncher:
    """Wait (in a thread) for the warm-start zygote, at most ``timeout_s``; then feed LauncherReady."""

    generation: int
    timeout_s: float


@dataclass(frozen=True)
class Join:
    """Reset the heartbeat view and join the master (a call retried until --master-timeout); feed Joined."""

    generation: int


@dataclass(frozen=True)
class AwaitRound:
    """Long-poll (in a thread) for this node's first round after ``after``; feed its answer."""

    generation: int
    after: int


@dataclass(frozen=True)
class StartWorkers:
    """Start this round's workers and the watch long-poll. ``reset_ckpt``: pass ELASTIC_CKPT_RESET.
    ``keep``: the paused workers left their step: send them the round's environment and start processes
    only for the local ranks whose process is gone."""

    generation: int
    assignment: Assignment
    reset_ckpt: bool
    keep: bool = False


@dataclass(frozen=True)
class StartCheck:
    """Start the node-check process, the watch long-poll and the check timer."""

    generation: int
    assignment: Assignment


@dataclass(frozen=True)
class StopWorkers:
    """Stop every worker (TERM, then KILL after --stop-grace); exits from now on belong to ``generation``."""

    generation: int


@dataclass(frozen=True)
class ProbeWorkers:
    """Say whether the live workers can leave their step (each runs the in-process API), and why the last
    in-process recovery failed if it did; feed WorkersProbed."""


@dataclass(frozen=True)
class PauseWorkers:
    """Ask the live workers (``local_ranks``) to leave their step of ``round``: they are kept for the next
    round while the node joins it. Exits from now on belong to ``generation``."""

    generation: int
    round: int
    local_ranks: tuple[int, ...]


@dataclass(frozen=True)
class AwaitPaused:
    """Wait, at most ``timeout_s``, until every paused worker left its step (or exited); feed PauseSettled."""

    timeout_s: float


@dataclass(frozen=True)
class FallBack:
    """In-process recovery failed (``reason``): log it and record ``inprocess_fallback`` for the ``round``
    the workers left; the next start restarts their processes. ``stuck``: the local ranks still in their
    step (their Python stacks are recorded before they are stopped)."""

    round: int
    reason: str
    stuck: tuple[int, ...] = ()


@dataclass(frozen=True)
class StopCheck:
    """Stop the node-check process, keeping the generation (its watch long-poll goes on)."""


@dataclass(frozen=True)
class CollectCheckResult:
    """Read the figures the node-check process wrote (or its root cause); feed CheckDone."""

    exit: object


@dataclass(frozen=True)
class ReportCrash:
    """Report a worker's crash (root cause from its exit record) in a heartbeat; feed the reply."""

    round: int
    exit: object
    seen_at: float


@dataclass(frozen=True)
class ReportBroken:
    """Report an in-process worker's failed collective as its failure (the worker lives on)."""

    round: int
    local_rank: int
    message: str
    seen_at: float


@dataclass(frozen=True)
class ReportHang:
    """Dump the hung workers' stacks, then report the first one's hang in a heartbeat; feed the reply."""

    assignment: Assignment
    hangs: tuple[HangLike, ...]
    seen_at: float  # the stall's beginning: the hung worker's last progress


@dataclass(frozen=True)
class ReportSuccess:
    """Report that every local worker succeeded; feed the reply."""

    round: int


@dataclass(frozen=True)
class ReportCheck:
    """Report the node-check figures (state running) in a heartbeat; feed the reply."""

    round: int
    result: NodeCheckResult


@dataclass(frozen=True)
class Serve:
    """Watch the round (a call, retried) while this agent hosts the master for other nodes; feed the reply."""

    round: int


@dataclass(frozen=True)
class RecordRestart:
    """The master opened ``round``: log it and record the ``restart`` event."""

    round: int


@dataclass(frozen=True)
class Leave:
    """Record ``node_left`` and tell the master this node leaves (best effort)."""

    signum: int


@dataclass(frozen=True)
class Finish:
    """Record ``job_finished``; a failed outcome's summary is the agent's last line."""

    outcome: Outcome | None


@dataclass(frozen=True)
class Excluded:
    """The node check excluded this node: print ``summary`` to stderr."""

    summary: str


@dataclass(frozen=True)
class Exit:
    """The agent ends with ``code``; with ``error``, as an error (one line)."""

    code: int
    error: str | None = None


Action = (
    Ignored
    | Note
    | StartHeartbeats
    | AwaitLauncher
    | Join
    | AwaitRound
    | StartWorkers
    | StartCheck
    | StopWorkers
    | ProbeWorkers
    | PauseWorkers
    | AwaitPaused
    | FallBack
    | StopCheck
    | CollectCheckResult
    | ReportCrash
    | ReportBroken
    | ReportHang
    | ReportSuccess
    | ReportCheck
    | Serve
    | RecordRestart
    | Leave
    | Finish
    | Excluded
    | Exit
)
