"""What an agent prints while it waits for other nodes and when it restarts its workers: the lines as pure
functions of the master's round replies (agent.executor.master_link), when they are due
(:class:`RoundWaitLines`, times passed in), and the figures a real job state machine puts into those
replies (master.job.views.waiting_reply, fake clock). No socket, no sleep."""

from __future__ import annotations

import logging

import job_calls as calls
import pytest
from job_builders import assigned, beat, crash, join, make_job, running

from agent.executor.master_link import (
    LONG_POLL_S,
    WAIT_FIRST_LINE_S,
    WAIT_LINE_INTERVAL_S,
    RoundWaitLines,
    nodes_wait_line,
    restart_line,
)
from elastic.control.protocol import Assignment, Command, NodeState, RoundOpening, RoundReply, RoundStatus
from master.job.views import waiting_reply

pytestmark = pytest.mark.timeout(10)


def waiting(**figures: object) -> RoundReply:
    return RoundReply(status=RoundStatus.WAITING, round=3, **figures)


def opening(**fields: object) -> RoundOpening:
    values: dict = dict(round=4, cause="worker_failure", why="rank 1 failed", charged=True)
    return RoundOpening(**{**values, "restart_count": 2, "max_restarts": 3, **fields})


# -- the lines ----------------------------------------------------------------------------------------------
def test_the_nodes_line_says_how_many_joined_and_what_the_round_waits_for():
    figures = dict(min_nodes=2, max_nodes=4)
    assert nodes_wait_line(waiting(joined=1, **figures)) == (
        "round 3: 1 of 2 nodes joined (min 2, max 4); waiting for 1 more node to reach the minimum 2"
    )
    assert nodes_wait_line(waiting(joined=2, last_call_ends_in_s=1.43, **figures)) == (
        "round 3: 2 of 4 nodes joined (min 2, max 4); last call ends in 1.4 s"
    )
    assert nodes_wait_line(waiting(joined=2, expected_back=1, last_call_ends_in_s=1.0, **figures)) == (
        "round 3: 2 of 3 nodes joined (min 2, max 4); waiting for 1 member of the last round to rejoin"
    )
    assert nodes_wait_line(waiting(joined=1, running_nodes=4, **figures)) == (
        "round 3 runs with 4 nodes; 1 waiting (min 2, max 4); the maximum is reached: this node is a hot "
        "spare and takes a lost node's place"
    )
    assert nodes_wait_line(waiting(joined=1, running_nodes=2, last_call_ends_in_s=0.5, **figures)) == (
        "round 3 runs with 2 nodes; 1 waiting (min 2, max 4); last call ends in 0.5 s, then a larger round "
        "opens"
    )


def test_a_master_without_the_figures_gets_no_nodes_line():
    assert nodes_wait_line(waiting()) is None


def test_the_restart_line_says_the_cause_the_attempt_and_the_budget():
    assert restart_line(opening()) == "restarting workers (attempt 2 of 3 restarts): rank 1 failed"
    change = opening(cause="scale_up", why="admitting waiting nodes n-c", charged=False)
    assert restart_line(change) == "new round 4: admitting waiting nodes n-c (membership change, not charged)"
    spent = opening(charged=False, restart_count=3)
    assert restart_line(spent) == (
        "no restart left (3 of 3 restarts spent): rank 1 failed; the job fails unless a lost node explains "
        "the failure"
    )
    assert restart_line(opening(cause="", why="node check done", charged=False)) == (
        "new round 4: node check done (not charged)"
    )


# -- when they are due ----------------------------------------------------------------------------------
def test_the_first_nodes_line_comes_soon_after_the_wait_began_then_one_per_interval():
    start = 100.0
    lines = RoundWaitLines(start, restarting=False)
    reply = waiting(joined=1, min_nodes=2, max_nodes=3)
    assert lines.poll_timeout(start) == WAIT_FIRST_LINE_S  # the first poll ends when the first line is due
    assert lines.lines(reply, start + 0.8) == []  # answered early (the master spreads its timeouts)
    assert lines.poll_timeout(start + 0.8) == pytest.approx(WAIT_FIRST_LINE_S - 0.8)
    first = start + WAIT_FIRST_LINE_S
    assert [text for _, text in lines.lines(reply, first)] == [nodes_wait_line(reply)]
    assert lines.poll_timeout(first) == min(LONG_POLL_S, WAIT_LINE_INTERVAL_S)
    assert lines.lines(reply, first + WAIT_LINE_INTERVAL_S - 0.01) == []
    assert len(lines.lines(reply, first + WAIT_LINE_INTERVAL_S)) == 1


