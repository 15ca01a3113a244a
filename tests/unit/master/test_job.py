"""Unit tests of the job state machine (``master.job.job.Job``) with a fake clock and the wire request models.

Every transition is also checked in ``job.events``: the server logs those and the status view reads them.
"""

from __future__ import annotations

import job_calls as calls
import pytest
from job_builders import (
    HB_TIMEOUT,
    LAST_CALL,
    assigned,
    beat,
    crash,
    join,
    join_req,
    kinds,
    make_job,
    new_kinds,
    running,
)

from elastic.control.protocol import (
    Command,
    HeartbeatRequest,
    NodeState,
    WorkerFailure,
)
from master.job.errors import SettingsMismatchError, UnknownNodeError
from master.job.job import Job
from master.job.rendezvous import Phase

pytestmark = pytest.mark.timeout(10)


# -- join and assignment --------------------------------------------------------------------------------
def test_join_then_assignment_when_the_round_closes():
    job = make_job()
    join(job, 0.0, "a")
    assert calls.next_round(job, "a", 0) is None, "one node of two: still waiting"
    assert kinds(job) == ["node_joined"]
    version = job.version

    join(job, 0.5, "b")
    assert job.version > version
    assert kinds(job) == ["node_joined", "node_joined", "round_closed"]
    assert "world size 4" in job.events[-1].message

    a, b = assigned(job, "a"), assigned(job, "b")
    assert (a.round, a.node_rank, a.nnodes, a.rank_offset, a.world_size) == (1, 0, 2, 0, 4)
    assert (b.round, b.node_rank, b.nnodes, b.rank_offset, b.world_size) == (1, 1, 2, 2, 4)
    assert (a.master_addr, a.master_port) == ("10.0.0.1", 29500), "node rank 0 hosts the store"
    assert b.master_addr == a.master_addr and b.master_port == a.master_port
    assert a.members == ["a", "b"]
    assert (a.restart_count, a.max_restarts) == (0, 2)
    assert calls.next_round(job, "a", after=1) is None, "no round newer than 1 yet"
    assert job.nodes["a"].state is NodeState.STARTING


def test_next_round_of_an_unknown_node_is_an_error():
    job = make_job()
    join(job, 0.0, "a")
    with pytest.raises(UnknownNodeError):
        calls.next_round(job, "ghost", 0)


# -- heartbeats and commands ----------------------------------------------------------------------------
def test_heartbeat_commands_continue_then_rejoin_after_a_new_round_opens():
    job = make_job(min_nodes=1, max_nodes=3)
    join(job, 0.0, "a")
    job.tick(LAST_CALL)
    assert job.rdzv.phase is Phase.ACTIVE
    assert beat(job, "a", LAST_CALL).command is Command.CONTINUE
    assert job.nodes["a"].state is NodeState.RUNNING

    join(job, 3.0, "b")  # a new node: growth after the last call
    assert beat(job, "b", 3.0, round_=0, state=NodeState.WAITING).command is Command.CONTINUE
    assert beat(job, "a", 3.0, round_=1).command is Command.CONTINUE
    job.tick(3.0 + LAST_CALL - 0.01)
    assert job.rdzv.phase is Phase.ACTIVE

    mark = job.event_count
    job.tick(3.0 + LAST_CALL)
    assert new_kinds(job, mark) == ["round_opened"]
    assert "membership change" in job.events[-1].message
    reply = beat(job, "a", 5.0, round_=1)
    assert (reply.command, reply.round) == (Command.REJOIN, 2)
    assert job.command_for("a", 1).command is Command.REJOIN
    assert job.restart_count == 0, "growth is not a restart"

    join(job, 5.5, "a")
    closed = job.rdzv.current
    assert job.rdzv.phase is Phase.ACTIVE and closed.number == 2
    assert closed.members == ["a", "b"], "the previous member keeps rank 0"
    assert beat(job, "a", 6.0, round_=2).command is Command.CONTINUE
    assert beat(job, "b", 6.0, round_=2).command is Command.CONTINUE
    assert beat(job, "b", 6.0, round_=1).command is Command.REJOIN, "a stale round must rejoin"


