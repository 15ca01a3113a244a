"""Peer replication of sharded memory checkpoints: each agent streams its node's newest sharded save to
the agents of the next ``replicas`` nodes in rank order (a ring: any single node's loss leaves a copy of
its shards on a survivor), agent to agent over TCP, never through the master.

**Placement**: node rank ``r`` sends to ranks ``r+1 .. r+k`` (mod the round's node count), ``k`` =
``--replicas`` (default 1, at most nodes - 1), and to the hot spares it feeds (spare ``j`` receives from
node rank ``j`` mod nodes: :func:`master.job.views.replica_targets`). The master hands each agent its
targets' endpoints in its heartbeat replies (soft state, from the targets' own heartbeats).

**Wire** (:mod:`agent.checkpoints.replication_wire`): one connection per push. The sender proves the pair
key the master handed it for that target (``CommandReply.peer_keys``; the receiver derives the same key
from its own, ``CommandReply.replication_key``), the receiver proves it back, and the stream (header,
bytes, digests) carries an HMAC under a key of that push; the receiver
(:mod:`agent.checkpoints.replica_server`) commits a step only when the MAC and every digest match, and
refuses a push over the sender's share of its shared memory before any byte is written. A target the
master gave no key for (an older master) is not pushed to: the error says so.

**Lag**: the replicated step is the newest step every target acknowledged; the lag is the newest local
save's step minus it. The sender writes ``<shm>/replication.json`` (``enabled``, ``bound``,
``replicated``) after each push; a worker's next save waits while saving would exceed the bound
(:mod:`elastic.checkpoint.shard_save`). The agent's heartbeats report step, lag and last error.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoints import replication_wire as wire
from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication_wire import (
    CHUNK,
    IO_TIMEOUT_S,
    TLS_RULE,
    Reader,
    ReplicationError,
    expect_ok,
    send_line,
    tls_contexts,
    valid_name,
)
from elastic.checkpoint import layout
from elastic.checkpoint import shard_layout as sl
from elastic.control.listener_rules import Auth

log = logging.getLogger(__name__)

STATUS_FILE = "replication.json"
DEFAULT_REPLICAS = 1
DEFAULT_LAG_BOUND = 1
_RETRY_S = 0.5


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
        *,
        replicas: int = DEFAULT_REPLICAS,
        lag_bound: int = DEFAULT_LAG_BOUND,
        bandwidth: float = 0.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.folder, self.job_id, self.node_id = folder, job_id, node_id
        self.replicas, self.lag_bound, self.bandwidth, self.tls = replicas, lag_bound, bandwidth, tls
        self.targets: tuple[str, ...] = ()  # "host:port" of the successors, from the master
        self._keys: dict[str, bytes] = {}  # each target's pair key K(this node→target), from the master
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

    def set_targets(self, targets: list[str], keys: list[str] | None = None) -> None:
        """The endpoints of this node's successors and the pair key of each (hex), from the master's
        heartbeat reply; '' where not known yet. A target without a key (an elastic-master older than
        this agent hands out none) is not pushed to, and the error says why."""
        given = list(keys or [])
        known: list[str] = []
        keyed: dict[str, bytes] = {}
        keyless = []
        for i, target in enumerate(targets):  # the master bounds them: ring successors, then hot spares
            if not target:
                continue
            key = _key_bytes(given[i] if i < len(given) else "")
            if key is None:
                keyless.append(target)
                continue
            known.append(target)
            keyed[target] = key
        with self._cond:
            if tuple(known) != self.targets or keyed != self._keys:
                self.targets, self._keys = tuple(known), keyed
                self.replicated = None if known else self.replicated
                self._cond.notify_all()
            if keyless:
                self.error = (
                    f"the master gave no replication key for {', '.join(keyless)} (an elastic-master "
                    "older than this agent): those peers get no replica; upgrade the master"
                )
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
                targets, keys = self.targets, dict(self._keys)
            committed = sl.committed(self.folder / sl.SHARDED_SUBDIR)
            if not committed:
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            step, save_id, data = committed[0]
            try:
                for target in targets:
                    self._push(target, keys[target], step, save_id, data)
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
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=IO_TIMEOUT_S)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=host.strip("[]"))
            except ssl.SSLError as exc:
                sock.close()
                raise ReplicationError(f"TLS handshake failed ({exc.reason or exc}); {TLS_RULE}") from None
        return sock

    def _push(self, target: str, key: bytes, step: int, save_id: str, data: Path) -> None:
        names = sorted(
            e.name for e in os.scandir(data) if valid_name(e.name) and e.is_file(follow_symlinks=False)
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
            reader = Reader(sock)
            try:
                greeting = reader.line()
            except (OSError, ValueError) as exc:  # a TLS listener waits for a handshake this side never sends
                hint = f"; {TLS_RULE}" if self.tls is None else ""
                raise ReplicationError(f"no greeting from the peer ({exc}){hint}") from None
            if greeting.get("ok") is False:  # e.g. busy: the refusal comes instead of a greeting
                raise ReplicationError(f"the peer refused the connection: {greeting.get('error')}")
            theirs = greeting.get("nonce")
            if not isinstance(theirs, str):
                raise ReplicationError("malformed greeting")
            ours = secrets.token_hex(16)
            proof = wire.hello_mac(key, self.job_id, self.node_id, theirs, ours)
            send_line(sock, {"job": self.job_id, "node": self.node_id, "nonce": ours, "mac": proof})
            welcome = expect_ok(reader, "authentication")
            if not wire.matches(wire.welcome_mac(key, theirs, ours), welcome.get("mac")):
                raise ReplicationError(
                    "the listener did not prove it is the node the master named (a stale address, or "
                    "keys of another master)"
                )
            session = wire.session_key(key, theirs, ours)
            sizes = [(name, os.fstat(f.fileno()).st_size) for name, f in files]
            header = wire.encode({"step": step, "save_id": save_id, "files": [[n, s] for n, s in sizes]})
            sock.sendall(header)
            expect_ok(reader, "the push")  # within this node's share of the peer's memory
            mac = wire.stream_mac(session, header[:-1])
            started = time.monotonic()
            sent = 0
            digests = {}
            for (name, f), (_, size) in zip(files, sizes, strict=True):
                digest = wire.new_digest()
                left = size
                while left > 0:
                    chunk = f.read(min(CHUNK, left))
                    if not chunk:
                        raise ReplicationError(f"{name} shrank during its push")
                    digest.update(chunk)
                    mac.update(chunk)
                    sock.sendall(chunk)
                    left -= len(chunk)
                    sent += len(chunk)
                    self._throttle(sent, started)
                digests[name] = digest.hexdigest()
            mac.update(wire.digests_bytes(digests))
            send_line(sock, {wire.DIGEST_KEY: digests, "mac": mac.hexdigest()})
            done = expect_ok(reader, "the replica")
            if not wire.matches(wire.committed_mac(session, step, save_id), done.get("mac")):
                raise ReplicationError("the peer's acknowledgement of the push carries no valid proof")
            with self._cond:
                self.pushed_bytes += sent
                self.push_seconds += time.monotonic() - started

    def _throttle(self, sent: int, started: float) -> None:
        if self.bandwidth <= 0:
            return
        ahead = sent / self.bandwidth - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


def attach(keeper, settings) -> None:  # noqa: ANN001 - agent.checkpoints.keeper / agent.settings (no cycle)
    """Start peer replication for ``keeper``'s folder per the agent's settings (``--replicas`` 0: off).

    Raises:
        AgentError: the listener cannot start (its address and token break the listener rules, a TLS
            file cannot be used, the address cannot be bound).
    """
    if settings.replicas <= 0:
        return
    from agent.errors import EXIT_CONFIG, AgentError
    from elastic.control.auth import derived_token
    from elastic.control.listener_rules import ListenerRuleError
    from elastic.control.tls import TLSConfigError

    host = settings.local_addr or "127.0.0.1"
    auth = Auth.DERIVED if settings.token == derived_token(settings.job.job_id) else Auth.SECRET
    try:
        served, client = tls_contexts(settings.tls_cert, settings.tls_key, settings.tls_ca)
        cap_mib = settings.replication_peer_cap
        keeper.replica_server = ReplicaServer(
            keeper.folder,
            settings.job.job_id,
            host,
            tls=served,
            auth=auth,
            peer_cap=cap_mib << 20 if cap_mib else None,
            sources=settings.replicas,
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
        replicas=settings.replicas,
        lag_bound=settings.replication_lag,
        bandwidth=settings.replication_bandwidth * 1e6,
        tls=client,
    ).start()


def follow_master(keeper, peers: list[str], peer_keys: list[str], receiver_key: str) -> None:  # noqa: ANN001
    """What a heartbeat reply says about replication (``CommandReply.peers``, ``peer_keys``,
    ``replication_key``): this node's targets with their pair keys, and its own receiver key. ``keeper``:
    an agent.checkpoints.keeper.CheckpointKeeper (replication off: nothing to do)."""
    if keeper.replica_server is not None:
        keeper.replica_server.set_key(receiver_key)
    if keeper.replicator is not None:
        keeper.replicator.set_targets(peers, peer_keys)


def _key_bytes(text: str) -> bytes | None:
    """A pair key from its hex (None: none given, or not hex)."""
    try:
        return bytes.fromhex(text) if text else None
    except ValueError:
        return None
