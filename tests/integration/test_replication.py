"""Peer replication of sharded memory checkpoints (agent/checkpoints/replication.py,
agent/checkpoints/replica_server.py, agent/checkpoints/replication_wire.py): a real listener and sender over
loopback TCP, with the keys the master derives (master.job.views): the receiver's layout and hashes, the
sender's identity, bytes and digests altered in flight, each sender's share of the receiver's memory, the
lag."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e import wait_until
from replication_saves import fake_save

from agent.checkpoints import replication_wire as wire
from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication import Replicator
from agent.checkpoints.replication_wire import Reader, send_line
from elastic.checkpoint import shard_layout as sl
from master.job import views

SECRET = secrets.token_hex(32)
INCARNATION = "00000000000000aa-0123abcd"
WAIT_S = 30.0


def receiver_key(node: str) -> str:
    """The key the master hands ``node`` for its listener."""
    return views.receiver_key(SECRET, INCARNATION, node).hex()


def pair_key(sender: str, receiver: str) -> str:
    """The key the master hands ``sender`` for its pushes to ``receiver``."""
    return views.pair_key(SECRET, INCARNATION, sender, receiver).hex()


@pytest.fixture
def nodes(tmp_path: Path):
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "job", "127.0.0.1").start()
    server.set_key(receiver_key("nodeB"))
    sender = Replicator(a, "job", "nodeA", replicas=1, lag_bound=1).start()
    yield a, b, server, sender
    sender.stop()
    server.close()


def endpoint(server: ReplicaServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.mark.timeout(60)
def test_newest_save_reaches_the_peer_with_its_hashes_and_the_lag_closes(nodes) -> None:
    a, b, server, sender = nodes
    assert json.loads((a / "replication.json").read_text())["enabled"] is False  # no peer known yet
    data = fake_save(a, 5, "00000000000000aa", os.urandom(3 << 20))
    sender.on_saved(5)
    assert sender.status().lag is None  # replication off until the master names a target
    sender.set_targets([endpoint(server)], [pair_key("nodeA", "nodeB")])
    assert sender.wait_replicated(5, timeout=WAIT_S), sender.error
    replica = b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR
    (step, save_id, copy), *_ = sl.committed(replica)
    assert (step, save_id) == (5, "00000000000000aa")
    for name in ("__0_0.distcp", "__1_0.distcp", sl.METADATA, sl.MANIFEST):
        assert (copy / name).read_bytes() == (data / name).read_bytes()
    hashes = json.loads((copy / sl.HASHES).read_text())
    assert hashes["__0_0.distcp"] == sl.file_digest(data / "__0_0.distcp")
    # The status file follows the in-memory status (written after it): poll it, with a deadline.
    expected = {"enabled": True, "bound": 1, "replicated": 5}
    wait_until(lambda: json.loads((a / "replication.json").read_text()) == expected, 10, "the status file")
    assert sender.status().lag == 0

    # A newer save replaces the older replica (the receiver keeps one per peer).
    fake_save(a, 6, "00000000000000bb", os.urandom(1 << 20))
    sender.on_saved(6)
    assert sender.wait_replicated(6, timeout=WAIT_S), sender.error
    assert [s for s, _, _ in sl.committed(replica)] == [6]
    assert not [p for p in replica.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key",
    [
        pytest.param(lambda: pair_key("nodeC", "nodeB"), id="another-members-own-key"),
        pytest.param(lambda: pair_key("nodeA", "nodeD"), id="nodeA-key-for-another-receiver"),
        pytest.param(lambda: secrets.token_hex(32), id="no-key-of-this-job"),
    ],
)
def test_push_from_wrong_node_refused(nodes, key) -> None:
    """Node C (a member, holding only its own pair keys) pushes to B claiming to be node A: refused at the
    handshake, the reason reaches C's replication error, nothing is written under node A's replicas."""
    a, b, server, _ = nodes
    impostor = Replicator(a, "job", "nodeA", replicas=1, lag_bound=1).start()
    try:
        fake_save(a, 3, "00000000000000cc", b"x" * 1000)
        impostor.on_saved(3)
        impostor.set_targets([endpoint(server)], [key()])
        error = wait_until(lambda: impostor.error, WAIT_S, "the impostor's push to be refused")
        assert "authentication failed" in error and "node nodeA's replication key" in error, error
        assert impostor.status().lag == 4  # nothing replicated: newest step 3 minus "none" (-1)
    finally:
        impostor.stop()
    assert not (b / sl.REPLICAS_SUBDIR / "nodeA").exists()
    assert server.received == 0 and server.refused >= 1


@pytest.mark.timeout(60)
def test_a_listener_without_its_key_refuses_and_a_sender_without_keys_says_why(tmp_path: Path) -> None:
    """Keys come from the master; before the receiver has its own, every push is refused; a target the
    master named without a key (an older master) is not pushed to."""
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "job", "127.0.0.1").start()
    sender = Replicator(a, "job", "nodeA", replicas=1, lag_bound=1).start()
    try:
        fake_save(a, 3, "00000000000000cc", b"x" * 1000)
        sender.on_saved(3)
        sender.set_targets([endpoint(server)], [pair_key("nodeA", "nodeB")])
        error = wait_until(lambda: sender.error, WAIT_S, "the push to be refused")
        assert "no replication key from the master yet" in error, error
        server.set_key(receiver_key("nodeB"))  # the receiver's next heartbeat reply
        assert sender.wait_replicated(3, timeout=WAIT_S), sender.error

        sender.set_targets([endpoint(server)], [])  # an older master: peers without keys
        assert "gave no replication key" in sender.error and sender.status().lag is None
    finally:
        sender.stop()
        server.close()


class TamperingProxy:
    """A man in the middle between a sender and a listener: forwards both ways, replacing byte strings in
    what the sender sends (each once, in order), as an attacker on the path could."""

    def __init__(self, target: int, replacements: list[tuple[bytes, bytes]]) -> None:
        self.target, self.replacements = target, list(replacements)
        self.replaced: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._threads.append(threading.Thread(target=self._accept, daemon=True))
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._conns += [client, upstream]
            for src, dst, edit in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, edit), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, edit: bool) -> None:
        held = b""
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                data = held + chunk
                if edit and self.replacements:
                    old, new = self.replacements[0]
                    if old in data:
                        data = data.replace(old, new, 1)
                        self.replaced.append(old)
                        self.replacements.pop(0)
                    keep = _prefix_tail(data, self.replacements[0][0]) if self.replacements else 0
                else:
                    keep = 0
                data, held = data[: len(data) - keep], data[len(data) - keep :]
                dst.sendall(data)
            dst.sendall(held)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        for t in self._threads:
            t.join(10)


def _prefix_tail(data: bytes, pattern: bytes) -> int:
    """How many bytes at the end of ``data`` begin ``pattern`` (held back until the next chunk)."""
    for n in range(min(len(pattern) - 1, len(data)), 0, -1):
        if data.endswith(pattern[:n]):
            return n
    return 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forge_digest", [False, True], ids=["bytes-altered", "bytes-and-digest-altered"])
def test_forged_digest_refused(nodes, forge_digest: bool) -> None:
    """An attacker on the path alters a file's bytes in flight, and, in the second case, also replaces that
    file's digest in the trailer with the digest of the altered bytes: the stream's MAC (under a key only
    the two nodes hold) fails, and nothing is committed."""
    a, b, server, sender = nodes
    marker = b"MARK" + secrets.token_bytes(28)  # never the end of a line the sender waits after
    payload = marker + os.urandom(1 << 20)
    forged = payload.replace(marker, bytes(32), 1)
    fake_save(a, 7, "00000000000000ee", payload)
    replacements = [(marker, bytes(32))]
    if forge_digest:
        replacements.append((_hex(payload), _hex(forged)))
    proxy = TamperingProxy(server.port, replacements)
    try:
        sender.on_saved(7)
        sender.set_targets([f"127.0.0.1:{proxy.port}"], [pair_key("nodeA", "nodeB")])
        error = wait_until(lambda: sender.error, WAIT_S, "the tampered push to be refused")
    finally:
        sender.stop()
        proxy.close()
    assert proxy.replaced == [old for old, _ in replacements], "the proxy altered the stream"
    assert "the stream's MAC does not match" in error and "nothing committed" in error, error
    root = b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR
    assert sl.committed(root) == [] and not list(root.iterdir()), "nothing committed, no temp folder left"
    assert server.received == 0


def _hex(payload: bytes) -> bytes:
    hasher = sl.digest_hasher()
    hasher.update(payload)
    return hasher.hexdigest().encode()


@pytest.mark.timeout(60)
def test_push_over_peer_cap_refused(tmp_path: Path) -> None:
    """A push whose announced size is over the sender's share of the receiver's memory is refused before
    any byte is written, with a line (sizes, flag) that reaches the sender's replication error; one within
    it is taken."""
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "job", "127.0.0.1", peer_cap=2 << 20).start()
    server.set_key(receiver_key("nodeB"))
    sender = Replicator(a, "job", "nodeA", replicas=1, lag_bound=1).start()
    try:
        fake_save(a, 4, "00000000000000dd", os.urandom(3 << 20))  # two files of 3 MiB
        sender.on_saved(4)
        sender.set_targets([endpoint(server)], [pair_key("nodeA", "nodeB")])
        error = wait_until(lambda: sender.error, WAIT_S, "the push over the cap to be refused")
        assert "the peer refused the push" in error and "over its share" in error, error
        assert "6.0 MiB" in error and "2.0 MiB" in error and "--replication-peer-cap" in error, error
        assert sender.status().error == error  # what the heartbeat carries to `elastic-master status`
        assert not (b / sl.REPLICAS_SUBDIR).exists(), "refused before any byte was written"

        fake_save(a, 5, "00000000000000de", os.urandom(512 << 10))  # 1 MiB in all: within the share
        sender.on_saved(5)
        assert sender.wait_replicated(5, timeout=WAIT_S), sender.error
    finally:
        sender.stop()
        server.close()


def test_the_default_share_divides_the_memory_by_the_sources_and_the_own_double_buffer(
    tmp_path: Path,
) -> None:
    stats = os.statvfs(tmp_path)
    size = stats.f_blocks * stats.f_frsize
    server = ReplicaServer(tmp_path, "job", "127.0.0.1", sources=2)
    try:
        assert server.peer_cap == size // 4
    finally:
        server.close()


# -- malformed input on the listener ---------------------------------------------------------------------


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


HELLOS = {
    "not-json": b"{not json",
    "not-utf8": b'{"job": "\xff\xfe"}',
    "nested-20000-deep": b'{"job": ' + _deep(20_000) + b"}",
    "not-an-object": b"[1, 2, 3]",
    "wrong-types": b'{"job": 1, "node": ["nodeA"], "nonce": null, "mac": {}}',
    "nan": b'{"job": "job", "node": "nodeA", "nonce": NaN, "mac": "00"}',
    "infinity": b'{"job": "job", "node": "nodeA", "nonce": -Infinity, "mac": "00"}',
    "overflowing-number": b'{"job": "job", "node": "nodeA", "nonce": 1e999, "mac": "00"}',
    "huge-integer": b'{"job": "job", "node": "nodeA", "nonce": ' + b"9" * 5000 + b', "mac": "00"}',
    "old-protocol-hello": b'{"job": "job", "node": "nodeA", "mac": "00"}',
    "unknown-message": b'{"op": "delete_everything"}',
    "bad-node-id": b'{"job": "job", "node": "../../etc", "nonce": "' + b"0" * 32 + b'", "mac": "00"}',
}

#: Header lines after a valid handshake (as node A, with its key).
HEADERS = {
    "header-not-json": b"step=1",
    "header-negative-size": b'{"step": 1, "save_id": "00000000000000aa", "files": [["__0_0.distcp", -5]]}',
    "header-bool-step": b'{"step": true, "save_id": "00000000000000aa", "files": []}',
    "header-nan-size": b'{"step": 1, "save_id": "00000000000000aa", "files": [["__0_0.distcp", NaN]]}',
    "header-bad-name": b'{"step": 1, "save_id": "00000000000000aa", "files": [["../x", 4]]}',
    "header-name-twice": (
        b'{"step": 1, "save_id": "00000000000000aa", "files": [["__0_0.distcp", 1], ["__0_0.distcp", 1]]}'
    ),
    "header-deep": b'{"step": 1, "save_id": "00000000000000aa", "files": ' + _deep(20_000) + b"}",
}


@pytest.fixture
def thread_errors() -> Iterator[list[threading.ExceptHookArgs]]:
    """Exceptions that escape any thread during the test (a traceback in the log): none expected."""
    seen: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = seen.append
    try:
        yield seen
    finally:
        threading.excepthook = previous


def _answer_then_closed(sock: socket.socket, reader: Reader) -> dict:
    reply = reader.line()
    sock.settimeout(10)
    try:
        rest = sock.recv(1)
    except ConnectionResetError:  # closed while this side's bytes were still unread there
        rest = b""
    assert rest == b"", "the listener closes the connection after its refusal"
    return reply


def _handshake_as(sock: socket.socket, reader: Reader, node: str) -> None:
    theirs = reader.line()["nonce"]
    ours = secrets.token_hex(16)
    key = bytes.fromhex(pair_key(node, "nodeB"))
    proof = wire.hello_mac(key, "job", node, theirs, ours)
    send_line(sock, {"job": "job", "node": node, "nonce": ours, "mac": proof})
    assert reader.line()["ok"] is True


def _push_still_served(a: Path, sender: Replicator, server: ReplicaServer, step: int) -> None:
    fake_save(a, step, f"{step:016x}", os.urandom(1 << 16))
    sender.on_saved(step)
    sender.set_targets([endpoint(server)], [pair_key("nodeA", "nodeB")])
    assert sender.wait_replicated(step, timeout=WAIT_S), sender.error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HELLOS) + sorted(HEADERS))
def test_malformed_input_is_refused_cleanly_and_others_are_still_served(
    nodes, name: str, thread_errors, caplog
) -> None:
    a, b, server, sender = nodes
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        reader = Reader(sock)
        if name in HEADERS:
            _handshake_as(sock, reader, "nodeA")
            sock.sendall(HEADERS[name] + b"\n")
        else:
            reader.line()  # the greeting
            sock.sendall(HELLOS[name] + b"\n")
        reply = _answer_then_closed(sock, reader)
    assert reply["ok"] is False and reply["error"], reply
    _push_still_served(a, sender, server, 9)
    assert not thread_errors, "no exception escaped a listener thread"
    assert not [r for r in caplog.records if r.exc_info], "refusals are one line, no traceback"
    root = b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR
    assert not (root / sl.tmp_dir_name(1, "00000000000000aa")).exists()


@pytest.mark.timeout(60)
def test_an_oversize_line_and_a_truncated_stream_are_refused_and_others_are_still_served(
    nodes, thread_errors, caplog
) -> None:
    a, b, server, sender = nodes
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        reader = Reader(sock)
        reader.line()
        with contextlib.suppress(OSError):  # the listener may close while this side still sends
            sock.sendall(b'{"job": "' + b"x" * (wire.LINE_MAX + 70_000))
        reply = _answer_then_closed(sock, reader)
    assert reply["ok"] is False and "longer than" in reply["error"], reply

    # A push cut short in the middle of a file: the partial replica is removed, nothing committed.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        reader = Reader(sock)
        _handshake_as(sock, reader, "nodeA")
        send_line(sock, {"step": 2, "save_id": "00000000000000dd", "files": [["__0_0.distcp", 1 << 20]]})
        assert reader.line() == {"ok": True}
        sock.sendall(b"abcd")
    root = b / sl.REPLICAS_SUBDIR / "nodeA" / sl.SHARDED_SUBDIR
    wait_until(lambda: server.refused >= 2, WAIT_S, "the cut push to be dropped")
    assert sl.committed(root) == [] and not list(root.iterdir())
    _push_still_served(a, sender, server, 9)
    assert not thread_errors and not [r for r in caplog.records if r.exc_info]


def test_ring_placement_survives_any_single_node_loss() -> None:
    members = ["n0", "n1", "n2", "n3"]
    assert sl.ring_targets(members, "n3", 1) == ["n0"]
    assert sl.ring_targets(members, "n1", 2) == ["n2", "n3"]
    assert sl.ring_targets(["n0"], "n0", 1) == []
    assert sl.ring_targets(["n0", "n1"], "n0", 5) == ["n1"]
    # Every node's shards are held by another node.
    assert {t for m in members for t in sl.ring_targets(members, m, 1)} == set(members)
