"""The status table (master.cli.status.render_status): step time, straggler flags and node-check
figures."""

from __future__ import annotations

import pytest
from health_jobs import check

from elastic.control.protocol import JobStatus, NodeStatus
from master.cli.status import render_status

pytestmark = pytest.mark.timeout(30)


def training_job(**fields) -> JobStatus:
    """A training job of 2 nodes in round 2, with ``fields`` (its nodes among them)."""
    values: dict = dict(
        job_id="j", master_id="m", phase="training", round=2, world_size=2, nnodes=2, restart_count=0,
        max_restarts=3,
    )  # fmt: skip
    return JobStatus(**{**values, **fields})


def test_the_status_table_shows_step_time_and_flags_and_the_check_figures():
    def row(node_id, rank, **fields) -> NodeStatus:
        values: dict = dict(
            node_id=node_id,
            rank=rank,
            state="running",
            heartbeat_age_s=0.3,
            restarts=0,
            round=2,
            host="h",
            nproc=1,
        )
        values.update(fields)
        return NodeStatus(**values)

    job = training_job(
        nodes=[
            row("a", 0, step_time_s=0.5, compute_time_s=0.1, node_check=check(), node_check_verdict="ok"),
            row("b", 1, step_time_s=0.5, compute_time_s=0.45, straggler=True),
            row(
                "c",
                None,
                state="excluded",
                node_check=check(ok=False, stage="matmul", matmul=None, allreduce=None),
                node_check_verdict="failed: check failed at matmul: boom",
            ),
        ],
    )
    head, columns, *rows = render_status(job).splitlines()
    assert columns.split() == [
        "NODE", "RANK", "STATE", "HEARTBEAT", "AGE", "RESTARTS", "ROUND", "WORLD", "STEP", "TIME", "FLAGS"
    ]  # fmt: skip
    assert rows[0].split() == ["a", "0", "running", "0.3s", "0", "2", "2", "0.500s(0.100s)"]
    assert rows[1].split() == ["b", "1", "running", "0.3s", "0", "2", "2", "0.500s(0.450s)", "straggler"]
    assert rows[2].split() == ["c", "-", "excluded", "0.3s", "0", "2", "-", "-", "check-failed"]
    assert rows[3] == "node check a: ok; matmul 10.0 ms on cpu, allreduce 2.0 ms"
    assert rows[4] == "node check c: failed: check failed at matmul: boom; no figures"


def test_the_status_names_where_the_lost_time_went_largest_first():
    job = training_job(
        nodes=[],
        goodput_ratio=0.9,
        badput_s={"detection": 0.5, "rendezvous": 2.25, "re_form": 0.0, "redone_steps": 1.0, "other": 0.01},
    )
    assert render_status(job).splitlines()[-1] == (
        "goodput 90.0%; lost: rendezvous 2.2s, redone steps 1.0s, detection 0.5s"
    )
    assert "lost:" not in render_status(job.model_copy(update={"badput_s": {}}))
