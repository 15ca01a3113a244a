"""The master hands out peer replication's keys (master.job.views.replication_fields) in heartbeat replies:
a real ``elastic-master`` process and two nodes' real replication listeners and senders open each other's
pushes with them, and no node can push as another; the keys derive from a secret in the job's durable
state, so a master that takes over hands out the same keys."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import job_calls as calls
import pytest
from e2e import launch, wait_until  # noqa: F401 - launch is a fixture
from fake_nodes import RealMaster, start_master
from job_builders import make_job, running
from replication_saves import fake_save

from agent.checkpoints import replication
from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication import Replicator
from elastic.checkpoint import shard_layout as sl
from elastic.control.protocol import (
    API_PREFIX,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    Command,
    CommandReply,
    HeartbeatRequest,
    NodeState,
)
from master.job.job import Job

WAIT_S = 30.0


def heartbeat(master: RealMaster, node_id: str, round_: int, term: int, port: int) -> CommandReply:
    """One heartbeat of a running node with replication on (``--replicas 1``), as an agent sends it."""
    body = {
        "node_id": node_id,
        "round": round_,
        "term": term,
        "state": "running",
        "replicas": 1,
        "replication_port": port,
    }
    headers = {**master.headers(node_id), PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
    reply = httpx.post(master.url(f"{API_PREFIX}/heartbeat"), json=body, headers=headers, timeout=10)
    reply.raise_for_status()
    return CommandReply.model_validate(reply.json())


def assignment(master: RealMaster, node_id: str) -> dict:
    query = {"node_id": node_id, "after": 0, "timeout": 20}
    headers = {**master.headers(node_id), PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
    reply = httpx.get(master.url(f"{API_PREFIX}/round"), params=query, headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["assignment"]


@pytest.mark.timeout(120)
def test_keys_from_a_real_master_open_pushes_both_ways_and_only_as_oneself(
    launch,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    master = start_master(launch, tmp_path, "job-keys", "2")
    folders = {n: tmp_path / n for n in ("a", "b")}
    nodes = {}
    for node_id, folder in folders.items():
        folder.mkdir()
        server = ReplicaServer(folder, "job-keys", "127.0.0.1").start()
        sender = Replicator(folder, "job-keys", node_id, replicas=1, lag_bound=1).start()
        nodes[node_id] = SimpleNamespace(replica_server=server, replicator=sender)
    try:
        for node_id in nodes:
            master.join(node_id, (2, 2))
        rounds = {node_id: assignment(master, node_id) for node_id in nodes}
        replies: dict[str, CommandReply] = {}
        for _ in range(2):  # the second beat names the peer, whose port came with its first
            for node_id, keeper in nodes.items():
                given = rounds[node_id]
                port = keeper.replica_server.port
                replies[node_id] = heartbeat(master, node_id, given["round"], given["term"], port)
        for node_id, reply in replies.items():
            assert reply.command is Command.CONTINUE
            other = "b" if node_id == "a" else "a"
            assert reply.peers == [f"127.0.0.1:{nodes[other].replica_server.port}"]
            assert len(reply.peer_keys) == 1 and len(reply.replication_key) == 64
            replication.follow_master(nodes[node_id], reply.peers, reply.peer_keys, reply.replication_key)
        assert replies["a"].peer_keys != replies["b"].peer_keys, "a key per pair"

        for step, (node_id, keeper) in enumerate(nodes.items(), start=3):
            fake_save(folders[node_id], step, f"{step:016x}", os.urandom(1 << 18))
            keeper.replicator.on_saved(step)
            assert keeper.replicator.wait_replicated(step, timeout=WAIT_S), keeper.replicator.error
        assert sl.committed(folders["b"] / sl.REPLICAS_SUBDIR / "a" / sl.SHARDED_SUBDIR)[0][0] == 3
        assert sl.committed(folders["a"] / sl.REPLICAS_SUBDIR / "b" / sl.SHARDED_SUBDIR)[0][0] == 4

        # Node b, with the key the master gave it, cannot push to a as node "c" (nor as anyone but b).
        impostor = Replicator(folders["b"], "job-keys", "c", replicas=1, lag_bound=1).start()
        try:
            impostor.on_saved(4)
            impostor.set_targets(replies["b"].peers, replies["b"].peer_keys)
            error = wait_until(lambda: impostor.error, WAIT_S, "the impostor's push to be refused")
            assert "authentication failed" in error, error
        finally:
            impostor.stop()
        assert not (folders["a"] / sl.REPLICAS_SUBDIR / "c").exists()
    finally:
        for keeper in nodes.values():
            keeper.replicator.stop()
            keeper.replica_server.close()


def steady(job: Job, node_id: str, port: int) -> HeartbeatRequest:
    return HeartbeatRequest(
        node_id=node_id,
        round=job.rdzv.round,
        term=job.round_term,
        state=NodeState.RUNNING,
        replicas=1,
        replication_port=port,
    )


def keys(job: Job, now: float) -> dict[str, tuple[list[str], str]]:
    """Each node's ``(peer_keys, replication_key)`` from a heartbeat now."""
    out = {}
    for node_id, port in (("a", 7001), ("b", 7002)):
        reply = calls.heartbeat(job, steady(job, node_id, port), now)
        out[node_id] = (reply.peer_keys, reply.replication_key)
    return out


def test_the_keys_survive_a_master_failover_and_a_new_job_gets_new_ones() -> None:
    job = make_job()
    running(job, 0.0, "a", "b")
    keys(job, 1.0)  # the ports become known
    before = keys(job, 1.5)
    assert all(len(pair[0]) == 1 and pair[0][0] and pair[1] for pair in before.values())

    # What the store holds is JSON; a master that takes over restores the job from it.
    stored = json.loads(json.dumps(job.snapshot()))
    assert stored["replication_secret"] == job.replication_secret
    taken_over = calls.restored(job, Job.restore(job.settings, stored, 10.0, master_id="standby", term=2))
    keys(taken_over, 11.0)
    assert keys(taken_over, 11.5) == before, "the same keys from the new master"

    fresh = make_job()
    running(fresh, 0.0, "a", "b")
    keys(fresh, 1.0)
    assert keys(fresh, 1.5)["a"] != before["a"], "another job (or submission) has other keys"


def test_a_state_stored_without_a_secret_gets_one_that_is_stored_before_it_is_revealed() -> None:
    job = make_job()
    running(job, 0.0, "a", "b")
    stored = json.loads(json.dumps(job.snapshot()))
    del stored["replication_secret"]  # written by an older master
    taken_over = calls.restored(job, Job.restore(job.settings, stored, 10.0, master_id="standby", term=2))
    assert taken_over.replication_secret and taken_over.replication_secret != job.replication_secret
    assert taken_over.snapshot()["replication_secret"] == taken_over.replication_secret
    assert taken_over.take_effects().persist, "the takeover is written before any reply reveals a key"
