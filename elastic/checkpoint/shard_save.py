"""Writing a sharded save (:func:`elastic.sharded.save_sharded`): a flash save into the node's shared
memory under elastic-run, else a save to a disk folder all ranks share.

**Flash**: every rank writes its own shards into ``<shm>/sharded`` through DCP's writer with its data
files in reused, pre-faulted segments (:mod:`elastic.checkpoint.dcp_io`), and returns; local rank 0 of
the node then commits the node's folder and reports it to the agent. A rank's save first waits until local
rank 0 committed its previous one (the double buffer's newest stays protected from reuse), and while
the node's replication lags more than the agent's bound (``<shm>/replication.json``).

**Disk**: every rank writes its shards to ``<ckpt_dir>/sharded``; global rank 0 commits once all have
written. Both follow :mod:`elastic.checkpoint.shard_layout`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, cast

from elastic import collectives
from elastic.checkpoint import shard_layout as sl
from elastic.checkpoint.env import CKPT_DIR_ENV, SHM_DIR_ENV, CheckpointError, node_local_rank
from elastic.report import report_checkpoint

log = logging.getLogger(__name__)

#: Sharded saves kept in a node's shared memory: the newest and the one before it (the double buffer).
MEMORY_KEEP = 2
#: The agent's replication state, read by a save that waits for the lag bound.
REPLICATION_STATUS = "replication.json"
#: Longest wait of a save for the replication lag (a peer gone: the master starts a new round meanwhile).
REPLICATION_WAIT_S = 300.0
_saved: list[int] = []  # steps this process saved into shared memory, oldest first (a few)
_previous: tuple[Path, int, str] | None = None  # (root, step, save id) of this process's last save
#: (folder, rank, world size) -> this process's last recorded save there (elastic.checkpoint.dcp_io); a
#: file's name holds the rank, so another rank or world never replays it.
_replays: dict[tuple[Path, int, int], Any] = {}


def _shared_save_id() -> str:
    return sl.save_id_str(collectives.broadcast_int(sl.save_id_int(sl.new_save_id()), src=0) or 0)


def disk_save(state: dict[str, Any], step: int, root: Path, keep: int) -> Path:
    """Save ``state`` into the shared disk folder ``root`` (every rank calls it), keeping ``keep``."""
    import torch.distributed.checkpoint as dcp  # heavy (about 1.5 s); only for sharded checkpoints

    save_id = _shared_save_id()
    tmp = root / sl.tmp_dir_name(step, save_id)
    if collectives.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    collectives.barrier()
    metadata = dcp.save(state, checkpoint_id=tmp)  # every rank writes its shards; rank 0 the metadata
    if collectives.rank() == 0:
        sl.write_json(tmp / sl.MANIFEST, _manifest(metadata, step, save_id))
        data = sl.commit(root, tmp, step, save_id, durable=True)
        sl.write_latest(root, step)
        sl.prune(root, keep)
        sl.remove_temp_dirs(root, older_than=step)
    else:
        data = root / sl.data_dir_name(step, save_id)
    collectives.barrier()  # nobody goes on (and possibly loads) before the commit
    report_checkpoint(step)
    return data


def _manifest(metadata: Any, step: int, save_id: str) -> dict[str, Any]:
    """The data files of a save and their sizes (DCP's files end with their last record)."""
    files: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
    return {"step": step, "save_id": save_id, "files": files}


def _replication_wait(shm: Path, step: int) -> None:
    """Wait while saving ``step`` would let this node's replication lag exceed the agent's bound."""
    deadline = time.monotonic() + REPLICATION_WAIT_S
    pause = 0.001
    while True:
        try:
            status = json.loads((shm / REPLICATION_STATUS).read_text())
        except (OSError, ValueError):
            return  # no replication (a single node, or replicas 0)
        if not status.get("enabled"):
            return
        bound = int(status.get("bound", 1))
        older = [s for s in _saved if s <= step - bound]
        replicated = status.get("replicated")
        if not older or (replicated is not None and int(replicated) >= older[-1]):
            return
        if time.monotonic() > deadline:
            log.warning(
                "elastic.save_sharded: step %d not replicated after %.0fs; saving step %d anyway",
                older[-1],
                REPLICATION_WAIT_S,
                step,
            )
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _wait_committed(root: Path, step: int, save_id: str, timeout: float = 60.0) -> None:
    """Wait until local rank 0 committed this process's previous save (the double buffer's newest)."""
    deadline = time.monotonic() + timeout
    link = root / sl.step_link_name(step)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if os.readlink(link) == sl.data_dir_name(step, save_id):
                return
        time.sleep(0.002)
    # Local rank 0 died or hangs: its data folder stays protected from reuse, and this save goes on.
    log.warning("elastic.save_sharded: step %d was not committed by local rank 0 within %.0fs", step, timeout)


def flash_save(state: dict[str, Any], step: int, shm: Path, ckpt_dir: str | os.PathLike[str] | None) -> Path:
    """Save ``state`` into the node's shared-memory folder ``shm`` (every rank calls it)."""
    from torch.distributed.checkpoint.stateful import Stateful

    from elastic.checkpoint import dcp_io, segments

    global _previous
    if not shm.is_dir():
        raise CheckpointError(
            f"the agent's shared-memory folder {shm} ({SHM_DIR_ENV}) does not exist; "
            "is the elastic-run agent of this worker still running?"
        )
    root = shm / sl.SHARDED_SUBDIR
    root.mkdir(exist_ok=True)
    protect: set[str] = set()
    if _previous is not None and _previous[0] == root:
        _wait_committed(root, _previous[1], _previous[2])
        protect.add(sl.data_dir_name(_previous[1], _previous[2]))
    _replication_wait(shm, step)
    save_id = _shared_save_id()
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir(exist_ok=True)
    pool = dcp_io.pool_for(root)
    pool.fresh_bytes, pool.prefault_s = 0, 0.0
    first = _previous is None or _previous[0] != root
    state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}  # as DCP does
    try:
        with dcp_io.crc_off():
            metadata = _replayed(state, root, tmp, pool, step, save_id, protect)
            if metadata is None:
                metadata = _recorded(state, root, tmp, pool, step, save_id, protect)
        if first:
            pool.add_spares(step, save_id)  # the double buffer's other half, pre-faulted now
    except segments.NoSpaceError as exc:
        raise _space_error(step, shm, exc.need, exc.free) from None
    if pool.fresh_bytes:
        log.info(
            "sharded flash save of step %d: %.1f MiB of shared memory allocated and pre-faulted in %.2f s",
            step,
            pool.fresh_bytes / (1 << 20),
            pool.prefault_s,
        )
    _previous = (root, step, save_id)
    _saved.append(step)
    del _saved[:-4]
    data = root / sl.data_dir_name(step, save_id)
    if node_local_rank() != 0:
        report_checkpoint(step)
        return data
    # Every rank of the node wrote its files (DCP gathers the write results after the writes): commit.
    if not (tmp / sl.METADATA).exists():
        with open(tmp / sl.METADATA, "wb") as f:  # the node's copy of rank 0's metadata
            pickle.dump(metadata, f)
    sl.write_json(tmp / sl.MANIFEST, _manifest(metadata, step, save_id))
    sl.commit(root, tmp, step, save_id)
    sl.prune(root, MEMORY_KEEP, newest=step)
    sl.remove_temp_dirs(root, older_than=step)
    folder = ckpt_dir or os.environ.get(CKPT_DIR_ENV) or ""
    persist_to = str(Path(folder).resolve()) if folder else ""
    report_checkpoint(step, str(root / sl.step_link_name(step)), persist_to)
    return data