def test_heartbeat_of_an_unknown_node_is_an_error():
    job = make_job()
    join(job, 0.0, "a")
    mark = job.event_count
    with pytest.raises(UnknownNodeError):
        beat(job, "ghost", 1.0, round_=0, state=NodeState.WAITING)
    assert job.event_count == mark
    assert "ghost" not in job.nodes


def test_watch_of_a_node_the_master_does_not_know_is_an_error_not_a_rejoin():
    """A master restarted without a durable store is in round 1 (open) and knows no node: a watch from a
    node of the old master's round 1 must learn that (404), not get "rejoin" as if a round had opened."""
    job = make_job()
    join(job, 0.0, "a")
    with pytest.raises(UnknownNodeError):
        calls.watch(job, "ghost", 1)
    running(job, 1.0, "a", "b")
    assert calls.watch(job, "a", 1).command is Command.CONTINUE
    job.tick(1.0 + HB_TIMEOUT + 0.1)  # both silent at once: the master suspects itself and holds
    job.tick(1.0 + 2 * HB_TIMEOUT + 0.2)  # both declared dead: the master forgets them
    with pytest.raises(UnknownNodeError):
        calls.watch(job, "a", 1)


# -- failures and restarts ------------------------------------------------------------------------------
def test_a_worker_failure_opens_a_round_and_costs_one_restart_once_per_round():
    job = make_job()
    running(job, 0.0, "a", "b")
    mark = job.event_count

    reply = beat(job, "a", 1.0, round_=1, state=NodeState.FAILED, failure=crash(rank=1, local_rank=1))
    assert (reply.command, reply.round) == (Command.REJOIN, 2)
    assert job.restart_count == 1
    assert job.rdzv.phase is Phase.OPEN and job.rdzv.round == 2
    assert new_kinds(job, mark) == ["worker_failed", "round_opened"]
    cause = "rank 1 (local rank 1 on node a) failed with exit code 1: RuntimeError: boom"
    assert cause in job.events[-2].message
    assert "restart" in job.events[-1].message

    # b's workers fail too (their peer is gone) before b learns of round 2: not a second restart.
    mark = job.event_count
    reply = beat(job, "b", 1.1, round_=1, state=NodeState.FAILED, failure=crash(rank=2))
    assert reply.command is Command.REJOIN
    assert job.restart_count == 1
    assert new_kinds(job, mark) == []
    assert (job.nodes["a"].failures, job.nodes["b"].failures) == (1, 0)

    join(job, 1.5, "b", "a")
    assert job.rdzv.phase is Phase.ACTIVE, "all members are back: no last-call wait"
    a = assigned(job, "a", after=1)
    assert (a.round, a.node_rank, a.restart_count) == (2, 0, 1)


def test_restart_budget_exhausted_fails_the_job_and_every_node_is_told_to_stop():
    job = make_job(max_restarts=1)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash(rank=0))
    assert job.restart_count == 1 and job.outcome is None
    join(job, 2.0, "a", "b")
    assert job.rdzv.current.number == 2

    mark = job.event_count
    failure = crash(
        rank=3, local_rank=1, exit_code=None, signal="SIGKILL", message="killed by the OOM killer\n"
    )
    reply = beat(job, "b", 3.0, round_=2, state=NodeState.FAILED, failure=failure)
    # The verdict waits for the restart round to close: no member loss explains the failure.
    assert job.outcome is None and reply.command is Command.REJOIN
    join(job, 3.2, "a", "b")
    outcome = job.outcome
    assert outcome is not None and not outcome.succeeded
    assert outcome.exit_code != 0
    assert "rank 3" in outcome.summary and "node b" in outcome.summary
    assert "signal SIGKILL" in outcome.summary
    assert "killed by the OOM killer" in outcome.summary
    assert "max restarts 1" in outcome.summary and "2 attempt(s)" in outcome.summary
    assert job.restart_count == 1, "the budget is not overdrawn"
    # The members' rejoins for the restart round are no events (the same agents back: master.job.job.join).
    expected = ["worker_failed", "round_opened", "job_failed"]
    assert new_kinds(job, mark) == expected
    assert job.events[-1].message == outcome.summary

    for node_id in ("a", "b"):
        for round_ in (0, 1, 2):
            reply = beat(job, node_id, 4.0, round_=round_)
            assert (reply.command, reply.outcome) == (Command.STOP, outcome)
        assert job.command_for(node_id, 2).command is Command.STOP
        finished = calls.next_round(job, node_id, 2)
        assert finished is not None and (finished.status, finished.outcome) == ("finished", outcome)
    assert beat(job, "ghost", 4.0, round_=0).command is Command.STOP, "a stranger learns the job is over"
    status = job.status(4.0)
    assert (status.phase, status.outcome) == ("failed", outcome)

    mark = job.event_count
    job.tick(1000.0)
    assert job.event_count == mark, "a finished job has no more transitions"


