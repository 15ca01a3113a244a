"""Unit tests of the agent's decisions (``agent.machine.decisions.AgentMachine``) with a fake clock.

The machine is pure: these tests feed it events and read the actions it returns; no thread, process,
socket or sleep is started (the ``no_io`` fixture makes any of them fail the test). The table test at
tests/unit/agent/test_agent_machine_table.py names the expected actions for every (state, event kind) pair.
"""

from __future__ import annotations

import signal
from typing import get_args

import pytest
from agent_machine_fakes import (
    FAILED,
    MASTER_TIMEOUT,
    NOT_KEPT,
    STOP_GRACE,
    FakeHang,
    assignment,
    checking,
    feed,
    kinds,
    machine,
    no_io,  # noqa: F401 - a fixture
    paused,
    reply,
    training,
)

from agent.machine import events as ev
from agent.machine.decisions import CHECK_TIMEOUT_S, FORGOTTEN, SUCCESS, AgentState
from agent.machine.events import EventKind
from elastic.control.protocol import Command, NodeCheckResult, Outcome

pytestmark = [pytest.mark.timeout(10), pytest.mark.usefixtures("no_io")]


# -- start-up ---------------------------------------------------------------------------------------
def test_a_ready_node_starts_heartbeats_and_joins_at_once() -> None:
    m = machine()
    actions = m.handle(ev.Started(0.0), 0.0)
    assert kinds(actions) == [ev.StartHeartbeats, ev.Join]
    assert actions[1] == ev.Join(m.generation)
    assert m.state is AgentState.JOINING


def test_a_warming_node_joins_only_when_its_zygote_is_ready() -> None:
    m = machine()
    actions = m.handle(ev.Started(42.0), 0.0)
    assert kinds(actions) == [ev.Note, ev.AwaitLauncher]
    wait = actions[1]
    assert wait.timeout_s == 42.0 and m.state is AgentState.WARMING
    assert kinds(m.handle(ev.LauncherReady(generation=wait.generation - 1), 1.0)) == [ev.Ignored]
    assert kinds(m.handle(ev.LauncherReady(generation=wait.generation), 1.0)) == [ev.StartHeartbeats, ev.Join]


def test_a_signal_before_joining_exits_without_leaving() -> None:
    m = machine()
    feed(m, ev.Started(42.0))
    actions = m.handle(ev.SignalReceived(signal.SIGTERM), 1.0)
    assert kinds(actions) == [ev.Note, ev.Exit]
    assert "SIGTERM before joining" in actions[0].text
    assert actions[1] == ev.Exit(128 + signal.SIGTERM)
    assert m.state is AgentState.DONE


# -- rendezvous -------------------------------------------------------------------------------------
def test_a_joined_node_waits_for_a_round_past_its_last_one() -> None:
    m = training(machine(), round_=3)
    feed(m, ev.CommandReceived(reply(Command.REJOIN, 4)), NOT_KEPT)
    actions = m.handle(ev.Joined(4, "m1"), 5.0)
    assert actions[-1] == ev.AwaitRound(m.generation, after=3)
    assert m.state is AgentState.WAITING_ROUND


def test_a_master_that_lost_the_job_state_is_followed_from_its_own_rounds() -> None:
    m = training(machine(), round_=5)
    feed(m, ev.CommandReceived(reply(Command.REJOIN, 6)), NOT_KEPT)
    actions = m.handle(ev.Joined(1, "m2"), 5.0)  # a restarted memory-store master starts at round 1
    assert "lost the job's state" in actions[1].text
    assert actions[-1] == ev.AwaitRound(m.generation, after=0)


def test_an_assignment_starts_the_workers_and_ckpt_reset_applies_to_the_first_start_only() -> None:
    m = machine(ckpt_reset=True)
    feed(m, ev.Started(0.0), ev.Joined(1, "m1"))
    first = m.handle(ev.RoundAssigned(assignment(1)), 1.0)
    assert first == [ev.StartWorkers(m.generation, assignment(1), reset_ckpt=True)]
    feed(m, ev.WorkerExited(0, False, 2.0), ev.MasterReplied(reply(Command.CONTINUE)), NOT_KEPT)
    feed(m, ev.Joined(2, "m1"))
    second = m.handle(ev.RoundAssigned(assignment(2)), 3.0)
    assert second == [ev.StartWorkers(m.generation, assignment(2), reset_ckpt=False)]


def test_a_finished_job_seen_while_waiting_exits_with_its_code() -> None:
    m = machine()
    feed(m, ev.Started(0.0), ev.Joined(1, "m1"))
    assert m.handle(ev.JobFinished(FAILED), 1.0) == [ev.Finish(FAILED), ev.Exit(1)]
    m = machine()
    feed(m, ev.Started(0.0), ev.Joined(1, "m1"))
    assert m.handle(ev.JobFinished(None), 1.0) == [ev.Finish(None), ev.Exit(0)]