def _replay_key(root: Path) -> tuple[Path, int, int]:
    return root, collectives.rank(), collectives.world_size()


def _replayed(
    state: dict[str, Any], root: Path, tmp: Path, pool: Any, step: int, save_id: str, protect: set[str]
) -> Any:
    """Replay this process's last recorded save with ``state``'s bytes (elastic.checkpoint.dcp_io) when
    every
    rank can: DCP's metadata, or None (every rank then makes a full save)."""
    from elastic.checkpoint import dcp_io

    key = _replay_key(root)
    replay = _replays.get(key)
    try:
        chunks = replay.prepare(state) if replay is not None else None
    except Exception as exc:  # noqa: BLE001 - a state DCP's planner cannot take: the full save says why
        log.debug("elastic.save_sharded: not replaying step %d: %r", step, exc)
        chunks = None
    world = collectives.world_size()
    if collectives.any_rank(chunks is None, world):
        return None
    assert replay is not None and chunks is not None
    failure: BaseException | None = None
    try:
        fs = dcp_io.SegmentFS(pool, step, save_id, protect)
        for name, file_chunks in chunks.items():
            with fs.create_stream(tmp / name, "wb") as stream:
                segment = cast(dcp_io.SegmentStream, stream)  # replays hold data files only: segments
                for chunk in file_chunks:
                    segment.write_chunk(chunk)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below, then it is raised here
        failure = exc
    # Also what DCP's gathering of write results did: no node commits before all of its ranks wrote.
    if collectives.any_rank(failure is not None, world):
        _replays.pop(key, None)
        if failure is not None:
            raise failure
        raise CheckpointError(f"elastic.save_sharded: another rank failed to write step {step}")
    return replay.metadata


def _recorded(
    state: dict[str, Any], root: Path, tmp: Path, pool: Any, step: int, save_id: str, protect: set[str]
) -> Any:
    """A full DCP save, recorded for the next saves to replay."""
    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint import dcp_io

    recorder = dcp_io.Recorder()
    writer = dcp_io.SegmentWriter(tmp, pool, step, save_id, protect, recorder)
    metadata = dcp.save(state, storage_writer=writer, planner=dcp_io.CachingPlanner(recorder))
    coordinator = collectives.rank() == 0  # DCP's coordinator: it alone writes the small objects
    replay = recorder.replay(metadata, dcp_io.local_plan(state, coordinator)[1], coordinator)
    key = _replay_key(root)
    if replay is None:
        _replays.pop(key, None)
    else:
        _replays[key] = replay
    return metadata


def _space_error(step: int, shm: Path, need: int, free: int) -> CheckpointError:
    replicas = sum(sl.tree_size(p) for p in (shm / sl.REPLICAS_SUBDIR).glob("*/*/.step_*"))
    own = sum(sl.tree_size(p) for p in (shm / sl.SHARDED_SUBDIR).glob(".step_*"))
    return CheckpointError(
        f"not enough shared memory for the sharded checkpoint of step {step}: it needs about "
        f"{need / (1 << 20):.1f} MiB more in {shm}, only {free / (1 << 20):.1f} MiB is available "
        f"(this node's double buffer takes {own / (1 << 20):.1f} MiB, replicas held for peers "
        f"{replicas / (1 << 20):.1f} MiB). Enlarge /dev/shm to at least 3 times this node's shards plus "
        "the replicas it holds (--replicas times a peer node's shards)"
    )
