"""Every (agent state, event kind) pair of agent.machine.decisions, with its expected actions written out.

The table has one row per :class:`AgentState` and, in it, one entry per :class:`EventKind`: the action
types the machine must return for the sample event of that kind, or ``IGNORED`` (the machine returns a
single :class:`~agent.machine.events.Ignored`). A new state or event kind without its entries fails
:func:`test_the_table_names_every_state_and_event_kind`. No thread, process, socket or sleep is started.
"""

from __future__ import annotations

import signal

import pytest
from agent_machine_fakes import (
    FAILED,
    MASTER_TIMEOUT,
    FakeHang,
    assignment,
    feed,
    kinds,
    machine,
    no_io,  # noqa: F401 - a fixture
    reply,
)

from agent.machine import events as ev
from agent.machine.decisions import AgentMachine, AgentState
from agent.machine.events import EventKind
from elastic.control.protocol import Command, NodeCheckResult

pytestmark = [pytest.mark.timeout(10), pytest.mark.usefixtures("no_io")]

S, K = AgentState, EventKind
IGNORED = "ignored"
LEAVE = [ev.Note, ev.StopWorkers, ev.Leave, ev.Exit]  # a shutdown signal once joined
QUIT = [ev.Note, ev.Exit]  # a shutdown signal before joining
FORGET = [ev.Note, ev.StopWorkers, ev.Join]  # the master forgot this node
FORGET_TRAINING = [ev.Note, ev.ProbeWorkers]  # ... while training workers may live: pause or stop them
CHECK_RESULT = [ev.StopCheck, ev.ReportCheck]
VERDICT = [ev.StopWorkers, ev.Note, ev.Join]  # after the check, the master opened the training round
GIVE_UP = [ev.Exit]  # an unreachable master past --master-timeout, a final refusal
START = [ev.StartHeartbeats, ev.Join]

EXPECTED: dict[AgentState, dict[EventKind, list[type] | str]] = {
    S.STARTING: {
        K.STARTED: START, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: IGNORED,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: QUIT, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.WARMING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: START, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: IGNORED,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: QUIT, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.JOINING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: [ev.Note, ev.AwaitRound],
        K.ROUND_ASSIGNED: IGNORED, K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: [ev.Exit],
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.WAITING_ROUND: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: [ev.StartWorkers],
        K.JOB_FINISHED: [ev.Finish, ev.Exit], K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: [ev.Join],
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.TRAINING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: [ev.ReportCrash], K.HANG_SEEN: [ev.ReportHang],
        K.COLLECTIVE_BROKEN: [ev.ReportBroken],
        K.COMMAND_RECEIVED: [ev.RecordRestart, ev.ProbeWorkers], K.MASTER_REPLIED: IGNORED,
        K.UNKNOWN_NODE: FORGET_TRAINING, K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE,
        K.CHECK_TIMEOUT: IGNORED, K.CHECK_DONE: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.REPORTING_FAILURE: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: [ev.ProbeWorkers], K.UNKNOWN_NODE: FORGET_TRAINING,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.LEAVING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: IGNORED,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED, K.WORKERS_PROBED: [ev.PauseWorkers, ev.Join],
        K.PAUSE_SETTLED: IGNORED,
    },
    S.PAUSED: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED, K.WORKERS_PROBED: IGNORED,
        K.PAUSE_SETTLED: [ev.StartWorkers],
    },
    S.REPORTING_SUCCESS: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: [ev.Serve], K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.SERVING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: [ev.Serve], K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.CHECKING: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: [ev.CollectCheckResult], K.HANG_SEEN: CHECK_RESULT,
        K.COMMAND_RECEIVED: VERDICT, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: CHECK_RESULT,
        K.CHECK_DONE: CHECK_RESULT, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.REPORTING_CHECK: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: [], K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.AWAITING_VERDICT: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: VERDICT, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: FORGET,
        K.MASTER_UNREACHABLE: GIVE_UP, K.REJECTED: GIVE_UP, K.SIGNAL: LEAVE, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
    S.DONE: {
        K.STARTED: IGNORED, K.LAUNCHER_READY: IGNORED, K.JOINED: IGNORED, K.ROUND_ASSIGNED: IGNORED,
        K.JOB_FINISHED: IGNORED, K.WORKER_EXITED: IGNORED, K.HANG_SEEN: IGNORED,
        K.COMMAND_RECEIVED: IGNORED, K.MASTER_REPLIED: IGNORED, K.UNKNOWN_NODE: IGNORED,
        K.MASTER_UNREACHABLE: IGNORED, K.REJECTED: IGNORED, K.SIGNAL: IGNORED, K.CHECK_TIMEOUT: IGNORED,
        K.CHECK_DONE: IGNORED, K.COLLECTIVE_BROKEN: IGNORED,
        K.WORKERS_PROBED: IGNORED, K.PAUSE_SETTLED: IGNORED,
    },
}  # fmt: skip


