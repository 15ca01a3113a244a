"""The receiving side of peer replication: a listener that accepts this node's ring predecessors' pushes
of their sharded saves into ``<shm>/replicas/<node>/sharded`` (the wire:
:mod:`agent.checkpoints.replication_wire`).

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import threading
from pathlib import Path

from agent.checkpoints.replication_wire import (
    IO_TIMEOUT_S,
    Reader,
    ReplicationError,
    mac,
    send_line,
    valid_name,
)
from elastic.checkpoint import shard_layout as sl
from elastic.control.listener_rules import REPLICATION, Auth, check_listener

log = logging.getLogger(__name__)

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


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
                node = self._authenticate(conn, reader)
                self._receive(conn, reader, node)
            except (ReplicationError, OSError) as exc:
                log.warning("replication: a push from a peer failed: %s", exc)
                with contextlib.suppress(OSError):
                    send_line(conn, {"ok": False, "error": str(exc)})

    def _authenticate(self, conn: socket.socket, reader: Reader) -> str:
        nonce = secrets.token_hex(16)
        send_line(conn, {"nonce": nonce})
        hello = reader.line()
        job, node, proof = hello.get("job"), hello.get("node"), hello.get("mac")
        if not (isinstance(job, str) and isinstance(node, str) and isinstance(proof, str)):
            raise ReplicationError("malformed hello")
        if job != self.job_id or not hmac.compare_digest(proof, mac(self.token, nonce, job, node)):
            raise ReplicationError("authentication failed (another job, or a wrong token)")
        if not _NODE.match(node):
            raise ReplicationError("bad node id")
        send_line(conn, {"ok": True})
        return node

    def _receive(self, conn: socket.socket, reader: Reader, node: str) -> None:
        header = reader.line()
        step, save_id, files = header.get("step"), header.get("save_id"), header.get("files")
        if not (isinstance(step, int) and step >= 0 and isinstance(save_id, str) and isinstance(files, list)):
            raise ReplicationError("malformed push header")
        if not re.fullmatch(r"[0-9a-f]{16}", save_id):
            raise ReplicationError("bad save id")
        listed = []
        for item in files:
            if not (
                isinstance(item, list) and len(item) == 2 and valid_name(item[0]) and isinstance(item[1], int)
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
        send_line(conn, {"ok": True})