def test_zero_restarts_fails_on_the_first_failure_with_exit_code_in_the_summary():
    job = make_job(max_restarts=0)
    running(job, 0.0, "a", "b")
    failure = crash(rank=2, exit_code=3, message="CUDA error: oops")
    beat(job, "b", 1.0, state=NodeState.FAILED, failure=failure)
    join(job, 1.2, "a", "b")
    assert job.outcome is not None and not job.outcome.succeeded
    assert "rank 2" in job.outcome.summary and "exit code 3" in job.outcome.summary
    assert "CUDA error: oops" in job.outcome.summary
    assert job.restart_count == 0
    assert kinds(job)[-1] == "job_failed" and "worker_failed" in kinds(job)


def test_a_hang_is_reported_as_hung():
    job = make_job(max_restarts=0)
    running(job, 0.0, "a", "b")
    beat(
        job,
        "a",
        1.0,
        state=NodeState.FAILED,
        failure=crash(rank=0, exit_code=None, signal="SIGKILL", message="no progress for 60s", kind="hang"),
    )
    join(job, 1.2, "a", "b")
    assert "hung" in job.outcome.summary and "no progress for 60s" in job.outcome.summary


def test_a_failure_without_details_still_names_the_node():
    job = make_job(max_restarts=0)
    running(job, 0.0, "a", "b")
    beat(job, "b", 1.0, state=NodeState.FAILED)
    join(job, 1.2, "a", "b")
    assert "node b" in job.outcome.summary


# -- dead nodes -----------------------------------------------------------------------------------------
def test_a_dead_node_opens_a_round_that_is_not_counted_as_a_restart():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 3.0)
    job.tick(HB_TIMEOUT)
    assert job.rdzv.phase is Phase.ACTIVE, "exactly the timeout is not dead yet"

    mark = job.event_count
    job.tick(HB_TIMEOUT + 0.5)  # b: 4.5 s without a heartbeat; a: 1.5 s
    assert new_kinds(job, mark) == ["node_dead", "round_opened"]
    assert "node b declared dead" in job.events[-2].message
    assert "membership change" in job.events[-1].message
    assert "b" not in job.nodes
    assert job.restart_count == 0
    assert job.rdzv.round == 2 and job.rdzv.phase is Phase.OPEN
    assert beat(job, "a", 5.0, round_=1).command is Command.REJOIN
    with pytest.raises(UnknownNodeError):
        beat(job, "b", 5.0, round_=1)

    join(job, 5.5, "a")
    assert job.rdzv.phase is Phase.ACTIVE, "a is all that is expected back"
    assignment = assigned(job, "a", after=1)
    assert (assignment.round, assignment.world_size, assignment.restart_count) == (2, 2, 0)


def test_a_member_that_dies_while_the_round_is_open_does_not_hold_it():
    job = make_job(min_nodes=2, max_nodes=3, last_call_s=100.0)
    running(job, 0.0, "a", "b", "c")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    assert job.rdzv.round == 2 and job.restart_count == 1
    join(job, 1.5, "a", "b")
    job.tick(2.0)
    assert job.rdzv.phase is Phase.OPEN, "c is expected back and the last call runs for 100 s"

    beat(job, "a", 4.0, round_=0, state=NodeState.WAITING)
    beat(job, "b", 4.0, round_=0, state=NodeState.WAITING)
    mark = job.event_count
    job.tick(HB_TIMEOUT + 0.5)  # c's last heartbeat was at t=0
    # Losing a member before the restart round closes explains the failure: it is refunded.
    assert new_kinds(job, mark) == ["node_dead", "failure_not_counted", "round_closed"]
    assert job.rdzv.round == 2, "no extra round for a node that was not running"
    assert job.rdzv.current.members == ["a", "b"]
    assert job.restart_count == 0


