"""Peer replication throughput and lag (agent/checkpoints/replication.py), for bench/checkpoint.py.

In this process: a real :class:`~agent.checkpoints.replica_server.ReplicaServer` and
:class:`~agent.checkpoints.replication.Replicator` over loopback TCP (threads), a node's sharded save of
``MB`` as files in a shared-memory folder.

* ``replication push``: from ``on_saved`` to every byte received, hashed (sha256 on both sides), MACed
  (HMAC-SHA256 under the push's key, both sides) and committed by the peer; against
* ``loopback TCP``: the same bytes through a plain socket pair (``sendall`` / ``recv_into``), the
  transport's limit on this machine;
* ``lag wait``: saves back to back (no compute between them) under the lag bound 1: how long each save
  waits for the previous step's replica, and the lag (steps) seen when a save starts.

Fake nodes on one machine share its memory bandwidth and cores: this measures the code path, not a
network.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from agent.checkpoints.replica_server import ReplicaServer
from agent.checkpoints.replication import Replicator
from agent.checkpoints.replication_wire import pair_key
from elastic.checkpoint import shard_layout as sl

_CHUNK = 4 << 20


def _node_save(shm: Path, step: int, payload: bytes, files: int = 2) -> None:
    """A node's committed sharded save: ``files`` data files sharing ``payload`` bytes."""
    root = shm / sl.SHARDED_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    save_id = f"{step:016x}"
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir()
    part = len(payload) // files
    sizes = {}
    for i in range(files):
        name = f"__{i}_0.distcp"
        (tmp / name).write_bytes(payload[i * part : (i + 1) * part])
        sizes[name] = part
    (tmp / sl.METADATA).write_bytes(b"metadata")
    sl.write_json(tmp / sl.MANIFEST, {"files": sizes})
    sl.commit(root, tmp, step, save_id)
    sl.prune(root, 2)


def loopback_seconds(nbytes: int) -> float:
    """Seconds to move ``nbytes`` through a loopback TCP connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = server.accept()
        buffer = bytearray(_CHUNK)
        with conn:
            while (n := conn.recv_into(buffer)) > 0:
                received += n

    thread = threading.Thread(target=sink)
    thread.start()
    chunk = os.urandom(_CHUNK)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.perf_counter()
        for offset in range(0, nbytes, _CHUNK):
            sock.sendall(memoryview(chunk)[: min(_CHUNK, nbytes - offset)])
        sock.shutdown(socket.SHUT_WR)
        thread.join()
        seconds = time.perf_counter() - started
    server.close()
    return seconds


def bench_replication(megabytes: float, repeats: int) -> dict:
    """Push throughput vs loopback TCP, and the lag bound's wait with saves back to back."""
    nbytes = int(megabytes * 1e6)
    payload = os.urandom(nbytes)
    work = Path(tempfile.mkdtemp(prefix="elastic-bench-repl-", dir="/dev/shm"))
    a, b = work / "A", work / "B"
    a.mkdir()
    b.mkdir()
    server = ReplicaServer(b, "bench", "127.0.0.1").start()
    receiver_key = os.urandom(32)  # as the master hands it out (master.job.views.replication_fields)
    server.set_key(receiver_key.hex())
    sender = Replicator(a, "bench", "nodeA", replicas=1, lag_bound=1).start()
    sender.set_targets([f"127.0.0.1:{server.port}"], [pair_key(receiver_key, "nodeA").hex()])
    pushes, loopbacks, waits, lags = [], [], [], []
    try:
        for step in range(1, repeats + 1):
            _node_save(a, step, payload)
            started = time.perf_counter()
            sender.on_saved(step)
            if not sender.wait_replicated(step, timeout=600):
                raise RuntimeError(f"replication of step {step} failed: {sender.error}")
            pushes.append(time.perf_counter() - started)
            loopbacks.append(loopback_seconds(nbytes))
        # Saves back to back under the bound: save N waits until N-1 is replicated.
        first = repeats + 1
        for step in range(first, first + repeats + 1):
            if step > first:
                lags.append(sender.status().lag or 0)
                started = time.perf_counter()
                if not sender.wait_replicated(step - 1, timeout=600):
                    raise RuntimeError(f"replication of step {step - 1} failed: {sender.error}")
                waits.append(time.perf_counter() - started)
            _node_save(a, step, payload)
            sender.on_saved(step)
    finally:
        sender.stop()
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    push, loop = statistics.median(pushes), statistics.median(loopbacks)
    return {
        "kind": "replication",
        "bytes": nbytes,
        "push_s": push,
        "push_mb_s": nbytes / push / 1e6,
        "loopback_tcp_s": loop,
        "loopback_tcp_mb_s": nbytes / loop / 1e6,
        "push_over_loopback": push / loop,
        "lag_wait_s": statistics.median(waits),
        "lag_steps_at_save": statistics.median(lags),
        "repeats": repeats,
    }
