"""Agents of the previous protocol revision against a real master (``EmbeddedMaster``): the fields they send
that this revision no longer reads are accepted and ignored, so that they keep training across a master
upgrade (docs/operations.md, rolling upgrade)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from embedded_masters import EmbeddedMasters, no_thread_left

from elastic.control.client import MasterClient
from elastic.control.protocol import (
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    JoinRequest,
)

pytestmark = pytest.mark.timeout(60)


class Masters(EmbeddedMasters):
    token = "compat-token"
    job_id = "job-compat"
    job: ClassVar[dict[str, Any]] = dict(EmbeddedMasters.job, min_nodes=1, max_nodes=1, last_call_s=0.1)


@pytest.fixture
def masters() -> Iterator[Masters]:
    with no_thread_left(), Masters() as helper:
        yield helper


@pytest.mark.parametrize("revision", [None, 2, 3])
def test_a_heartbeat_carrying_worker_status_gets_a_normal_reply(
    masters: Masters, revision: int | None
) -> None:
    """``WorkerProgress.status`` (always ``running``, never read) left the model; heartbeats of agents that
    still send it are answered as any other, and the progress beside it still counts."""
    master = masters.start()
    client = masters.keep(MasterClient([master.address], masters.job_id, masters.token, request_timeout=10.0))
    join = JoinRequest(node_id="a", host="127.0.0.1", nproc=1, store_port=29501, min_nodes=1, max_nodes=1)
    client.join(join)
    assert client.next_round("a", 0, 10.0).assignment is not None
    headers = {**masters.auth, NODE_SECRET_HEADER: client._secrets["a"]}
    if revision is not None:  # revision 1 sent no header
        headers[PROTOCOL_HEADER] = str(revision)
    worker = {"local_rank": 0, "pid": 4242, "status": "running", "step": 7, "step_time_s": 0.25}
    body = {"node_id": "a", "round": 1, "state": "running", "workers": [worker]}
    reply = masters.http(master, headers).post("/v1/heartbeat", json=body)
    assert reply.status_code == 200, reply.text
    assert (reply.json()["command"], reply.json()["round"]) == ("continue", 1)
    row = client.status().nodes[0]
    assert (row.node_id, row.state, row.step) == ("a", "running", 7)