def test_a_waiting_node_that_dies_does_not_disturb_the_running_round():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    join(job, 1.0, "c")  # world is at max: c waits
    beat(job, "a", 5.0)
    beat(job, "b", 5.0)
    mark = job.event_count
    job.tick(5.5)
    assert new_kinds(job, mark) == ["node_dead"]
    assert job.rdzv.round == 1 and job.rdzv.phase is Phase.ACTIVE


def long_poll_answers(job: Job, node_ids: str) -> list:
    """What every node's pending /round (after each round so far) and /watch long-polls would answer now,
    each asked with the node's own secret (an error's class name stands for the error)."""
    out = []
    for node_id in node_ids:
        secret = calls.secrets_of(job).get(node_id)
        for call, arg in [(job.next_round, r) for r in range(job.rdzv.round + 1)] + [
            (job.watch, r) for r in range(job.rdzv.round + 1)
        ]:
            try:
                out.append(call(node_id, arg, secret))
            except Exception as exc:  # noqa: BLE001 - the error is the answer
                out.append(type(exc).__name__)
    return out


def test_a_step_wakes_the_long_polls_whenever_an_answer_may_change():
    """The master wakes pending long-polls only when a step's effects say so (``Effects.wake``, and only the
    nodes of ``wake_only`` when it names some): every step that changes an answer must wake its node's
    long-polls, and joins of waiting nodes and progress heartbeats must wake nobody."""
    job = make_job(min_nodes=2, max_nodes=5)
    # (what, step, whether it must wake, the node making the request: its own answers may change, as it
    # has no long-poll pending while it makes it)
    t = 3.0 + 2 * LAST_CALL  # after round 2 opened
    steps = [
        ("a joins", lambda: join(job, 0.0, "a"), False, "a"),
        ("b joins", lambda: join(job, 0.1, "b"), False, "b"),
        ("last call ends: round 1 closes", lambda: job.tick(LAST_CALL + 0.2), True, ""),
        ("a and b run", lambda: [beat(job, n, 2.5) for n in "ab"], False, ""),
        ("c joins (growth after the last call)", lambda: join(job, 3.0, "c"), False, "c"),
        ("progress heartbeats", lambda: [beat(job, n, 3.5) for n in "abc"], False, ""),
        ("growth opens round 2", lambda: job.tick(3.0 + LAST_CALL + 0.1), True, ""),
        ("a rejoins", lambda: join(job, t, "a"), False, "a"),
        ("b rejoins: the previous members are back, round 2 closes", lambda: join(job, t, "b"), True, "b"),
        ("all run", lambda: [beat(job, n, t + LAST_CALL) for n in "abc"], False, ""),
        ("d joins (growth pending)", lambda: join(job, t + LAST_CALL, "d"), False, "d"),
        ("members beat, d goes silent", lambda: [beat(job, n, t + HB_TIMEOUT) for n in "abc"], False, ""),
        ("d declared dead", lambda: job.tick(t + LAST_CALL + HB_TIMEOUT + 0.1), True, ""),
        ("c fails", lambda: beat(job, "c", t + 7, state=NodeState.FAILED, failure=crash()), True, "c"),
    ]
    job.take_effects()
    for what, step, wakes, requester in steps:
        others = "".join(n for n in "abcd" if n != requester)
        before = {n: long_poll_answers(job, n) for n in others}
        step()
        effects = job.take_effects()
        assert effects.wake is wakes, what
        woken = set(others) if effects.wake_only is None else effects.wake_only if effects.wake else set()
        for node in set(others) - woken:
            assert long_poll_answers(job, node) == before[node], f"{what}: {node}'s answer changed unwoken"


