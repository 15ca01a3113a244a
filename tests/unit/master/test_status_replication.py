"""`elastic-master status` shows each node's peer replication: the replicated step, the lag, the error
(soft state from heartbeats, as `GET /v1/status` reports it per node)."""

from __future__ import annotations

import pytest

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
from master.cli.status import render_status
from master.job.job import Job


@pytest.mark.timeout(10)
def test_status_shows_replicated_step_lag_and_error_per_node() -> None:
    job = Job(JobSettings(job_id="j", min_nodes=3, max_nodes=3, last_call_s=0.0), now=0.0)
    secrets = {}
    for i, node in enumerate("abc"):
        join = JoinRequest(node_id=node, host="h", nproc=1, store_port=2000 + i, min_nodes=3, max_nodes=3)
        secrets[node] = job.join(join, 0.0).node_secret
    job.tick(0.0)
    round_ = job.rdzv.round
    beats = {
        "a": {"replicas": 1, "replicated_step": 7, "replication_lag": 1},
        "b": {
            "replicas": 1,
            "replicated_step": 6,
            "replication_lag": 2,
            "replication_error": "peer c: refused",
        },
        "c": {},  # replication off (a single node, or --replicas 0): no line
    }
    for node, fields in beats.items():
        beat = HeartbeatRequest(node_id=node, round=round_, state=NodeState.RUNNING, **fields)
        job.heartbeat(beat, 1.0, secrets[node])
    lines = [line for line in render_status(job.status(1.0)).splitlines() if line.startswith("replication")]
    assert lines == [
        "replication on node a: step 7 replicated, lag 1",
        "replication on node b: step 6 replicated, lag 2, error: peer c: refused",
    ]
