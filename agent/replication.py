"""Peer replication of sharded memory checkpoints: each agent streams its node's newest sharded save to
the agents of the next ``replicas`` nodes in rank order (a ring: any single node's loss leaves a copy of
its shards on a survivor), agent to agent over TCP, never through the master.

**Placement**: node rank ``r`` sends to ranks ``r+1 .. r+k`` (mod the round's node count), ``k`` =
``--replicas`` (default 1, at most nodes - 1). The master hands each agent its targets' endpoints in its
heartbeat replies (soft state, from the targets' own heartbeats).

**Wire** (one connection per push; TLS on both sides exactly when the agent has ``--tls-cert/--tls-key``,
see :func:`tls_contexts`):

1. the receiver sends ``{"nonce": hex}``; the sender answers ``{"job", "node", "mac"}`` with
   ``mac = HMAC-SHA256(job token, nonce|job|node)`` (the token never crosses the wire); the receiver
   checks it in constant time and answers ``{"ok": true}`` or an error and closes;
2. the sender sends ``{"step", "save_id", "files": [[name, size], ...]}`` then the files' bytes in that
   order (at most ``--replication-bandwidth`` bytes/s), then ``{"sha256": {name: hex}}``;
3. the receiver writes them into ``<shm>/replicas/<sender>/sharded/`` (the layout of
   :mod:`elastic.shard_layout`), hashing as it receives; if every hash matches, it records them in
   ``hashes.json`` (checked again at restore), commits the step, drops the sender's older replica and
   answers ``{"ok": true}``; otherwise an error, and nothing is committed.

**Lag**: the replicated step is the newest step every target acknowledged; the lag is the newest local
save's step minus it. The sender writes ``<shm>/replication.json`` (``enabled``, ``bound``,
``replicated``) after each push; a worker's next save waits while saving would exceed the bound
(:func:`elastic.sharded._replication_wait`). The agent's heartbeats report step, lag and last error.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic import ckpt_layout as layout
from elastic import shard_layout as sl
from elastic.listener_rules import REPLICATION, Auth, check_listener

log = logging.getLogger("elastic.agent")

STATUS_FILE = "replication.json"
DEFAULT_REPLICAS = 1
DEFAULT_LAG_BOUND = 1
_CHUNK = 4 << 20
_LINE_MAX = 1 << 20  # a JSON line of the protocol (a file list of thousands of ranks fits)
_IO_TIMEOUT_S = 60.0
#: The one TLS rule of replication, quoted where a handshake or greeting fails (docs/security.md).
TLS_RULE = (
    "replication uses TLS exactly when the agent has --tls-cert/--tls-key (verifying peers with --tls-ca): "
    "give every agent of the job the same TLS options"
)
_RETRY_S = 0.5
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class ReplicationError(Exception):
    """A push failed (peer unreachable, refused, out of space, a hash mismatch); the message says why."""


def _mac(token: str, nonce: str, job: str, node: str) -> str:
    return hmac.new(token.encode(), f"{nonce}|{job}|{node}".encode(), hashlib.sha256).hexdigest()


def _send_line(sock: socket.socket, value: object) -> None:
    sock.sendall(json.dumps(value, separators=(",", ":")).encode() + b"\n")


class _Reader:
    """Buffered reads of lines and exact byte counts from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, bytearray()

    def line(self) -> dict:
        while b"\n" not in self.buffer:
            if len(self.buffer) > _LINE_MAX:
                raise ReplicationError("protocol line too long")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ReplicationError("connection closed")
            self.buffer += chunk
        index = self.buffer.index(b"\n")
        raw = bytes(self.buffer[:index])
        del self.buffer[: index + 1]
        try:
            value = json.loads(raw)
        except ValueError:
            raise ReplicationError("malformed protocol line") from None
        if not isinstance(value, dict):
            raise ReplicationError("malformed protocol line")
        return value

    def chunks(self, size: int):
        """Yield exactly ``size`` bytes, in chunks."""
        if self.buffer:
            head = bytes(self.buffer[:size])
            del self.buffer[: len(head)]
            size -= len(head)
            yield head
        while size > 0:
            chunk = self.sock.recv(min(size, _CHUNK))
            if not chunk:
                raise ReplicationError("connection closed mid-file")
            size -= len(chunk)
            yield chunk