def test_a_restarting_node_says_why_once_at_its_first_reply():
    lines = RoundWaitLines(0.0, restarting=True, plain="master opened round 4; restarting workers")
    said = lines.lines(waiting(joined=1, min_nodes=2, max_nodes=2, opening=opening()), 0.1)
    assert said == [(logging.WARNING, "restarting workers (attempt 2 of 3 restarts): rank 1 failed")]
    assert lines.lines(waiting(joined=1, min_nodes=2, max_nodes=2, opening=opening()), 0.2) == []


def test_an_older_master_gets_the_plain_restart_line():
    lines = RoundWaitLines(0.0, restarting=True, plain="master opened round 4; restarting workers")
    assert lines.lines(waiting(), 5.0) == [(logging.INFO, "master opened round 4; restarting workers")]
    assert lines.lines(waiting(), 20.0) == [], "no figures: no nodes line either"


def test_a_first_start_says_nothing_about_restarting():
    lines = RoundWaitLines(0.0, restarting=False)
    assignment = Assignment(
        round=2, node_rank=0, nnodes=1, rank_offset=0, world_size=1, master_addr="h", master_port=1,
        restart_count=0, max_restarts=3, opening=opening(cause="scale_up", charged=False),
    )  # fmt: skip
    assert lines.lines(RoundReply(status=RoundStatus.ASSIGNED, assignment=assignment, round=2), 0.1) == []


# -- what a real job puts into its replies -------------------------------------------------------------
def test_a_forming_round_tells_its_waiting_nodes_the_counts_and_the_last_call():
    job = make_job(min_nodes=2, max_nodes=3, last_call_s=5.0)
    join(job, 0.0, "a")
    assert nodes_wait_line(waiting_reply(job, 1.0)) == (
        "round 1: 1 of 2 nodes joined (min 2, max 3); waiting for 1 more node to reach the minimum 2"
    )
    join(job, 2.0, "b")
    assert nodes_wait_line(waiting_reply(job, 5.6)) == (
        "round 1: 2 of 3 nodes joined (min 2, max 3); last call ends in 1.4 s"
    )
    assert waiting_reply(job, 5.6).opening is None, "nothing opened the first round"


def test_a_failure_restart_names_its_cause_and_the_budget_to_every_member():
    job = make_job(min_nodes=2, max_nodes=2, max_restarts=3)
    running(job, 0.0, "a", "b")
    failure = crash(rank=2, local_rank=0, exit_code=None, signal="SIGKILL", message="")
    assert beat(job, "b", 1.0, state=NodeState.FAILED, failure=failure).command is Command.REJOIN
    join(job, 1.1, "a")
    expected = (
        "restarting workers (attempt 1 of 3 restarts): rank 2 (local rank 0 on node b) failed with signal "
        "SIGKILL"
    )
    assert restart_line(waiting_reply(job, 1.2).opening) == expected  # while the round forms
    join(job, 1.2, "b")
    job.tick(1.2)
    for node_id in ("a", "b"):
        assert restart_line(assigned(job, node_id, after=1).opening) == expected


def test_a_lost_node_opens_a_free_round():
    job = make_job(min_nodes=1, max_nodes=2)
    running(job, 0.0, "a", "b")
    calls.leave(job, "b", "pre-empted", 1.0)
    opened = waiting_reply(job, 1.1).opening
    assert opened is not None and not opened.charged and opened.restart_count == 0
    assert restart_line(opened) == "new round 2: node b left (pre-empted) (membership change, not charged)"


def test_a_failure_that_followed_a_lost_node_is_a_free_round():
    job = make_job(min_nodes=1, max_nodes=2, max_restarts=3)
    running(job, 0.0, "a", "b")
    failure = crash(rank=0, local_rank=0, exit_code=1, message="RuntimeError: peer gone\nTraceback ...")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=failure)
    assert waiting_reply(job, 1.1).opening.charged, "charged until a loss explains it"
    calls.leave(job, "b", "", 1.2)
    opened = waiting_reply(job, 1.3).opening
    assert opened is not None and opened.restart_count == 0
    assert restart_line(opened) == (
        "new round 2: rank 0 (local rank 0 on node a) failed with exit code 1: RuntimeError: peer gone; it "
        "followed the loss of node b (membership change, not charged)"
    )