def test_a_node_whose_connection_closed_is_dead_after_two_intervals_unless_it_beats():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    mark = job.event_count
    calls.connection_lost(job, "a", 1.0)
    calls.connection_lost(job, "b", 1.0)
    calls.connection_lost(job, "zz", 1.0)  # not a node of the job: nothing to do
    assert new_kinds(job, mark) == ["node_suspect", "node_suspect"]
    beat(job, "b", 2.0)  # b lives
    job.tick(3.0)
    assert "a" in job.nodes, "not before two heartbeat intervals"
    mark = job.event_count
    job.tick(3.01)
    assert new_kinds(job, mark) == ["node_dead", "round_opened"]
    assert "after closing its connection" in job.events[-2].message
    assert set(job.nodes) == {"b"}


@pytest.mark.parametrize("report_first", [False, True], ids=["closed-then-report", "report-then-closed"])
def test_a_closed_connection_and_another_members_failure_report_make_a_verdict_at_once(report_first: bool):
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    steps = [
        lambda: calls.connection_lost(job, "b", 1.0),
        lambda: beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash()),  # a's collective broke
    ]
    for step in reversed(steps) if report_first else steps:
        step()
    assert job.restart_count == 1, "provisional until the loss explains it"
    mark = job.event_count
    job.tick(1.01)  # not two heartbeat intervals later
    assert "node_dead" in new_kinds(job, mark)
    assert set(job.nodes) == {"a"}
    assert job.restart_count == 0, "the failure followed b's loss: a membership change"


def test_a_failure_report_alone_is_no_verdict_on_anybody():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    beat(job, "b", 1.0)
    job.tick(1.5)
    assert set(job.nodes) == {"a", "b"}
    calls.connection_lost(job, "a", 1.6)  # the reporter's own closed connection corroborates nothing
    job.tick(1.7)
    assert set(job.nodes) == {"a", "b"}


def hung(rank: int = 0) -> WorkerFailure:
    return crash(rank, exit_code=None, message="no progress for 2.1s", kind="hang")


@pytest.mark.parametrize("silent_at_report", [True, False], ids=["silent-at-the-report", "silent-after-it"])
def test_a_stall_and_a_members_silence_name_the_silent_member_dead_before_its_timeout(silent_at_report: bool):
    """A partitioned node stalls its peers' collective and stops heartbeating: a survivor's hang report
    and that silence (two heartbeat intervals) declare it dead at once, and the report is explained by
    the loss (the chaos run's finding 7: the survivor was named hung, the node dead only at 4 s)."""
    job = make_job(min_nodes=1, max_nodes=3)
    running(job, 0.0, "a", "b", "c")
    beat(job, "a", 1.0)
    beat(job, "c", 1.0)  # b's last heartbeat stays at 0.0
    report_at = 2.5 if silent_at_report else 1.5
    beat(job, "a", report_at, state=NodeState.FAILED, failure=hung())
    beat(job, "c", report_at)
    assert job.restart_count == 1, "provisional until the loss explains it"
    job.tick(2.5)
    job.tick(2.6)  # the next tick (ten a second) declares what the one before suspected
    assert set(job.nodes) == {"a", "c"}, f"declared long before the {HB_TIMEOUT:g}s timeout"
    suspect = [e.message for e in job.events if e.kind == "node_suspect"]
    assert suspect == ["node b was silent for 2.5s and node a reported a failure: declared dead now"]
    dead = [e.message for e in job.events if e.kind == "node_dead"]
    assert dead == ["node b declared dead (no heartbeat for 2.6s while its peers stalled)"]
    assert job.restart_count == 0, "the stall followed b's loss: a membership change"


def test_a_crash_report_and_a_silent_member_wait_for_its_timeout():
    """A crash (a worker exited) is not a stall: a silent peer is not its cause, nor a verdict on it."""
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 2.5, state=NodeState.FAILED, failure=crash())
    job.tick(2.6)
    assert set(job.nodes) == {"a", "b"}


def test_a_stall_with_every_member_heard_names_nobody():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    beat(job, "b", 1.0)
    beat(job, "a", 2.5, state=NodeState.FAILED, failure=hung())
    beat(job, "b", 2.0)
    job.tick(2.9)
    assert set(job.nodes) == {"a", "b"}, "b heartbeats: the stall alone is no verdict"
    assert job.restart_count == 1