def _valid_name(name: object) -> bool:
    return isinstance(name, str) and (sl.file_id(name) is not None or name in (sl.METADATA, sl.MANIFEST))


# -- receiver ---------------------------------------------------------------------------------------
class ReplicaServer:
    """Accepts peers' pushes into ``<folder>/replicas/<node>/sharded`` (see the module doc)."""

    def __init__(
        self,
        folder: Path,
        job_id: str,
        token: str,
        host: str,
        *,
        tls: ssl.SSLContext | None = None,
        auth: Auth = Auth.SECRET,
    ) -> None:
        for warning in check_listener(REPLICATION, host, auth=auth, tls=tls is not None):
            log.warning("%s", warning)
        self.folder, self.job_id, self.token, self.tls = folder, job_id, token, tls
        self.sock = socket.create_server((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.received = 0  # pushes committed
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

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="replica-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.ExitStack() as stack:
            conn.settimeout(_IO_TIMEOUT_S)
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    log.warning("replication: TLS handshake with a peer failed: %s", exc)
                    conn.close()
                    return
            stack.callback(conn.close)
            reader = _Reader(conn)
            try:
                node = self._authenticate(conn, reader)
                self._receive(conn, reader, node)
            except (ReplicationError, OSError) as exc:
                log.warning("replication: a push from a peer failed: %s", exc)
                with contextlib.suppress(OSError):
                    _send_line(conn, {"ok": False, "error": str(exc)})

    def _authenticate(self, conn: socket.socket, reader: _Reader) -> str:
        nonce = secrets.token_hex(16)
        _send_line(conn, {"nonce": nonce})
        hello = reader.line()
        job, node, mac = hello.get("job"), hello.get("node"), hello.get("mac")
        if not (isinstance(job, str) and isinstance(node, str) and isinstance(mac, str)):
            raise ReplicationError("malformed hello")
        if job != self.job_id or not hmac.compare_digest(mac, _mac(self.token, nonce, job, node)):
            raise ReplicationError("authentication failed (another job, or a wrong token)")
        if not _NODE.match(node):
            raise ReplicationError("bad node id")
        _send_line(conn, {"ok": True})
        return node

    def _receive(self, conn: socket.socket, reader: _Reader, node: str) -> None:
        header = reader.line()
        step, save_id, files = header.get("step"), header.get("save_id"), header.get("files")
        if not (isinstance(step, int) and step >= 0 and isinstance(save_id, str) and isinstance(files, list)):
            raise ReplicationError("malformed push header")
        if not re.fullmatch(r"[0-9a-f]{16}", save_id):
            raise ReplicationError("bad save id")
        listed = []
        for item in files:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and _valid_name(item[0])
                and isinstance(item[1], int)
            ):
                raise ReplicationError("malformed file list")
            listed.append((str(item[0]), int(item[1])))
        need = sum(size for _, size in listed)
        stats = os.statvfs(self.folder)
        free = stats.f_bavail * stats.f_frsize
        if need + (1 << 20) > free:
            raise ReplicationError(
                f"not enough shared memory on the receiving node for node {node}'s replica of step {step}: "
                f"it needs {need / (1 << 20):.1f} MiB, {free / (1 << 20):.1f} MiB is available (its own "
                "double buffer plus the replicas it holds); enlarge /dev/shm"
            )
        root = self.folder / sl.REPLICAS_SUBDIR / node / sl.SHARDED_SUBDIR
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / sl.tmp_dir_name(step, save_id)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            digests = {}
            for name, size in listed:
                digest = hashlib.sha256()
                with open(tmp / name, "wb") as out:
                    for chunk in reader.chunks(size):
                        digest.update(chunk)
                        out.write(chunk)
                digests[name] = digest.hexdigest()
            trailer = reader.line().get("sha256")
            if trailer != digests:
                raise ReplicationError(f"node {node}'s replica of step {step}: sha256 mismatch in transit")
            sl.write_json(tmp / sl.HASHES, digests)
            sl.commit(root, tmp, step, save_id)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        sl.prune(root, 1)
        sl.remove_temp_dirs(root, older_than=step)
        self.received += 1
        _send_line(conn, {"ok": True})


# -- sender -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicationStatus:
    """For heartbeats: the newest step every target holds, the lag in steps, the last error."""

    replicated_step: int | None
    lag: int | None  # None: replication off (no peer, or --replicas 0)
    error: str


class Replicator:
    """Pushes this node's newest committed sharded save to its ring successors (see the module doc)."""

    def __init__(
        self,
        folder: Path,
        job_id: str,
        node_id: str,
        token: str,
        *,
        replicas: int = DEFAULT_REPLICAS,
        lag_bound: int = DEFAULT_LAG_BOUND,
        bandwidth: float = 0.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.folder, self.job_id, self.node_id, self.token = folder, job_id, node_id, token
        self.replicas, self.lag_bound, self.bandwidth, self.tls = replicas, lag_bound, bandwidth, tls
        self.targets: tuple[str, ...] = ()  # "host:port" of the successors, from the master
        self.newest: int | None = None  # newest committed local step
        self.replicated: int | None = None
        self.error = ""
        self.pushed_bytes = 0
        self.push_seconds = 0.0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="replicator", daemon=True)

    def start(self) -> Replicator:
        self._write_status()
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def set_targets(self, targets: list[str]) -> None:
        """The endpoints of this node's successors (from the master; '' where not known yet)."""
        known = tuple(t for t in targets[: self.replicas] if t)
        with self._cond:
            if known != self.targets:
                self.targets = known
                self.replicated = None if known else self.replicated
                self._cond.notify_all()
        self._write_status()

    def on_saved(self, step: int) -> None:
        """Local rank 0 committed a sharded save of ``step``."""
        with self._cond:
            self.newest = step
            self._cond.notify_all()

    def status(self) -> ReplicationStatus:
        with self._cond:
            if not self.targets or self.replicas <= 0:
                return ReplicationStatus(self.replicated, None, self.error)
            if self.newest is None:
                return ReplicationStatus(self.replicated, 0, self.error)
            lag = self.newest - (self.replicated if self.replicated is not None else -1)
            return ReplicationStatus(self.replicated, max(0, lag), self.error)

    def wait_replicated(self, step: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: (self.replicated or -1) >= step, timeout)

    def _write_status(self) -> None:
        with self._cond:
            value = {
                "enabled": bool(self.targets) and self.replicas > 0,
                "bound": self.lag_bound,
                "replicated": self.replicated,
            }
        with contextlib.suppress(OSError):
            sl.write_json(self.folder / STATUS_FILE, value)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping
                        or (self.targets and self.newest is not None and self.newest != self.replicated)
                    )
                )
                if self._stopping:
                    return
                targets = self.targets
            committed = sl.committed(self.folder / sl.SHARDED_SUBDIR)
            if not committed:
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            step, save_id, data = committed[0]
            try:
                for target in targets:
                    self._push(target, step, save_id, data)
            except (ReplicationError, OSError) as exc:
                with self._cond:
                    self.error = f"step {step} to {target}: {exc}"
                log.warning("replication of step %d to %s failed: %s", step, target, exc)
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            with self._cond:
                self.replicated, self.error = step, ""
                self._cond.notify_all()
            self._write_status()

    def _connect(self, target: str) -> socket.socket:
        host, _, port = target.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=_IO_TIMEOUT_S)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=host.strip("[]"))
            except ssl.SSLError as exc:
                sock.close()
                raise ReplicationError(f"TLS handshake failed ({exc.reason or exc}); {TLS_RULE}") from None
        return sock

    def _push(self, target: str, step: int, save_id: str, data: Path) -> None:
        names = sorted(
            e.name for e in os.scandir(data) if _valid_name(e.name) and e.is_file(follow_symlinks=False)
        )
        with contextlib.ExitStack() as stack:
            # Shared locks: the workers do not recycle these segments while they are read.
            files = []
            for name in names:
                try:
                    files.append((name, stack.enter_context(layout.open_shared(data / name))))
                except FileNotFoundError:
                    raise ReplicationError(f"step {step} was replaced in memory during its push") from None
            sock = stack.enter_context(self._connect(target))
            reader = _Reader(sock)
            try:
                nonce = reader.line().get("nonce")
            except (OSError, ValueError) as exc:  # a TLS listener waits for a handshake this side never sends
                hint = f"; {TLS_RULE}" if self.tls is None else ""
                raise ReplicationError(f"no greeting from the peer ({exc}){hint}") from None
            if not isinstance(nonce, str):
                raise ReplicationError("malformed greeting")
            _send_line(
                sock,
                {
                    "job": self.job_id,
                    "node": self.node_id,
                    "mac": _mac(self.token, nonce, self.job_id, self.node_id),
                },
            )
            self._expect_ok(reader, "authentication")
            sizes = [(name, os.fstat(f.fileno()).st_size) for name, f in files]
            _send_line(sock, {"step": step, "save_id": save_id, "files": [[n, s] for n, s in sizes]})
            started = time.monotonic()
            sent = 0
            digests = {}
            for (name, f), (_, size) in zip(files, sizes, strict=True):
                digest = hashlib.sha256()
                left = size
                while left > 0:
                    chunk = f.read(min(_CHUNK, left))
                    if not chunk:
                        raise ReplicationError(f"{name} shrank during its push")
                    digest.update(chunk)
                    sock.sendall(chunk)
                    left -= len(chunk)
                    sent += len(chunk)
                    self._throttle(sent, started)
                digests[name] = digest.hexdigest()
            _send_line(sock, {"sha256": digests})
            self._expect_ok(reader, "the push")
            with self._cond:
                self.pushed_bytes += sent
                self.push_seconds += time.monotonic() - started

    def _throttle(self, sent: int, started: float) -> None:
        if self.bandwidth <= 0:
            return
        ahead = sent / self.bandwidth - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)

    @staticmethod
    def _expect_ok(reader: _Reader, what: str) -> None:
        reply = reader.line()
        if reply.get("ok") is not True:
            raise ReplicationError(f"the peer refused {what}: {reply.get('error', 'no reason given')}")


