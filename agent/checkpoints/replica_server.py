"""The receiving side of peer replication: a listener that accepts this node's ring predecessors' pushes
of their sharded saves into ``<shm>/replicas/<node>/sharded`` (the wire and its keys:
:mod:`agent.checkpoints.replication_wire`).

**Who may push**: a sender proves the pair key ``K(sender→this node)``, which the master hands only to
the nodes whose ring targets include this one; this node derives it from its receiver key (from its own
heartbeat replies, :meth:`ReplicaServer.set_key`). Until the master gave that key every push is refused.

**Each sender's share** of this node's shared memory is capped: a push whose announced size is over
:attr:`ReplicaServer.peer_cap` is refused before any byte is written, with a line naming the sizes and the
flag (it reaches the sender's ``replication_error`` and ``elastic-master status``). The cap is
``--replication-peer-cap`` MiB, or by default the size of the folder's file system (/dev/shm) divided by
``--replicas + 2`` (:func:`default_peer_cap`): the node's own double-buffered save takes two shares and
each of its ``--replicas`` ring predecessors one, the /dev/shm sizing rule of docs/checkpointing.md, so a
node's full replica fits where that rule holds. A sender has at most one push at a time (a second is
refused while the first runs), so it holds at most its committed replica and one push in flight.

**Refusals**: a malformed line, a wrong key, a push over the cap, a digest or MAC that does not match, a
stream cut short: the sender gets ``{"ok": false, "error"}`` where it still listens, the connection is
closed, one line is logged (no traceback) and counted in :attr:`ReplicaServer.refused`; other
connections are served on their own threads meanwhile (at most :data:`MAX_CONNECTIONS` at once).

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import threading
from pathlib import Path

from agent.checkpoints import replication_wire as wire
from agent.checkpoints.replication_wire import IO_TIMEOUT_S, Reader, ReplicationError, send_line
from elastic.checkpoint import shard_layout as sl
from elastic.control.listener_rules import REPLICATION, Auth, check_listener

log = logging.getLogger(__name__)

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_MIB = 1 << 20
#: Connections served at once; one more is answered ``busy`` and closed.
MAX_CONNECTIONS = 64
#: After a refusal, what the peer still sends is read and dropped for at most this long and this much.
LINGER_S = 1.0
LINGER_BYTES = 8 << 20


def default_peer_cap(folder: Path, sources: int) -> int:
    """Each sender's share of ``folder``'s file system by default: its size / (``sources`` + 2)."""
    stats = os.statvfs(folder)
    return stats.f_blocks * stats.f_frsize // (max(sources, 1) + 2)


class ReplicaServer:
    """Accepts peers' pushes into ``<folder>/replicas/<node>/sharded`` (see the module doc).

    ``peer_cap``: the bytes one sender's replica may take (None: :func:`default_peer_cap` with
    ``sources``, the number of ring predecessors that push here: this node's own ``--replicas``)."""

    def __init__(
        self,
        folder: Path,
        job_id: str,
        host: str,
        *,
        tls: ssl.SSLContext | None = None,
        auth: Auth = Auth.SECRET,
        peer_cap: int | None = None,
        sources: int = 1,
    ) -> None:
        for warning in check_listener(REPLICATION, host, auth=auth, tls=tls is not None):
            log.warning("%s", warning)
        self.folder, self.job_id, self.tls = folder, job_id, tls
        self.peer_cap = peer_cap if peer_cap is not None else default_peer_cap(folder, sources)
        self.sock = socket.create_server((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.received = 0  # pushes committed
        self.refused = 0  # connections refused (a wrong key, malformed input, over the cap, a bad MAC...)
        self._key: bytes | None = None  # this node's receiver key, from the master
        self._lock = threading.Lock()
        self._pushing: set[str] = set()  # senders with a push in progress
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="replica-server", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        log.info("replication listener on %s:%d", self.host, self.port)
        return self

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def set_key(self, receiver_key: str) -> None:
        """This node's receiver key (hex, from the master's heartbeat reply; '' from an older master)."""
        try:
            key = bytes.fromhex(receiver_key) if receiver_key else None
        except ValueError:
            log.warning("replication: the master's replication key is not hex; ignored")
            return
        with self._lock:
            self._key = key

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, f"busy: {MAX_CONNECTIONS} replication connections are open")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="replica-recv", daemon=True).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        with self._lock:
            self.refused += 1
        log.warning("replication: refused a peer's push: %s", why)
        with contextlib.suppress(OSError):
            conn.setblocking(False)  # the answer never waits for a peer that does not read
            conn.send(wire.encode({"ok": False, "error": why}))
        with contextlib.suppress(OSError):
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with contextlib.ExitStack() as stack:
                conn.settimeout(IO_TIMEOUT_S)
                if self.tls is not None:
                    try:
                        conn = self.tls.wrap_socket(conn, server_side=True)
                    except (ssl.SSLError, OSError) as exc:
                        log.warning("replication: TLS handshake with a peer failed: %s", exc)
                        conn.close()
                        return
                stack.callback(conn.close)
                reader = Reader(conn)
                try:
                    node, session = self._authenticate(conn, reader)
                    with self._one_push(node):
                        self._receive(conn, reader, node, session)
                except (ReplicationError, OSError) as exc:
                    with self._lock:
                        self.refused += 1
                    log.warning("replication: a push from a peer failed: %s", exc)
                    with contextlib.suppress(OSError):
                        send_line(conn, {"ok": False, "error": str(exc)})
                    _linger(conn)
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def _one_push(self, node: str):  # noqa: ANN202 - a context manager
        with self._lock:
            if node in self._pushing:
                raise ReplicationError(f"a push from node {node} is already in progress here")
            self._pushing.add(node)
        try:
            yield
        finally:
            with self._lock:
                self._pushing.discard(node)

    def _authenticate(self, conn: socket.socket, reader: Reader) -> tuple[str, bytes]:
        """The sender's node id (proven) and the session key of this push."""
        nonce = secrets.token_hex(16)
        send_line(conn, {"nonce": nonce})
        hello = reader.line()
        job, node, theirs, proof = hello.get("job"), hello.get("node"), hello.get("nonce"), hello.get("mac")
        if not (isinstance(job, str) and isinstance(node, str) and isinstance(proof, str)):
            raise ReplicationError("malformed hello")
        if not isinstance(theirs, str):
            raise ReplicationError(
                "the sender speaks an older replication protocol (no nonce, the job token's HMAC): "
                "run the same elastic-run version on every node"
            )
        if job != self.job_id:
            raise ReplicationError(f"authentication failed: this listener serves another job, not {job!r}")
        if not _NODE.match(node) or not re.fullmatch(r"[0-9a-f]{32}", theirs):
            raise ReplicationError("malformed hello (node id or nonce)")
        with self._lock:
            receiver_key = self._key
        if receiver_key is None:
            raise ReplicationError(
                "this node has no replication key from the master yet (it comes with a heartbeat reply "
                "while the node is a member of the round; an elastic-master older than this agent "
                "hands out none)"
            )
        key = wire.pair_key(receiver_key, node)
        if not wire.matches(wire.hello_mac(key, job, node, nonce, theirs), proof):
            raise ReplicationError(
                f"authentication failed: the sender does not hold node {node}'s replication key for "
                "this node (another node, or keys of another master)"
            )
        send_line(conn, {"ok": True, "mac": wire.welcome_mac(key, nonce, theirs)})
        return node, wire.session_key(key, nonce, theirs)

    def _receive(self, conn: socket.socket, reader: Reader, node: str, session: bytes) -> None:
        header = reader.line()
        step, save_id, files = header.get("step"), header.get("save_id"), header.get("files")
        if not (
            isinstance(step, int)
            and not isinstance(step, bool)
            and step >= 0
            and isinstance(save_id, str)
            and isinstance(files, list)
        ):
            raise ReplicationError("malformed push header")
        if not re.fullmatch(r"[0-9a-f]{16}", save_id):
            raise ReplicationError("bad save id")
        listed: list[tuple[str, int]] = []
        for item in files:
            if not (
                isinstance(item, list) and len(item) == 2 and valid_size(item[1]) and wire.valid_name(item[0])
            ):
                raise ReplicationError("malformed file list")
            listed.append((str(item[0]), int(item[1])))
        if len({name for name, _ in listed}) != len(listed):
            raise ReplicationError("malformed file list (a name twice)")
        need = sum(size for _, size in listed)
        if need > self.peer_cap:
            raise ReplicationError(
                f"node {node}'s replica of step {step} takes {need / _MIB:.1f} MiB, over its share of the "
                f"receiving node's shared memory ({self.peer_cap / _MIB:.1f} MiB: --replication-peer-cap, by "
                "default the /dev/shm size / (--replicas + 2)); enlarge /dev/shm or --replication-peer-cap "
                "on the receiving node"
            )
        stats = os.statvfs(self.folder)
        free = stats.f_bavail * stats.f_frsize
        if need + _MIB > free:
            raise ReplicationError(
                f"not enough shared memory on the receiving node for node {node}'s replica of step {step}: "
                f"it needs {need / _MIB:.1f} MiB, {free / _MIB:.1f} MiB is available (its own "
                "double buffer plus the replicas it holds); enlarge /dev/shm"
            )
        send_line(conn, {"ok": True})  # accepted: the bytes may come
        root = self.folder / sl.REPLICAS_SUBDIR / node / sl.SHARDED_SUBDIR
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / sl.tmp_dir_name(step, save_id)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            mac = wire.stream_mac(session, reader.last_raw)
            digests = {}
            for name, size in listed:
                digest = wire.new_digest()
                with open(tmp / name, "wb") as out:
                    for chunk in reader.chunks(size):
                        digest.update(chunk)
                        mac.update(chunk)
                        out.write(chunk)
                digests[name] = digest.hexdigest()
            trailer = reader.line()
            sent = trailer.get(wire.DIGEST_KEY)
            mac.update(wire.digests_bytes(sent if isinstance(sent, dict) else {}))
            if not wire.matches(mac.hexdigest(), trailer.get("mac")):
                raise ReplicationError(
                    f"node {node}'s replica of step {step}: the stream's MAC does not match (bytes or "
                    "digests altered in transit, or not sent under this push's key); nothing committed"
                )
            if sent != digests:
                raise ReplicationError(
                    f"node {node}'s replica of step {step}: {wire.DIGEST_KEY} mismatch in transit"
                )
            sl.write_json(tmp / sl.HASHES, digests)
            sl.commit(root, tmp, step, save_id)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        sl.prune(root, 1)
        sl.remove_temp_dirs(root, older_than=step)
        with self._lock:
            self.received += 1
        send_line(conn, {"ok": True, "mac": wire.committed_mac(session, step, save_id)})


def _linger(conn: socket.socket) -> None:
    """Close our side, then read what the peer still sends (bounded in bytes and time) before the close:
    closing with unread bytes would reset the connection, and the peer could lose the error line."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(LINGER_S)
        drained = 0
        while drained < LINGER_BYTES and (chunk := conn.recv(1 << 16)):
            drained += len(chunk)


def valid_size(size: object) -> bool:
    """A file size a push may announce: a non-negative int (a negative one would hide a large file from
    the cap's sum)."""
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0