def test_a_closed_connection_of_a_finished_node_or_job_is_not_suspect():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.SUCCEEDED)
    mark = job.event_count
    calls.connection_lost(job, "a", 1.5)  # its agent exits after success
    assert new_kinds(job, mark) == []
    beat(job, "b", 2.0, state=NodeState.SUCCEEDED)
    assert job.outcome is not None and job.outcome.succeeded
    mark = job.event_count
    calls.connection_lost(job, "b", 2.5)
    assert new_kinds(job, mark) == []


def ckpt_beat(job: Job, node_id: str, now: float, step: int):
    req = HeartbeatRequest(node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING, ckpt_step=step)
    return calls.heartbeat(job, req, now)


def test_committed_step_is_the_members_common_step_computed_in_tick_and_before_a_round_opens():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    ckpt_beat(job, "a", 0.1, 5)
    ckpt_beat(job, "b", 0.1, 4)
    assert job.committed_step is None, "a heartbeat does not scan the members (O(N) each)"
    job.tick(1.0)
    assert job.committed_step == 4
    ckpt_beat(job, "a", 1.1, 6)
    ckpt_beat(job, "b", 1.1, 6)
    calls.leave(job, "b", "", 1.2)  # opens a round before the next aggregate refresh: 6 is not lost
    assert job.committed_step == 6
    join(job, 1.3, "a")
    job.tick(1.3 + LAST_CALL)
    assert assigned(job, "a").committed_step == 6


# -- leaving ---------------------------------------------------------------------------------------------
def test_orderly_leave_is_a_membership_change():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    mark = job.event_count
    calls.leave(job, "b", "agent received SIGTERM", 1.0)
    assert new_kinds(job, mark) == ["node_left", "round_opened"]
    assert "SIGTERM" in job.events[-2].message
    assert job.restart_count == 0
    assert "b" not in job.nodes
    assert beat(job, "a", 1.5, round_=1).command is Command.REJOIN
    with pytest.raises(UnknownNodeError):
        calls.leave(job, "b", "", 2.0)
    join(job, 2.0, "a")
    assert job.rdzv.current.members == ["a"] and job.rdzv.current.number == 2


def test_a_waiting_node_that_leaves_does_not_open_a_round():
    job = make_job(min_nodes=2, max_nodes=3)
    join(job, 0.0, "a", "b")
    calls.leave(job, "b", "", 1.0)
    job.tick(LAST_CALL + 1)
    assert job.rdzv.phase is Phase.OPEN, "one node below min_nodes"
    assert kinds(job) == ["node_joined", "node_joined", "node_left"]


# -- success -------------------------------------------------------------------------------------------
def test_all_members_succeed_and_a_finished_node_is_not_declared_dead():
    job = make_job()
    running(job, 0.0, "a", "b")
    mark = job.event_count
    reply = beat(job, "a", 1.0, state=NodeState.SUCCEEDED)
    assert reply.command is Command.CONTINUE, "the job is not over while b still trains"
    assert new_kinds(job, mark) == ["node_succeeded"]
    assert job.outcome is None

    # a stops heartbeating after it finished; b keeps training far beyond a's heartbeat timeout.
    for t in range(2, 20):
        beat(job, "b", float(t))
        job.tick(float(t))
    assert "node_dead" not in kinds(job)
    assert "a" in job.nodes and job.outcome is None

    mark = job.event_count
    reply = beat(job, "b", 20.0, state=NodeState.SUCCEEDED)
    assert new_kinds(job, mark) == ["node_succeeded", "job_succeeded"]
    assert job.outcome is not None and job.outcome.succeeded and job.outcome.exit_code == 0
    assert (reply.command, reply.outcome) == (Command.STOP, job.outcome)
    assert job.command_for("a", 1).command is Command.STOP
    assert job.status(21.0).phase == "succeeded"


def test_a_failure_after_another_node_finished_fails_the_job():
    job = make_job()
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.SUCCEEDED)
    beat(job, "b", 2.0, state=NodeState.FAILED, failure=crash(rank=2))
    assert job.outcome is not None and not job.outcome.succeeded
    assert "after other nodes had finished" in job.outcome.summary
    assert kinds(job)[-2:] == ["worker_failed", "job_failed"]