def test_a_forgotten_node_rejoins_while_waiting_but_a_refused_join_exits() -> None:
    m = machine()
    feed(m, ev.Started(0.0), ev.Joined(1, "m1"))
    assert kinds(m.handle(ev.NodeUnknown("unknown node"), 1.0)) == [ev.Join]
    actions = m.handle(ev.NodeUnknown("unknown node"), 2.0)
    assert actions == [ev.Exit(1, "master rejected the join: unknown node")]


# -- training ---------------------------------------------------------------------------------------
def test_the_node_succeeds_when_every_local_worker_exited_zero() -> None:
    m = training(machine(nproc=2))
    assert m.handle(ev.WorkerExited(1, True, 1.0), 1.0) == []
    assert m.handle(ev.WorkerExited(1, True, 1.5), 1.5) == []  # the same rank twice is still one
    assert m.handle(ev.WorkerExited(0, True, 2.0), 2.0) == [ev.ReportSuccess(1)]
    assert m.handle(ev.MasterReplied(reply(Command.CONTINUE, 1)), 2.1) == [ev.Finish(SUCCESS), ev.Exit(0)]


def test_a_node_that_hosts_the_master_serves_until_the_job_stops() -> None:
    m = training(machine(nproc=1, hosts_master=True))
    feed(m, ev.WorkerExited(0, True, 1.0))
    assert m.handle(ev.MasterReplied(reply(Command.CONTINUE, 1)), 2.0) == [ev.Serve(1)]
    assert m.handle(ev.MasterReplied(reply(Command.CONTINUE, 1)), 22.0) == [ev.Serve(1)]
    stop = reply(Command.STOP, 1, Outcome(succeeded=True, exit_code=0))
    assert m.handle(ev.MasterReplied(stop), 30.0) == [ev.Finish(stop.outcome), ev.Exit(0)]


def test_a_crash_is_reported_before_the_other_workers_stop() -> None:
    m = training(machine())
    exit_record = object()
    actions = m.handle(ev.WorkerExited(1, False, 7.5, exit_record), 8.0)
    assert actions == [ev.ReportCrash(1, exit_record, seen_at=7.5)]
    assert m.state is AgentState.REPORTING_FAILURE
    generation = m.generation
    assert m.handle(ev.MasterReplied(reply(Command.REJOIN, 2)), 8.1) == [ev.ProbeWorkers()]
    actions = m.handle(NOT_KEPT, 8.1)
    assert kinds(actions) == [ev.StopWorkers, ev.Join]
    assert actions[0].generation == generation + 1  # exits caused by the stop are stale
    assert kinds(m.handle(ev.WorkerExited(0, False, 8.2, generation=generation), 8.2)) == [ev.Ignored]


def test_a_crash_that_spends_the_budget_exits_with_the_jobs_code() -> None:
    m = training(machine())
    feed(m, ev.WorkerExited(1, False, 1.0))
    actions = m.handle(ev.MasterReplied(reply(Command.STOP, 1, FAILED)), 1.1)
    assert kinds(actions) == [ev.StopWorkers, ev.Finish, ev.Exit]
    assert actions[1:] == [ev.Finish(FAILED), ev.Exit(1)]


def test_a_hang_is_reported_from_the_start_of_the_stall() -> None:
    m = training(machine())
    hang = FakeHang(stalled_s=30.0)
    actions = m.handle(ev.HangSeen((hang,)), 100.0)
    assert actions == [ev.ReportHang(assignment(1), (hang,), seen_at=70.0)]
    assert m.state is AgentState.REPORTING_FAILURE


def test_a_new_round_restarts_the_workers_and_a_stop_ends_the_agent() -> None:
    m = training(machine())
    actions = m.handle(ev.CommandReceived(reply(Command.REJOIN, 2)), 1.0)
    assert actions == [ev.RecordRestart(2), ev.ProbeWorkers()]
    assert kinds(m.handle(NOT_KEPT, 1.0)) == [ev.StopWorkers, ev.Join]
    m = training(machine())
    actions = m.handle(ev.CommandReceived(reply(Command.STOP, 1, FAILED)), 1.0)
    assert actions[1:] == [ev.Finish(FAILED), ev.Exit(1)]


def test_a_forgotten_node_stops_its_workers_and_rejoins() -> None:
    m = training(machine())
    actions = m.handle(ev.NodeUnknown("unknown node"), 1.0)
    assert kinds(actions) == [ev.Note, ev.ProbeWorkers]  # training workers may pause instead
    assert actions[0].text == FORGOTTEN
    assert kinds(m.handle(NOT_KEPT, 1.0)) == [ev.StopWorkers, ev.Join]
    m = checking(machine())
    assert kinds(m.handle(ev.NodeUnknown("unknown node"), 1.0)) == [ev.Note, ev.StopWorkers, ev.Join]