def tls_contexts(
    tls_cert: str | None, tls_key: str | None, tls_ca: str | None
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """``(listener's, sender's)`` TLS contexts under the one rule (:data:`TLS_RULE`): both when the agent
    has a certificate and key, neither otherwise (an agent with only ``--tls-ca`` verifies the master,
    and its peers' listeners, lacking certificates, speak plain TCP).

    Raises:
        TLSConfigError: a file cannot be used, or a certificate is given without a CA to verify peers.
    """
    from elastic.tls import TLSConfigError, client_context, server_context

    if not (tls_cert and tls_key):
        return None, None
    if not tls_ca:
        raise TLSConfigError("replication over TLS (--tls-cert/--tls-key) needs --tls-ca to verify peers")
    return server_context(tls_cert, tls_key), client_context(tls_ca)


def attach(keeper, settings) -> None:  # noqa: ANN001 - agent.ckpt_keeper / agent.settings (no cycle)
    """Start peer replication for ``keeper``'s folder per the agent's settings (``--replicas`` 0: off).

    Raises:
        AgentError: the listener cannot start (its address and token break the listener rules, a TLS
            file cannot be used, the address cannot be bound).
    """
    if settings.replicas <= 0:
        return
    from agent.errors import EXIT_CONFIG, AgentError
    from elastic.auth import derived_token
    from elastic.listener_rules import ListenerRuleError
    from elastic.tls import TLSConfigError

    host = settings.local_addr or "127.0.0.1"
    auth = Auth.DERIVED if settings.token == derived_token(settings.job.job_id) else Auth.SECRET
    try:
        served, client = tls_contexts(settings.tls_cert, settings.tls_key, settings.tls_ca)
        keeper.replica_server = ReplicaServer(
            keeper.folder, settings.job.job_id, settings.token, host, tls=served, auth=auth
        ).start()
    except (ListenerRuleError, TLSConfigError, OSError) as exc:
        # Not a shared-memory problem: its own message (a rule or TLS file: exit 2, as other config errors).
        raise AgentError(
            f"cannot start the replication listener on {host} (--replicas; 0 turns replication off): {exc}",
            EXIT_CONFIG,
        ) from None
    keeper.replicator = Replicator(
        keeper.folder,
        settings.job.job_id,
        settings.node_id,
        settings.token,
        replicas=settings.replicas,
        lag_bound=settings.replication_lag,
        bandwidth=settings.replication_bandwidth * 1e6,
        tls=client,
    ).start()