def test_repeated_success_heartbeats_are_not_new_transitions():
    # The agent that hosts the master keeps heartbeating SUCCEEDED while it waits for the other nodes.
    job = make_job()
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.SUCCEEDED)
    mark, version = job.event_count, job.version
    beat(job, "a", 2.0, state=NodeState.SUCCEEDED)
    beat(job, "a", 3.0, state=NodeState.SUCCEEDED)
    assert new_kinds(job, mark) == []
    assert job.version == version


# -- join timeout and settings ---------------------------------------------------------------------------
def test_join_timeout_fails_the_job_with_a_clear_summary():
    job = make_job(min_nodes=2, max_nodes=2, join_timeout_s=30.0)
    join(job, 0.0, "a")
    for t in range(1, 30):
        beat(job, "a", float(t), round_=0, state=NodeState.WAITING)
        job.tick(float(t))
    assert job.outcome is None
    job.tick(30.0)
    outcome = job.outcome
    assert outcome is not None and not outcome.succeeded and outcome.exit_code != 0
    assert "rendezvous timed out after 30s" in outcome.summary
    assert "1 node(s) joined" in outcome.summary and "at least 2 needed" in outcome.summary
    assert kinds(job)[-1] == "job_failed"
    assert beat(job, "a", 31.0, round_=0, state=NodeState.WAITING).command is Command.STOP
    assert calls.next_round(job, "a", 0).status == "finished"


def test_join_with_different_nnodes_is_rejected():
    job = make_job(min_nodes=2, max_nodes=4)
    with pytest.raises(SettingsMismatchError) as info:
        calls.join(job, join_req(job, "a", min_nodes=1, max_nodes=4), 0.0)
    assert "1:4" in str(info.value) and "2:4" in str(info.value)
    with pytest.raises(SettingsMismatchError):
        calls.join(job, join_req(job, "a", min_nodes=2, max_nodes=3), 0.0)
    assert job.nodes == {} and kinds(job) == []


def test_join_after_the_job_finished_changes_nothing():
    job = make_job(max_restarts=0)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    join(job, 1.2, "a", "b")
    assert job.outcome is not None
    mark = job.event_count
    calls.join(job, join_req(job, "c"), 2.0)
    assert job.event_count == mark and "c" not in job.nodes


# -- agent restart ---------------------------------------------------------------------------------------
def test_a_member_rejoining_while_active_opens_a_membership_change_round():
    job = make_job()
    running(job, 0.0, "a", "b")
    mark = job.event_count
    join(job, 1.0, "a")  # a's agent restarted and joins afresh
    assert new_kinds(job, mark) == ["node_joined", "round_opened"]
    assert "membership change" in job.events[-1].message and "rejoined" in job.events[-1].message
    assert job.restart_count == 0
    assert job.rdzv.round == 2 and job.rdzv.phase is Phase.OPEN
    assert beat(job, "b", 1.5, round_=1).command is Command.REJOIN
    join(job, 2.0, "b")
    assert job.rdzv.phase is Phase.ACTIVE
    assert job.rdzv.current.members == ["a", "b"], "ranks are kept"
    assert assigned(job, "b", after=1).round == 2