def test_the_master_may_stay_silent_until_the_master_timeout() -> None:
    m = training(machine())
    quiet = ev.MasterUnreachable(MASTER_TIMEOUT - 0.1, "no job master answered")
    assert kinds(m.handle(quiet, 29.9)) == [ev.Ignored]
    assert m.state is AgentState.TRAINING
    lost = ev.MasterUnreachable(MASTER_TIMEOUT, "no job master answered for 30s")
    assert m.handle(lost, 30.0) == [ev.Exit(1, "no job master answered for 30s")]


def test_a_final_refusal_ends_the_agent_whatever_its_generation() -> None:
    m = training(machine())
    assert m.handle(ev.Rejected("master rejected the heartbeat: node id taken", 2), 1.0) == [
        ev.Exit(2, "master rejected the heartbeat: node id taken")
    ]


def test_a_shutdown_signal_stops_the_workers_and_leaves() -> None:
    m = training(machine())
    actions = m.handle(ev.SignalReceived(signal.SIGINT), 1.0)
    assert kinds(actions) == [ev.Note, ev.StopWorkers, ev.Leave, ev.Exit]
    assert actions[2:] == [ev.Leave(signal.SIGINT), ev.Exit(128 + signal.SIGINT)]
    assert kinds(m.handle(ev.SignalReceived(signal.SIGTERM), 2.0)) == [ev.Ignored]  # done


def test_every_start_stop_and_join_begins_a_new_generation() -> None:
    m = machine()
    seen = [m.generation]
    for event in (ev.Started(0.0), ev.Joined(1, "m"), ev.RoundAssigned(assignment(1))):
        m.handle(event, 0.0)
        seen.append(m.generation)
    m.handle(ev.CommandReceived(reply(Command.REJOIN, 2)), 1.0)  # a probe of the workers
    seen.append(m.generation)
    m.handle(NOT_KEPT, 1.0)  # stop, then join
    seen.append(m.generation)
    assert seen == [0, 1, 1, 2, 2, 4]
    old = ev.RoundAssigned(assignment(2), generation=3)
    assert kinds(m.handle(old, 2.0)) == [ev.Ignored]
    assert m.state is AgentState.JOINING


# -- in-process recovery ---------------------------------------------------------------------------
def test_live_workers_that_can_leave_their_step_pause_and_are_kept_for_the_next_round() -> None:
    m = training(machine())
    assert m.handle(ev.CommandReceived(reply(Command.REJOIN, 2)), 1.0) == [
        ev.RecordRestart(2),
        ev.ProbeWorkers(),
    ]
    assert m.state is AgentState.LEAVING
    generation = m.generation
    actions = m.handle(ev.WorkersProbed((0, 1), can_leave=True), 1.0)
    assert actions == [ev.PauseWorkers(generation + 1, 1, (0, 1)), ev.Join(generation + 2)]
    # A paused worker's exit belongs to the training generation: not a failure of the next round.
    assert kinds(m.handle(ev.WorkerExited(1, False, 1.5, generation=generation), 1.5)) == [ev.Ignored]
    feed(m, ev.Joined(2, "m1"), now=2.0)
    # The workers have until --stop-grace after the pause to leave their step.
    assert m.handle(ev.RoundAssigned(assignment(2)), 3.0) == [ev.AwaitPaused(1.0 + STOP_GRACE - 3.0)]
    assert m.state is AgentState.PAUSED
    actions = m.handle(ev.PauseSettled(()), 3.1)
    assert actions == [ev.StartWorkers(m.generation, assignment(2), reset_ckpt=False, keep=True)]
    assert m.state is AgentState.TRAINING and m.pause is None


def test_workers_that_do_not_leave_their_step_within_the_stop_grace_restart_their_processes() -> None:
    m = paused(machine(), now=1.0)
    assert m.handle(ev.RoundAssigned(assignment(2)), 10.0) == [ev.AwaitPaused(0.0)]  # the deadline is past
    actions = m.handle(ev.PauseSettled((1,)), 10.0)
    assert kinds(actions) == [ev.FallBack, ev.StopWorkers, ev.StartWorkers]
    assert actions[0] == ev.FallBack(
        1, f"local ranks 1 did not leave their step within {STOP_GRACE:g}s", stuck=(1,)
    ), "the stuck local rank is named: its stack is recorded before the stop"
    assert actions[2] == ev.StartWorkers(m.generation, assignment(2), reset_ckpt=False, keep=False)
    assert m.pause is None


