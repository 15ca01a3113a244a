"""The integrity guard's findings at the master (``master.job.findings`` and its hooks in ``master.job.job``),
with a fake clock: each detection and rollback is one event however many ranks report it, with metrics; a
NaN or spike that recurs after a rollback stops the job for good (exit 3) naming the step and its samples;
a node named the odd replica ``--suspect-count`` times within ``--suspect-window`` is excluded as suspect
hardware (its agent told to exit 4; durable; ``readmit`` lifts it)."""

from __future__ import annotations

import itertools

import job_calls as calls
import pytest
from job_builders import beat, join_req, kinds, make_job, running

from elastic.control.job_settings import JobSettings, SettingsError
from elastic.control.protocol import Command, Finding, HeartbeatRequest, IntegrityFinding, NodeState
from elastic.exit_codes import ExitCode
from master.cli.status import render_status
from master.job.accounting import RestartBudget
from master.job.errors import NodeExcludedError
from master.job.job import Job

pytestmark = pytest.mark.timeout(10)

_ids = itertools.count(1)


def report(job: Job, node_id: str, now: float, step: int, **integrity: object) -> Command:
    """One heartbeat of ``node_id`` carrying one integrity finding; the command it gets back."""
    finding = Finding(
        id=f"{node_id}-{next(_ids)}",
        step=step,
        found_by="integrity",
        integrity=IntegrityFinding(**integrity),  # type: ignore[arg-type]
    )
    req = HeartbeatRequest(
        node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING, ckpt_corrupt=[finding]
    )
    return calls.heartbeat(job, req, now).command


def flip(job: Job, now: float, step: int, odd_node: str = "c") -> Command:
    """A bit flip on ``odd_node``'s worker (global rank 4 of 6) found at ``step``: rank 0's node and the odd
    node report it, then both report the rollback; the odd node's last command."""
    mismatch = {"kind": "mismatch", "ranks": [4], "world_size": 6, "odd": True}
    report(job, "a", now, step, **mismatch)
    report(job, odd_node, now, step, **mismatch, named_here=True)
    report(job, "a", now, step, **mismatch, rolled_back_to=step - 1)
    return report(job, odd_node, now, step, **mismatch, named_here=True, rolled_back_to=step - 1)


def scrape(job: Job) -> dict[tuple[str, str], float]:
    """The job's Prometheus samples: (name, kind label or '') -> value."""
    from master.http.metrics import _job_metrics  # the families /metrics serves for the job

    return {
        (s.name, s.labels.get("kind", "")): s.value
        for family in _job_metrics(job, "job-1", 0.0)
        for s in family.samples
    }


def test_each_detection_and_rollback_is_one_event_however_many_ranks_report_it():
    job = make_job(min_nodes=3, max_nodes=3)
    running(job, 0.0, "a", "b", "c")
    assert flip(job, 1.0, 12) is Command.CONTINUE
    report(job, "a", 2.0, 9, kind="non_finite", ranks=[2], world_size=6)
    report(job, "b", 2.0, 9, kind="non_finite", ranks=[2], world_size=6, named_here=True)
    assert kinds(job)[-3:] == ["integrity_detected", "integrity_rolled_back", "integrity_detected"]
    detected = [e for e in job.events if e.kind == "integrity_detected"]
    assert detected[0].data["ranks"] == [4] and "odd rank(s) [4] of 6" in detected[0].message
    assert job.stats.integrity == {"mismatch": 1, "rolled_back": 1, "non_finite": 1}
    assert job.outcome is None and "c" in job.nodes, "one naming is not yet suspect (--suspect-count 2)"


def test_a_nan_that_recurs_after_a_rollback_stops_the_job_for_good_naming_step_and_samples():
    job = make_job(min_nodes=2, max_nodes=2)
    running(job, 0.0, "a", "b")
    report(job, "a", 1.0, 7, kind="spike", world_size=4)
    assert job.outcome is None, "a first spike is rolled back, not final"
    report(job, "a", 2.0, 7, kind="spike", world_size=4, recurring=True, samples=[11, 3, 40])
    assert job.outcome is not None and job.outcome.exit_code == ExitCode.FAILED_FOR_GOOD == 3
    assert "step 7" in job.outcome.summary and "samples [11, 3, 40]" in job.outcome.summary
    assert kinds(job)[-2:] == ["integrity_detected", "job_failed"]
    assert beat(job, "b", 2.5).command is Command.STOP