def reach(state: AgentState) -> AgentMachine:
    """A machine (hosting the master, two workers) in ``state``."""
    steps: dict[AgentState, list[ev.AgentEvent]] = {
        S.STARTING: [],
        S.WARMING: [ev.Started(5.0)],
        S.JOINING: [ev.Started(0.0)],
        S.WAITING_ROUND: [ev.Started(0.0), ev.Joined(1, "m")],
        S.TRAINING: [ev.Started(0.0), ev.Joined(1, "m"), ev.RoundAssigned(assignment(1))],
        S.CHECKING: [ev.Started(0.0), ev.Joined(1, "m"), ev.RoundAssigned(assignment(1, check=True))],
        S.DONE: [ev.SignalReceived(signal.SIGTERM)],
    }
    both_succeeded = [ev.WorkerExited(0, True, 1.0), ev.WorkerExited(1, True, 1.0)]
    steps[S.REPORTING_FAILURE] = [*steps[S.TRAINING], ev.WorkerExited(0, False, 1.0)]
    steps[S.REPORTING_SUCCESS] = [*steps[S.TRAINING], *both_succeeded]
    steps[S.SERVING] = [*steps[S.REPORTING_SUCCESS], ev.MasterReplied(reply(Command.CONTINUE, 1))]
    steps[S.LEAVING] = [*steps[S.TRAINING], ev.CommandReceived(reply(Command.REJOIN, 2))]
    paused = [ev.WorkersProbed((0, 1), can_leave=True), ev.Joined(2, "m"), ev.RoundAssigned(assignment(2))]
    steps[S.PAUSED] = [*steps[S.LEAVING], *paused]
    steps[S.REPORTING_CHECK] = [*steps[S.CHECKING], ev.CheckDone(NodeCheckResult(ok=True))]
    steps[S.AWAITING_VERDICT] = [*steps[S.REPORTING_CHECK], ev.MasterReplied(reply(Command.CONTINUE, 1))]
    m = machine(hosts_master=True)
    feed(m, *steps[state])
    assert m.state is state
    return m


def sample(kind: EventKind) -> ev.AgentEvent:
    """One event of ``kind``, of no particular generation (so it counts in any)."""
    samples: dict[EventKind, ev.AgentEvent] = {
        K.STARTED: ev.Started(0.0),
        K.LAUNCHER_READY: ev.LauncherReady(),
        K.JOINED: ev.Joined(1, "m"),
        K.ROUND_ASSIGNED: ev.RoundAssigned(assignment(1)),
        K.JOB_FINISHED: ev.JobFinished(FAILED),
        K.WORKER_EXITED: ev.WorkerExited(0, False, 1.0),
        K.HANG_SEEN: ev.HangSeen((FakeHang(),)),
        K.COMMAND_RECEIVED: ev.CommandReceived(reply(Command.REJOIN, 2)),
        K.MASTER_REPLIED: ev.MasterReplied(reply(Command.CONTINUE, 1)),
        K.UNKNOWN_NODE: ev.NodeUnknown("unknown node"),
        K.MASTER_UNREACHABLE: ev.MasterUnreachable(MASTER_TIMEOUT + 1, "no job master answered"),
        K.REJECTED: ev.Rejected("master rejected the heartbeat", 2),
        K.SIGNAL: ev.SignalReceived(signal.SIGTERM),
        K.CHECK_TIMEOUT: ev.CheckTimeout(),
        K.CHECK_DONE: ev.CheckDone(NodeCheckResult(ok=True)),
        K.COLLECTIVE_BROKEN: ev.CollectiveBroken(1, "Connection closed by peer", 1.0),
        K.WORKERS_PROBED: ev.WorkersProbed((0, 1), can_leave=True),
        K.PAUSE_SETTLED: ev.PauseSettled(()),
    }
    return samples[kind]


def test_the_table_names_every_state_and_event_kind() -> None:
    missing = [
        f"{state.value} x {kind.value}"
        for state in AgentState
        for kind in EventKind
        if kind not in EXPECTED.get(state, {})
    ]
    assert not missing, "pairs without an expected action (or IGNORED) in EXPECTED:\n" + "\n".join(missing)


@pytest.mark.parametrize("kind", list(EventKind), ids=lambda k: k.value)
@pytest.mark.parametrize("state", list(AgentState), ids=lambda s: s.value)
def test_every_state_and_event_kind_has_its_expected_actions(state: AgentState, kind: EventKind) -> None:
    expected = EXPECTED.get(state, {}).get(kind)
    assert expected is not None, f"no expected action for {kind.value} while {state.value}"
    actions = reach(state).handle(sample(kind), 100.0)
    want = [ev.Ignored] if expected == IGNORED else expected
    assert kinds(actions) == want, f"{kind.value} while {state.value}: {actions}"