def test_a_group_that_could_not_re_form_falls_back_to_process_restarts() -> None:
    m = training(machine())
    feed(m, ev.WorkerExited(0, False, 1.0), ev.MasterReplied(reply(Command.REJOIN, 2)))
    why = "local rank 1 could not re-form its group: store unreachable"
    actions = m.handle(ev.WorkersProbed((1,), can_leave=True, failed=why), 2.0)
    assert kinds(actions) == [ev.FallBack, ev.StopWorkers, ev.Join]
    assert actions[0] == ev.FallBack(1, why)
    assert m.pause is None


def test_workers_without_the_in_process_api_are_stopped() -> None:
    m = training(machine())
    feed(m, ev.CommandReceived(reply(Command.REJOIN, 2)))
    assert kinds(m.handle(ev.WorkersProbed((0, 1), can_leave=False), 1.0)) == [ev.StopWorkers, ev.Join]
    feed(m, ev.Joined(2, "m1"))
    assert kinds(m.handle(ev.RoundAssigned(assignment(2)), 2.0)) == [ev.StartWorkers]


def test_paused_workers_are_stopped_for_a_node_check_and_by_a_signal() -> None:
    m = paused(machine())
    assert kinds(m.handle(ev.RoundAssigned(assignment(2, check=True)), 2.0)) == [
        ev.StopWorkers,
        ev.StartCheck,
    ]
    assert m.pause is None and m.state is AgentState.CHECKING
    m = paused(machine())
    actions = m.handle(ev.SignalReceived(signal.SIGTERM), 2.0)
    assert kinds(actions) == [ev.Note, ev.StopWorkers, ev.Leave, ev.Exit]


# -- node check -------------------------------------------------------------------------------------
def test_a_check_round_reports_the_figures_and_waits_for_the_verdict() -> None:
    m = checking(machine())
    record = object()
    assert m.handle(ev.WorkerExited(0, True, 1.0, record), 1.0) == [ev.CollectCheckResult(record)]
    generation = m.generation
    result = NodeCheckResult(ok=True, matmul_s=0.01)
    assert m.handle(ev.CheckDone(result), 1.1) == [ev.StopCheck(), ev.ReportCheck(1, result)]
    assert m.generation == generation  # the check round's watch long-poll goes on
    assert m.handle(ev.MasterReplied(reply(Command.CONTINUE, 1)), 1.2) == []
    assert m.state is AgentState.AWAITING_VERDICT
    actions = m.handle(ev.CommandReceived(reply(Command.REJOIN, 2), generation=generation), 5.0)
    assert kinds(actions) == [ev.StopWorkers, ev.Note, ev.Join]
    assert actions[1].text == "node check done; master opened round 2"


def test_a_check_that_runs_too_long_or_hangs_is_a_failed_result() -> None:
    m = checking(machine())
    actions = m.handle(ev.CheckTimeout(), CHECK_TIMEOUT_S)
    expected = NodeCheckResult(ok=False, stage="timeout", error=f"no result within {CHECK_TIMEOUT_S:g}s")
    assert actions == [ev.StopCheck(), ev.ReportCheck(1, expected)]
    m = checking(machine())
    actions = m.handle(ev.HangSeen((FakeHang(reason="stuck in allreduce"),)), 50.0)
    assert actions[1] == ev.ReportCheck(
        1, NodeCheckResult(ok=False, stage="hang", error="stuck in allreduce")
    )


def test_an_excluded_node_exits_with_the_reason() -> None:
    m = checking(machine())
    feed(m, ev.CheckDone(NodeCheckResult(ok=False, stage="matmul")))
    excluded = Outcome(succeeded=False, exit_code=1, summary="node a is 3.0x slower than the median")
    actions = m.handle(ev.MasterReplied(reply(Command.EXCLUDE, 1, excluded)), 2.0)
    assert actions[1:] == [ev.Excluded(excluded.summary), ev.Exit(1)]
    m = checking(machine())
    actions = m.handle(ev.CommandReceived(reply(Command.EXCLUDE, 1)), 2.0)  # no outcome: the default reason
    assert actions[1:] == [ev.Excluded("this node was excluded from the job by the node check"), ev.Exit(1)]


def test_a_stop_during_the_check_ends_the_agent() -> None:
    m = checking(machine())
    actions = m.handle(ev.CommandReceived(reply(Command.STOP, 1, FAILED)), 2.0)
    assert kinds(actions) == [ev.StopWorkers, ev.Finish, ev.Exit]


# -- the vocabulary ---------------------------------------------------------------------------------
def test_every_event_kind_has_exactly_one_event_class() -> None:
    classes = get_args(ev.AgentEvent)
    assert sorted(c.kind.value for c in classes) == sorted(k.value for k in EventKind)


def test_the_executor_performs_every_action() -> None:
    from agent.executor.loop import PERFORMERS

    expected = {a for a in get_args(ev.Action) if a is not ev.Exit}  # Exit ends the executor's loop itself
    assert set(PERFORMERS) == expected
