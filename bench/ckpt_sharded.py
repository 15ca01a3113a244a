"""The ``sharded`` kind of bench/checkpoint.py: ``elastic.save_sharded`` under an agent's shared memory,
every rank saving its own shard at once, against a copy of the same bytes into a pre-faulted buffer.

    python bench/ckpt_sharded.py RANK WORLD PORT SHM_DIR MB REPEATS OUT_JSON   (one process per rank)
    python bench/ckpt_sharded.py restore RANK WORLD PORT WORK_DIR MB REPEATS OUT_JSON DISK_DIR

bench/checkpoint.py starts ``WORLD`` rank processes (gloo, one torch thread each, one fake node: a
shared-memory folder without an agent) and reads rank 0's JSON. Each rank's state is ``MB`` of float32
in ten DTensors sharded on dim 0 (``DTensor.from_local``): ``MB`` per rank. Steady-state saves recycle
the double buffer; the first save allocates it (reported). No replication (no agent): its throughput is
measured apart (bench/ckpt_replication.py).

``restore``: each rank is a node of its own (its own shared-memory folder under ``WORK_DIR``, local rank
0), after one flash save of ``MB`` per rank; ``elastic.load_sharded`` (median of ``REPEATS``) from

* ``own memory``: every node holds its own shards;
* ``peer memory``: node 1 was replaced by an empty one; node 0 holds node 1's replica (as the agents'
  replication leaves it, with its xxh3 digests, checked at restore) and sends it over the process group;
  between the repeats rank 0 measures the references: loopback TCP moving the same bytes
  (bench/ckpt_replication.py) and the digest over them;
* ``disk``: every node empty; the step persisted to ``DISK_DIR`` by the agents' persist
  (agent.checkpoints.sharded_persist), its pages evicted from the page cache first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import ckpt_replication, common  # noqa: E402 - after the path insertion above


def main() -> None:
    rank, world, port, shm, megabytes, repeats, out = sys.argv[1:8]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, ELASTIC_LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1"
    )
    os.environ.update(MASTER_PORT=port, ELASTIC_SHM_DIR=shm)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import elastic
    from elastic.checkpoint import dcp_io

    torch.set_num_threads(1)
    elastic.init_process_group()
    mesh = init_device_mesh("cpu", (int(world),))
    rows = int(float(megabytes) * 1e6 / 4 / 10 / 1024)
    locals_ = [torch.randn(rows, 1024) for _ in range(10)]
    state = {"model": {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)]) for i, t in enumerate(locals_)}}
    size = sum(t.nbytes for t in locals_)
    buffer = torch.zeros(size, dtype=torch.uint8)

    def memcpy() -> None:
        offset = 0
        for t in locals_:
            buffer[offset : offset + t.nbytes].copy_(t.view(-1).view(torch.uint8))
            offset += t.nbytes

    dist.barrier()
    start = time.perf_counter()
    elastic.save_sharded(state, 1)
    first = time.perf_counter() - start
    # Of which allocating and pre-faulting both halves of the double buffer (this save's segments and
    # the spares the next save takes).
    prefault = dcp_io.pool_for(Path(shm) / "sharded").prefault_s
    saves, copies = [], []
    for step in range(2, int(repeats) + 2):
        dist.barrier()
        start = time.perf_counter()
        elastic.save_sharded(state, step)
        saves.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        memcpy()
        copies.append(time.perf_counter() - start)
    if rank == "0":
        result = common.save_block_result("sharded", size, saves, copies, first, prefault)
        result |= {"ranks": int(world), "torch_threads_per_rank": 1}
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    elastic.destroy_process_group()


def _evict(folder: Path) -> None:
    """Drop a folder's files from the page cache (they are fsynced, so their pages are clean)."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_main() -> None:
    rank, world, port, work, megabytes, repeats, out, disk = sys.argv[2:10]
    work_dir, disk_dir = Path(work), Path(disk)
    own = work_dir / f"node{rank}"
    own.mkdir(parents=True, exist_ok=True)
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK="0", ELASTIC_LOCAL_RANK="0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ELASTIC_SHM_DIR=str(own))
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import elastic
    from agent.checkpoints import sharded_persist
    from elastic.checkpoint import shard_layout as sl

    torch.set_num_threads(1)
    elastic.init_process_group()
    mesh = init_device_mesh("cpu", (int(world),))
    rows = int(float(megabytes) * 1e6 / 4 / 10 / 1024)

    def state(fill: bool) -> dict:
        make = torch.randn if fill else torch.zeros
        return {"model": {f"w{i}": DTensor.from_local(make(rows, 1024), mesh, [Shard(0)]) for i in range(10)}}

    elastic.save_sharded(state(True), 1)
    step, save_id, data = sl.committed(own / sl.SHARDED_SUBDIR)[0]
    sharded_persist.persist(
        data,
        disk_dir / sl.SHARDED_SUBDIR,
        step=step,
        save_id=save_id,
        round_=1,
        keep=2,
        copy=shutil.copyfileobj,
    )
    if rank == "1":  # node 0 keeps node 1's replica, as the agents' replication leaves it
        held = work_dir / "node0" / sl.REPLICAS_SUBDIR / "node1" / sl.SHARDED_SUBDIR
        held.mkdir(parents=True)
        tmp = held / sl.tmp_dir_name(step, save_id)
        shutil.copytree(data, tmp)
        # The digests the agents' replica server records (xxh3_128, agent/checkpoints/replica_server.py).
        sl.write_json(tmp / sl.HASHES, {p.name: sl.file_digest(p) for p in tmp.iterdir() if p.is_file()})
        sl.commit(held, tmp, step, save_id)
    dist.barrier()

    def timed(setup) -> list[float]:
        times = []
        for i in range(int(repeats)):
            setup(i)
            target = state(False)
            dist.barrier()
            started = time.perf_counter()
            if elastic.load_sharded(target) != step:
                raise RuntimeError("the restore did not load the saved step")
            times.append(time.perf_counter() - started)
        os.environ["ELASTIC_SHM_DIR"] = str(own)
        os.environ.pop("ELASTIC_CKPT_DIR", None)
        return times

    def fresh(i: int, who: set[str]) -> None:
        if rank in who:
            empty = work_dir / f"empty{rank}-{i}"
            empty.mkdir()
            os.environ["ELASTIC_SHM_DIR"] = str(empty)

    def from_disk(i: int) -> None:
        fresh(i + 1000, {"0", "1"})
        os.environ["ELASTIC_CKPT_DIR"] = str(disk_dir)
        _evict(disk_dir / sl.SHARDED_SUBDIR / sl.data_dir_name(step, save_id))

    # The references of the peer restore, measured between its repeats on rank 0 (the sender): loopback
    # TCP moving node 1's bytes, and the digest check over them (xxh3 of the replica's files).
    replica = sl.committed(work_dir / "node0" / sl.REPLICAS_SUBDIR / "node1" / sl.SHARDED_SUBDIR)
    moved = [p for p in sorted(replica[0][2].iterdir()) if sl.file_id(p.name) is not None] if replica else []
    moved_bytes = sum(p.stat().st_size for p in moved) if rank == "0" else 0
    tcp: list[float] = []
    digests: list[float] = []

    def peer(i: int) -> None:
        if rank == "0":
            tcp.append(ckpt_replication.loopback_seconds(moved_bytes))
            started = time.perf_counter()
            for path in moved:
                sl.file_digest(path)
            digests.append(time.perf_counter() - started)
        fresh(i, {"1"})

    results = {
        "own_memory_s": timed(lambda i: None),
        "peer_memory_s": timed(peer),
        "disk_s": timed(from_disk),
    }
    if rank == "0":
        size = rows * 1024 * 4 * 10
        references = {"peer_bytes": moved_bytes, "loopback_tcp_s": tcp, "peer_digest_s": digests}
        Path(out).write_text(json.dumps({"bytes": size, "ranks": int(world), **results, **references}))
    dist.barrier()
    elastic.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "restore":
        restore_main()
    else:
        main()
