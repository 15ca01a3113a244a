"""Replication's one TLS rule (agent.checkpoints.replication_wire.tls_contexts): the listener serves TLS and
the sender speaks it exactly when the agent has --tls-cert/--tls-key; an agent with only --tls-ca (it verifies
the
master) replicates in plain TCP. Real certificates generated here, a real listener and sender."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from certs import LOCAL_NAMES, CertAuthority
from replication_saves import fake_save

from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication import Replicator
from agent.checkpoints.replication_wire import TLS_RULE, pair_key, tls_contexts
from elastic.checkpoint import shard_layout as sl
from elastic.control.tls import TLSConfigError

#: Node B's receiver key, as the master would hand it out.
KEYS = secrets.token_bytes(32)


@pytest.fixture
def pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(ca, cert, key)``: a CA and a certificate for this machine's loopback names."""
    ca = CertAuthority.create("test replication CA")
    cert, key = ca.issue_files(tmp_path, "agent", "agent", LOCAL_NAMES)
    return ca.write(tmp_path / "ca.pem"), cert, key


def push(tmp_path: Path, listener_tls, sender_tls) -> tuple[Replicator, ReplicaServer, Path]:
    """Save step 3 on node A and start pushing it to node B's listener: (sender, listener, B's folder)."""
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "job", "127.0.0.1", tls=listener_tls).start()
    server.set_key(KEYS.hex())
    sender = Replicator(a, "job", "nodeA", replicas=1, lag_bound=1, tls=sender_tls).start()
    fake_save(a, 3, "00000000000000cc", os.urandom(1 << 20))
    sender.on_saved(3)
    sender.set_targets([f"127.0.0.1:{server.port}"], [pair_key(KEYS, "nodeA").hex()])
    return sender, server, b


def close(sender: Replicator, server: ReplicaServer) -> None:
    sender.stop()
    server.close()


@pytest.mark.timeout(60)
def test_agents_with_certificates_replicate_over_tls(tmp_path: Path, pki) -> None:
    ca, cert, key = pki
    listener, client = tls_contexts(str(cert), str(key), str(ca))
    assert listener is not None and client is not None
    sender, server, b = push(tmp_path, listener, client)
    try:
        assert sender.wait_replicated(3, timeout=30), sender.error
        assert sl.committed(b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR)[0][0] == 3
    finally:
        close(sender, server)


@pytest.mark.timeout(60)
def test_an_agent_with_only_a_ca_replicates_in_plain_tcp_like_its_peers(tmp_path: Path, pki) -> None:
    ca, _, _ = pki
    # --tls-ca alone verifies the master; the peers (no certificate) listen in plain TCP: so does it speak.
    listener, client = tls_contexts(None, None, str(ca))
    assert (listener, client) == (None, None)
    sender, server, _ = push(tmp_path, listener, client)
    try:
        assert sender.wait_replicated(3, timeout=30), sender.error
    finally:
        close(sender, server)


@pytest.mark.timeout(60)
def test_a_tls_sender_meeting_a_plain_listener_reports_the_rule(tmp_path: Path, pki) -> None:
    ca, cert, key = pki
    _, client = tls_contexts(str(cert), str(key), str(ca))
    sender, server, _ = push(tmp_path, None, client)  # the peer agent was started without --tls-cert
    try:
        assert not sender.wait_replicated(3, timeout=3)
        assert "TLS handshake failed" in sender.error and TLS_RULE in sender.error, sender.error
    finally:
        close(sender, server)


def test_a_certificate_without_a_ca_is_a_config_error(pki) -> None:
    _, cert, key = pki
    with pytest.raises(TLSConfigError, match="needs --tls-ca to verify peers"):
        tls_contexts(str(cert), str(key), None)
