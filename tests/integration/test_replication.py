"""Peer replication of sharded memory checkpoints (agent/checkpoints/replication.py,
agent/checkpoints/replica_server.py, agent/checkpoints/replication_wire.py): a real listener and sender over
loopback TCP, the receiver's layout and
hashes, authentication, a damaged transfer, the lag."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from e2e import wait_until
from replication_saves import fake_save

from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication import Replicator
from agent.checkpoints.replication_wire import Reader, mac, send_line
from elastic.checkpoint import shard_layout as sl


@pytest.fixture
def nodes(tmp_path: Path):
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "job", "secret-token", "127.0.0.1").start()
    sender = Replicator(a, "job", "nodeA", "secret-token", replicas=1, lag_bound=1).start()
    yield a, b, server, sender
    sender.stop()
    server.close()


@pytest.mark.timeout(60)
def test_newest_save_reaches_the_peer_with_its_hashes_and_the_lag_closes(nodes) -> None:
    a, b, server, sender = nodes
    assert json.loads((a / "replication.json").read_text())["enabled"] is False  # no peer known yet
    data = fake_save(a, 5, "00000000000000aa", os.urandom(3 << 20))
    sender.on_saved(5)
    assert sender.status().lag is None  # replication off until the master names a target
    sender.set_targets([f"127.0.0.1:{server.port}"])
    assert sender.wait_replicated(5, timeout=30), sender.error
    replica = b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR
    (step, save_id, copy), *_ = sl.committed(replica)
    assert (step, save_id) == (5, "00000000000000aa")
    for name in ("__0_0.distcp", "__1_0.distcp", sl.METADATA, sl.MANIFEST):
        assert (copy / name).read_bytes() == (data / name).read_bytes()
    hashes = json.loads((copy / sl.HASHES).read_text())
    assert hashes["__0_0.distcp"] == sl.sha256_file(data / "__0_0.distcp")
    # The status file follows the in-memory status (written after it): poll it, with a deadline.
    expected = {"enabled": True, "bound": 1, "replicated": 5}
    wait_until(lambda: json.loads((a / "replication.json").read_text()) == expected, 10, "the status file")
    assert sender.status().lag == 0

    # A newer save replaces the older replica (the receiver keeps one per peer).
    fake_save(a, 6, "00000000000000bb", os.urandom(1 << 20))
    sender.on_saved(6)
    assert sender.wait_replicated(6, timeout=30), sender.error
    assert [s for s, _, _ in sl.committed(replica)] == [6]
    assert not [p for p in replica.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(60)
def test_a_wrong_token_is_refused_and_reported(nodes, tmp_path: Path) -> None:
    a, b, server, _ = nodes
    intruder = Replicator(a, "job", "nodeX", "wrong-token").start()
    try:
        fake_save(a, 3, "00000000000000cc", b"x" * 1000)
        intruder.on_saved(3)
        intruder.set_targets([f"127.0.0.1:{server.port}"])
        assert not intruder.wait_replicated(3, timeout=2)
        assert "authentication failed" in intruder.error
        assert intruder.status().lag == 4  # nothing replicated: newest step 3 minus "none" (-1)
    finally:
        intruder.stop()
    assert not (b / sl.REPLICAS_SUBDIR / "nodeX").exists()


@pytest.mark.timeout(60)
def test_bytes_damaged_in_transit_are_not_committed(nodes) -> None:
    _, b, server, _ = nodes
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        reader = Reader(sock)
        nonce = reader.line()["nonce"]
        send_line(sock, {"job": "job", "node": "nodeZ", "mac": mac("secret-token", nonce, "job", "nodeZ")})
        assert reader.line() == {"ok": True}
        send_line(sock, {"step": 2, "save_id": "00000000000000dd", "files": [["__0_0.distcp", 4]]})
        sock.sendall(b"abcd")
        send_line(sock, {"sha256": {"__0_0.distcp": "0" * 64}})
        reply = reader.line()
    assert reply["ok"] is False and "sha256 mismatch" in reply["error"]
    root = b / sl.REPLICAS_SUBDIR / "nodeZ" / sl.SHARDED_SUBDIR
    assert sl.committed(root) == [] and not list(root.iterdir())


def test_ring_placement_survives_any_single_node_loss() -> None:
    members = ["n0", "n1", "n2", "n3"]
    assert sl.ring_targets(members, "n3", 1) == ["n0"]
    assert sl.ring_targets(members, "n1", 2) == ["n2", "n3"]
    assert sl.ring_targets(["n0"], "n0", 1) == []
    assert sl.ring_targets(["n0", "n1"], "n0", 5) == ["n1"]
    # Every node's shards are held by another node.
    assert {t for m in members for t in sl.ring_targets(members, m, 1)} == set(members)
