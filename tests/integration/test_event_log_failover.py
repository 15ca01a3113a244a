"""After a failover the new leader continues the event log from the stored events, without duplicates:
two real masters on a real etcd, writing the same --event-log file (one at a time, as leaders)."""

from __future__ import annotations

import json
import uuid

import pytest
from e2e import wait_until

from elastic.control.client import MasterClient
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import JoinRequest
from master.http.serving import EmbeddedMaster
from master.service.settings import ServerSettings
from master.store.etcd_store import EtcdStore

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

TOKEN = "event-log-token"


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def join(client: MasterClient, node: str, port: int) -> None:
    client.join(
        JoinRequest(node_id=node, host="127.0.0.1", nproc=1, store_port=port, min_nodes=3, max_nodes=3)
    )


def test_a_new_leader_continues_the_event_log_without_duplicates(etcd_endpoint, tmp_path) -> None:
    job = f"evlog-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "events.jsonl"
    settings = ServerSettings(
        job=JobSettings(
            job_id=job,
            min_nodes=3,
            max_nodes=3,
            last_call_s=0.5,
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=30.0,
            max_restarts=5,
        ),
        token=TOKEN,
        store_url=f"etcd://{etcd_endpoint}",
        event_log=str(path),
    )
    first = EmbeddedMaster(settings, store=EtcdStore(etcd_endpoint, job, lease_ttl_s=2)).start()
    client = MasterClient([first.address], job, TOKEN, request_timeout=10.0)
    second = None
    try:
        wait_until(lambda: first.service.job is not None, 10, "the first master to lead")
        join(client, "a", 29501)
        join(client, "b", 29502)
        wait_until(
            lambda: [r["kind"] for r in records(path)] == ["job_started", "node_joined", "node_joined"],
            10,
            "the first leader's events in the log",
        )
        second = EmbeddedMaster(settings, store=EtcdStore(etcd_endpoint, job, lease_ttl_s=2)).start()
        first.stop()  # resigns: the standby leads
        client.close()
        client = MasterClient([second.address], job, TOKEN, request_timeout=10.0)
        wait_until(lambda: second.service.job is not None, 20, "the second master to lead")
        join(client, "c", 29503)  # closes the round: node_joined, round_closed
        wait_until(
            lambda: "round_closed" in [r["kind"] for r in records(path)], 10, "the new leader's events"
        )
        logged = records(path)
        assert [r["seq"] for r in logged] == list(range(1, len(logged) + 1)), "every event once, in order"
        assert [r["kind"] for r in logged] == [
            "job_started",
            "node_joined",
            "node_joined",
            "master_takeover",
            "node_joined",
            "round_closed",
        ]
        assert logged[3]["message"].startswith(f"master {second.service.master_id} took over")
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()