def test_a_node_named_the_odd_replica_twice_in_the_window_is_excluded_durably_until_readmitted():
    # Three rollbacks, each charged against the restart budget (master.job.accounting).
    job = make_job(min_nodes=2, max_nodes=3, suspect_count=2, suspect_window_s=100.0, max_restarts=5)
    running(job, 0.0, "a", "b", "c")
    flip(job, 1.0, 5)
    assert flip(job, 150.0, 9) is Command.CONTINUE, "the first naming left the window"
    assert job.flapping.suspects["c"] == [150.0]
    taken = calls.restored(job, Job.restore(job.settings, job.snapshot(), now=151.0))  # durable
    command = flip(taken, 152.0, 20)
    assert command is Command.EXCLUDE, "its agent is told to stop, exit 4"
    reply = calls.heartbeat(
        taken, HeartbeatRequest(node_id="c", round=taken.rdzv.round, state=NodeState.RUNNING), 153.0
    )
    assert reply.outcome is not None and reply.outcome.exit_code == ExitCode.NODE_UNHEALTHY == 4
    assert "suspect hardware" in reply.outcome.summary and "elastic-master readmit c" in reply.outcome.summary
    assert "node_suspect_excluded" in kinds(taken) and "c" not in taken.nodes
    row = next(n for n in taken.status(153.0).nodes if n.node_id == "c")
    assert row.state == "excluded" and row.excluded_reason.startswith("suspect hardware")
    assert "suspect-hardware" in render_status(taken.status(153.0))
    metrics = scrape(taken)
    assert metrics[("elastic_integrity_detections_total", "mismatch")] == 3
    assert metrics[("elastic_integrity_detections_total", "spike")] == 0
    assert metrics[("elastic_integrity_rollbacks_total", "")] == 3
    assert metrics[("elastic_integrity_suspect_nodes", "")] == 1
    again = calls.restored(taken, Job.restore(taken.settings, taken.snapshot(), now=154.0))
    with pytest.raises(NodeExcludedError, match="suspect hardware"):
        again.join(join_req(again, "c"), 154.0, None)
    again.readmit("c", 155.0)
    assert again.join(join_req(again, "c"), 156.0, None).node_secret


def test_a_pair_named_by_two_replicas_is_no_suspect_and_zero_turns_it_off():
    job = make_job(min_nodes=2, max_nodes=2, suspect_count=1)
    running(job, 0.0, "a", "b")
    pair = {"kind": "mismatch", "ranks": [0, 1], "world_size": 2, "named_here": True}
    assert report(job, "a", 1.0, 3, **pair) is Command.CONTINUE, "two replicas: the pair, nobody odd"
    off = make_job(min_nodes=3, max_nodes=3, suspect_count=0)
    running(off, 0.0, "a", "b", "c")
    assert flip(off, 1.0, 4) is flip(off, 2.0, 8) is Command.CONTINUE
    with pytest.raises(SettingsError, match="--suspect-count"):
        JobSettings(job_id="j", suspect_count=-1)


def test_a_checkpoint_corruption_still_travels_the_same_path():
    job = make_job()
    running(job, 0.0, "a", "b")
    damaged = Finding(id="x-1", step=4, file="/dev/shm/f", found_by="restore", detail="digest mismatch")
    req = HeartbeatRequest(node_id="a", round=job.rdzv.round, state=NodeState.RUNNING, ckpt_corrupt=[damaged])
    calls.heartbeat(job, req, 1.0)
    calls.heartbeat(job, req, 2.0)  # sent again until answered: recorded once
    assert kinds(job)[-1:] == ["checkpoint_corrupt"] and job.stats.checkpoint_corrupt == 1
    assert "integrity" not in damaged.model_dump_json(exclude_unset=True), "an older master's wire form"


def test_each_rollback_is_charged_once_against_the_restart_budget_and_a_spent_one_fails_the_job():
    job = make_job(min_nodes=3, max_nodes=3, max_restarts=1)
    running(job, 0.0, "a", "b", "c")
    assert flip(job, 1.0, 12) is Command.CONTINUE  # two ranks report the rollback: one charge
    assert job.restart_count == 1 and job.outcome is None
    # A master taking over sees the same rollback again (soft state lost): it is not charged twice.
    budget = RestartBudget.restore(1, job.budget.snapshot())
    assert budget.charge_rollback(12, 11) is None and budget.spent == 1
    flip(job, 2.0, 20, odd_node="b")
    assert job.outcome is not None and job.outcome.exit_code == ExitCode.FAILED
    assert "max restarts 1" in job.outcome.summary
    assert "integrity rollback from step 20 to 19" in job.outcome.summary
