"""The restart budget (``master.job.accounting.RestartBudget``): charged on a round's first worker failure,
refunded when a member's loss explains the failure, settled when the restart round closes; then the same
accounting as the job drives it on a fake clock (time passes only through the ``now`` of each call).
"""

from __future__ import annotations

import re

import pytest
from job_builders import HB_TIMEOUT, beat, crash, join, make_job, running

from elastic.control.protocol import NodeState
from master.job.accounting import RestartBudget

pytestmark = pytest.mark.timeout(10)

MEMBERS = ("a", "b", "c")


# -- the component --------------------------------------------------------------------------------------
def test_a_failure_charges_one_restart_once_per_round():
    budget = RestartBudget(max_restarts=3)
    pending = budget.charge(1, MEMBERS, "rank 0 failed", reporter="a")
    assert pending is not None and pending.counted and pending.members == frozenset(MEMBERS)
    assert budget.spent == 1 and budget.pending is pending and budget.charged(1)
    assert budget.charge(1, MEMBERS, "rank 3 failed", reporter="b") is None, "the same round's second report"
    assert budget.spent == 1 and budget.pending is pending


def test_a_settled_failure_stays_charged_and_the_next_round_charges_again():
    budget = RestartBudget(max_restarts=3)
    budget.charge(1, MEMBERS, "rank 0 failed", reporter="a")
    assert budget.settle() is None, "a counted failure does not fail the job"
    assert budget.pending is None and budget.spent == 1
    assert budget.refund("a") is None, "nothing to refund once the round closed"
    assert budget.spent == 1
    budget.charge(2, MEMBERS, "rank 1 failed", reporter="b")
    assert budget.spent == 2


def test_a_members_loss_before_the_close_refunds_the_restart():
    budget = RestartBudget(max_restarts=3)
    budget.charge(1, MEMBERS, "rank 0 failed", reporter="a")
    assert budget.refund("z") is None, "a node of no member's round explains nothing"
    assert budget.spent == 1
    refunded = budget.refund("b")
    assert refunded is not None and refunded.round == 1 and refunded.counted
    assert budget.spent == 0 and budget.pending is None
    assert budget.settle() is None
    assert budget.charged(1), "the round's failure was judged: its later reports charge nothing"
    assert budget.charge(1, MEMBERS, "rank 2 failed", reporter="c") is None


def test_a_failure_over_the_budget_is_uncounted_and_fails_the_job_at_the_close():
    budget = RestartBudget(max_restarts=1)
    budget.charge(1, MEMBERS, "first", reporter="a")
    budget.settle()
    over = budget.charge(2, MEMBERS, "second", reporter="a")
    assert over is not None and not over.counted and budget.spent == 1, "the budget is never overdrawn"
    unpaid = budget.settle()
    assert unpaid is over and unpaid.cause == "second"
    assert budget.pending is None


def test_a_loss_explains_even_a_failure_over_the_budget():
    budget = RestartBudget(max_restarts=0)
    budget.charge(1, MEMBERS, "rank 0 failed", reporter="a")
    assert budget.spent == 0
    refunded = budget.refund("c")
    assert refunded is not None and not refunded.counted
    assert budget.spent == 0, "an uncounted failure gives nothing back"
    assert budget.settle() is None, "the job goes on: the failure was a membership change"


def test_the_snapshot_keeps_what_was_spent_and_charged_but_no_pending_failure():
    budget = RestartBudget(max_restarts=3)
    budget.charge(1, MEMBERS, "x", reporter="a")
    budget.settle()
    budget.charge(4, MEMBERS, "y", reporter="b")
    data = budget.snapshot()
    assert data == {
        "restart_count": 2,
        "round_failed": [1, 4],
        "rollbacks_charged": [],  # master.job.findings: test_integrity_findings.py
        "crash_loop": {"series": None, "verdict": ""},  # master.job.crash_loop: test_crash_loop.py
    }
    again = RestartBudget.restore(3, data)
    assert again.spent == 2 and again.charged(4) and again.pending is None
    assert RestartBudget.restore(3, {}).spent == 0, "a snapshot written before the budget existed"


# -- as the job drives it, on a fake clock ----------------------------------------------------------------
def test_a_failure_that_a_heartbeat_timeout_later_explains_is_refunded():
    """A survivor's collective fails when its peer dies, before the heartbeat timeout says so: charged at
    the report, refunded when the dead verdict comes while the restart round still waits for the peer."""
    job = make_job(min_nodes=1, max_nodes=2, max_restarts=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0)
    beat(job, "b", 1.0)  # b's last heartbeat
    beat(job, "a", 1.5, state=NodeState.FAILED, failure=crash())
    assert job.restart_count == 1, "charged provisionally"
    join(job, 1.6, "a")
    job.tick(1.0 + HB_TIMEOUT - 0.1)
    assert job.restart_count == 1 and "b" in job.nodes, "b is not dead yet"
    beat(job, "a", 1.0 + HB_TIMEOUT)
    job.tick(1.0 + HB_TIMEOUT + 0.1)
    assert "b" not in job.nodes and job.restart_count == 0
    refund = [e for e in job.events if e.kind == "failure_not_counted"]
    assert len(refund) == 1 and refund[0].cause == "node_loss"
    # The summary says the failure was a peer's loss, and how long after the report it was declared dead.
    assert re.search(
        r": explained by the loss of peer node b \(declared dead \d+\.\d s after the failure report\): a "
        r"membership change, not counted",
        refund[0].message,
    ), refund[0].message


def test_a_failure_after_the_restart_round_closed_is_not_refunded_by_a_later_loss():
    job = make_job(min_nodes=1, max_nodes=2, max_restarts=2)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    join(job, 1.1, "a", "b")
    job.tick(1.2)  # every member came back: the restart round closes, the charge is settled
    assert job.restart_count == 1
    beat(job, "a", 1.3)
    beat(job, "a", 1.3 + HB_TIMEOUT)
    job.tick(1.3 + HB_TIMEOUT + 0.1)  # b never heartbeats again: dead, a membership change of its own
    assert "b" not in job.nodes
    assert job.restart_count == 1, "the closed round's failure stays charged"
