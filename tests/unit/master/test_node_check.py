"""Node-check verdicts (master.job.node_check) and the check round through master.job.job with a fake clock;
the
settings that configure it."""

from __future__ import annotations

import json

import job_calls as calls
import pytest
from health_jobs import beat, check, join_all, make_job

from elastic.control.job_settings import JobSettings, SettingsError
from elastic.control.protocol import Command, JoinRequest, NodeCheckResult
from master.job.errors import NodeExcludedError
from master.job.job import Job
from master.job.node_check import judge

pytestmark = pytest.mark.timeout(30)


def test_judge_fails_a_local_failure_and_forgives_the_peers_it_broke():
    verdicts = judge(
        {
            "a": check(ok=False, stage="allreduce", error="Connection closed by peer", allreduce=None),
            "b": check(),
            "c": check(ok=False, stage="matmul", error="RuntimeError: injected", matmul=None, allreduce=None),
        },
        factor=3.0,
    )
    assert (
        verdicts["c"].kind == "failed"
        and "check failed at matmul: RuntimeError: injected" in verdicts["c"].reason
    )
    assert verdicts["a"].kind == "ok" and "because node(s) c failed" in verdicts["a"].reason
    assert verdicts["b"].kind == "ok"


def test_judge_fails_collective_failures_when_nobody_failed_locally():
    verdicts = judge(
        {
            "a": check(ok=False, stage="init", error="timeout"),
            "b": check(ok=False, stage="init", error="timeout"),
        },
        factor=3.0,
    )
    assert {v.kind for v in verdicts.values()} == {"failed"}


def test_judge_flags_a_node_slower_than_the_factor():
    verdicts = judge(
        {"a": check(matmul=0.010), "b": check(matmul=0.012), "c": check(matmul=0.040)}, factor=3.0
    )
    assert (
        verdicts["c"].kind == "slow" and "matmul 40.0 ms is 3.3x the median 12.0 ms" in verdicts["c"].reason
    )
    assert verdicts["a"].kind == verdicts["b"].kind == "ok"


def run_check_round(job: Job, now: float, results: dict[str, NodeCheckResult]) -> dict:
    replies = {}
    for node_id in results:
        assert calls.next_round(job, node_id, 0).assignment.check  # the agents learn their check round
    for node_id, result in results.items():
        replies[node_id] = beat(job, node_id, now, node_check=result)
    return replies


def test_the_first_round_is_a_check_round_and_excluded_nodes_are_told_and_left_out():
    job = make_job(node_check="on")
    join_all(job, 0.0, "a", "b", "c")
    reply = calls.next_round(job, "a", 0)
    assert reply.assignment.check is True and reply.assignment.round == 1

    replies = run_check_round(
        job,
        1.0,
        {"a": check(), "b": check(), "c": check(ok=False, stage="matmul", error="RuntimeError: bad")},
    )
    assert replies["a"].command is Command.CONTINUE  # b and c had not reported yet
    assert replies["c"].command is Command.EXCLUDE
    assert "node c was excluded from the job by the node check" in replies["c"].outcome.summary
    assert replies["c"].outcome.exit_code == 4  # this node is unhealthy: replace it (the exit-code table)
    assert calls.watch(job, "c", 1).command is Command.EXCLUDE
    with pytest.raises(NodeExcludedError):
        calls.join(
            job, JoinRequest(node_id="c", host="h", nproc=1, store_port=1, min_nodes=2, max_nodes=3), 2.0
        )
    # The others rejoin: the training round has only a and b, and is no check round.
    assert beat(job, "a", 1.5).command is Command.REJOIN
    join_all(job, 2.0, "a", "b")
    assignment = calls.next_round(job, "b", 1).assignment
    assert assignment.check is False and assignment.members == ["a", "b"] and assignment.restart_count == 0
    status = {n.node_id: n for n in job.status(2.0).nodes}
    assert status["c"].state == "excluded" and status["c"].node_check_verdict.startswith(
        "failed: check failed"
    )
    assert status["a"].node_check.matmul_s == 0.01 and status["a"].node_check_verdict == "ok"
    assert [e.kind for e in job.events if e.kind in ("node_check", "node_excluded")] == [
        "node_check",
        "node_check",
        "node_excluded",
    ]


def test_with_warn_a_failed_node_is_only_reported():
    job = make_job(node_check="warn", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    run_check_round(job, 1.0, {"a": check(), "b": check(ok=False, stage="matmul", error="boom")})
    assert job.node_check.excluded == {}
    join_all(job, 2.0, "a", "b")
    assert calls.next_round(job, "a", 1).assignment.members == ["a", "b"]
    assert any("(warn only)" in e.message and "node b failed" in e.message for e in job.events)


def test_a_check_that_leaves_too_few_nodes_fails_the_job():
    job = make_job(node_check="on", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    run_check_round(job, 1.0, {"a": check(), "b": check(ok=False, stage="crash", error="segfault")})
    assert job.outcome is not None and not job.outcome.succeeded
    assert "1 left, at least 2 needed" in job.outcome.summary


def test_a_node_lost_during_the_check_round_repeats_the_check_with_the_others():
    job = make_job(node_check="on")
    join_all(job, 0.0, "a", "b", "c")
    assert calls.next_round(job, "a", 0).assignment.check
    beat(job, "a", 1.0, node_check=check())
    calls.leave(job, "c", "preempted", 1.5)
    join_all(job, 2.0, "a", "b")
    assignment = calls.next_round(job, "a", 1).assignment
    assert assignment.check and assignment.members == ["a", "b"]
    assert job.node_check.results == {}  # a's result of the abandoned round does not count
    run_check_round(job, 3.0, {"a": check(), "b": check()})
    assert job.node_check.done and beat(job, "a", 3.5).command is Command.REJOIN


def test_node_check_state_survives_a_master_takeover():
    job = make_job(node_check="on", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    calls.next_round(job, "a", 0)
    run_check_round(job, 1.0, {"a": check(), "b": check()})
    restored = Job.restore(job.settings, json.loads(json.dumps(job.snapshot())), now=5.0)
    assert restored.node_check.done and restored.node_check.verdicts["a"].kind == "ok"


def test_settings_reject_a_bad_node_check_mode_and_factors():
    with pytest.raises(SettingsError, match="--node-check must be one of off, on, warn"):
        JobSettings(job_id="j", node_check="maybe")
    with pytest.raises(SettingsError, match="--straggler-factor must be > 1"):
        JobSettings(job_id="j", straggler_factor=1.0)