# -- status view -----------------------------------------------------------------------------------------
def test_status_rows():
    job = make_job()
    status = job.status(0.0)
    assert (status.job_id, status.phase, status.round, status.world_size, status.nodes) == (
        "job-1",
        "rendezvous",
        1,
        0,
        [],
    )

    join(job, 0.0, "a")
    join(job, 1.0, "b", nproc=3)
    beat(job, "a", 2.0)
    status = job.status(2.5)
    assert (status.phase, status.round, status.world_size, status.nnodes) == ("training", 1, 5, 2)
    assert (status.restart_count, status.max_restarts, status.outcome) == (0, 2, None)
    rows = {row.node_id: row for row in status.nodes}
    assert (rows["a"].rank, rows["a"].state, rows["a"].restarts, rows["a"].round) == (0, "running", 0, 1)
    assert (rows["b"].rank, rows["b"].state, rows["b"].nproc) == (1, "starting", 3)
    assert rows["b"].host == "10.0.0.2"
    assert rows["a"].heartbeat_age_s == pytest.approx(0.5)
    assert rows["b"].heartbeat_age_s == pytest.approx(1.5), "the join counts as a heartbeat"

    beat(job, "b", 3.0, state=NodeState.FAILED, failure=crash(rank=2))
    status = job.status(3.0)
    assert (status.phase, status.round, status.world_size, status.nnodes, status.restart_count) == (
        "rendezvous",
        2,
        0,
        0,
        1,
    )
    rows = {row.node_id: row for row in status.nodes}
    assert rows["b"].restarts == 1 and rows["a"].restarts == 0
    assert rows["a"].rank is None and rows["b"].rank is None, "no ranks while the round is open"
    assert rows["b"].state == "failed"


def test_one_failure_costs_one_restart_even_when_a_member_is_slow_to_stop():
    # min_nodes=1: a's worker crashes; a rejoins at once, b needs 3 s (its workers ignore SIGTERM while
    # they wait in a collective; the agent's stop grace is 5 s) but keeps heartbeating all along.
    job = make_job(min_nodes=1, max_nodes=2, max_restarts=3)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    join(job, 1.0, "a")
    for t in (1.5, 2.0, 2.5, 3.0, 3.5):
        beat(job, "b", t, round_=1)
        beat(job, "a", t, round_=0, state=NodeState.WAITING)
        job.tick(t)
    join(job, 4.0, "b")
    job.tick(4.0)
    assert job.rdzv.current.number == 2 and job.rdzv.current.members == ["a", "b"]
    assert job.rdzv.phase is Phase.ACTIVE


def test_no_growth_round_once_a_member_has_finished():
    job = make_job(min_nodes=1, max_nodes=3)
    join(job, 0.0, "a", "b")
    job.tick(LAST_CALL)
    assert job.rdzv.current.members == ["a", "b"]
    beat(job, "b", 3.0)
    beat(job, "a", 3.0, state=NodeState.SUCCEEDED)
    join(job, 3.0, "c")  # a new node arrives while b finishes its last steps
    for t in (4.0, 5.0, 6.0):
        assert beat(job, "b", t, round_=1).command is Command.CONTINUE, "b must be left to finish"
        beat(job, "c", t, round_=0, state=NodeState.WAITING)
        job.tick(t)
    beat(job, "b", 7.0, round_=1, state=NodeState.SUCCEEDED)
    assert job.outcome is not None and job.outcome.succeeded


def test_a_failure_caused_by_a_dying_peer_is_a_membership_change_not_a_restart():
    """The survivors' collectives fail before the heartbeat timeout declares the peer dead."""
    job = make_job(min_nodes=1, max_nodes=3, max_restarts=2)
    running(job, 0.0, "a", "b", "c")
    beat(job, "a", 0.5, state=NodeState.FAILED, failure=crash(rank=0, message="Connection closed by peer"))
    assert job.restart_count == 1, "charged provisionally"
    join(job, 0.6, "a", "b")  # c is dead: it never comes back
    assert job.rdzv.phase is Phase.OPEN, "the round waits for c until its verdict"
    job.tick(0.0 + HB_TIMEOUT + 0.1)
    assert "failure_not_counted" in [e.kind for e in job.events]
    assert job.restart_count == 0
    assert job.rdzv.phase is Phase.ACTIVE and job.rdzv.current.members == ["a", "b"]
    assert assigned(job, "a", after=1).restart_count == 0


def test_with_no_restarts_left_a_node_loss_still_does_not_fail_the_job():
    job = make_job(min_nodes=1, max_nodes=2, max_restarts=0)
    running(job, 0.0, "a", "b")
    beat(job, "a", 0.5, state=NodeState.FAILED, failure=crash(rank=0))
    assert job.outcome is None
    join(job, 0.6, "a")
    job.tick(HB_TIMEOUT + 0.1)
    assert job.outcome is None and job.rdzv.phase is Phase.ACTIVE
    assert job.rdzv.current.members == ["a"]
