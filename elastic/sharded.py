"""Sharded checkpoints (FSDP, DTensor, tensor parallel) through ``torch.distributed.checkpoint`` (DCP).

DCP writes each rank's shards plus one metadata file describing the global tensors, and re-shards on
load: a checkpoint written at one world size loads at another, into state whose tensors are sharded
for the new world. The files follow :mod:`elastic.shard_layout` (a ``step_<N>`` symlink to the save's
data folder, replaced atomically).

**Under elastic-run** (``ELASTIC_SHM_DIR`` set) a save is a *flash* save: every rank writes its own shards
into its node's shared-memory folder (``<shm>/sharded``), through DCP's writer with its data files in
reused, pre-faulted segments (:mod:`elastic.shard_segments`), and returns; there is no disk I/O in the
worker. Local rank 0 of each node then commits the node's folder and reports it to the agent, which
streams it to a peer node's agent (replication) and persists it to ``--ckpt-dir`` in the background.
Before it writes, a save waits while the node's replication lags more than the agent's bound
(``<shm>/replication.json``), so that a lost node costs at most that many steps.

:func:`load_sharded` restores the newest step whose files the job holds *somewhere*: each node lists
what it holds (its own memory, the replicas it keeps for peers, checked against their sha256, and the
disk folder); the ranks exchange the lists (int64 collectives) and pick the newest complete step. Each rank
plans its DCP reads; a node receives only the files its ranks read and it lacks, point to point from a
rank that holds each (:mod:`elastic.shard_restore`): at an unchanged world size with every node holding its
own shards nothing moves. Then ``dcp.load`` reads the node's assembled folder, re-sharding to the current
world.

**Without an agent** every rank writes its shards to ``<ckpt_dir>/sharded`` (a folder all ranks share)
and global rank 0 commits it once all have written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic import collectives
from elastic import shard_layout as sl
from elastic.checkpoint import (
    CKPT_DIR_ENV,
    CKPT_RESET_ENV,
    SHM_DIR_ENV,
    CheckpointError,
    _check_args,
    _node_local_rank,
    _resolve_dir,
)
from elastic.report import report, report_checkpoint

log = logging.getLogger(__name__)

SHARDED_SUBDIR = sl.SHARDED_SUBDIR
#: Sharded saves kept in a node's shared memory: the newest and the one before it (the double buffer).
MEMORY_KEEP = 2
#: The agent's replication state, read by a save that waits for the lag bound.
REPLICATION_STATUS = "replication.json"
#: Longest wait of a save for the replication lag (a peer gone: the master starts a new round meanwhile).
REPLICATION_WAIT_S = 300.0
_RESTORE_SUBDIR = "restore"
_MISSING = -1
_saved: list[int] = []  # steps this process saved into shared memory, oldest first (a few)
_previous: tuple[Path, int, str] | None = None  # (root, step, save id) of this process's last save
_received = 0  # bytes this process received from other nodes in its last load_sharded


def last_restore_received_bytes() -> int:
    """Bytes of shard files this process received from other nodes in its last :func:`load_sharded`
    (0 when its node held every file its ranks read)."""
    return _received


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def complete_steps(ckpt_dir: str | os.PathLike[str] | None = None) -> list[int]:
    """Steps of the complete sharded checkpoints in ``ckpt_dir``, newest first."""
    root = _resolve_dir(ckpt_dir) / SHARDED_SUBDIR
    return [step for step, _, data in sl.committed(root) if sl.complete_on_disk(data)]


# -- save -------------------------------------------------------------------------------------------
def save_sharded(
    state: dict[str, Any], step: int, ckpt_dir: str | os.PathLike[str] | None = None, *, keep: int = 3
) -> Path:
    """Save sharded ``state`` (a DCP state dict) as the checkpoint of ``step``; call it on every rank.

    Under elastic-run this is a flash save into the node's shared memory (see the module doc); the agent
    replicates it to a peer node and persists it to ``ckpt_dir`` (default ``ELASTIC_CKPT_DIR``) in DCP's
    file-system format. Without an agent it goes to ``ckpt_dir`` directly.

    Args:
        state: e.g. ``{"model": get_model_state_dict(model), "step": step}`` with DTensor/sharded
            tensors; plain tensors are saved once (they are assumed replicated).
        step: training steps completed.
        ckpt_dir: a folder all ranks share (disk saves); default ``ELASTIC_CKPT_DIR``.
        keep: sharded checkpoints to keep on disk, this one included (>= 1).

    Returns:
        The folder of the checkpoint (this node's, under elastic-run).

    Raises:
        CheckpointError: shared memory is too small (the message names the size needed).
    """
    _check_args(state, step)
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    shm = os.environ.get(SHM_DIR_ENV)
    if shm:
        return _flash_save(state, step, Path(shm), ckpt_dir)
    return _disk_save(state, step, _resolve_dir(ckpt_dir) / SHARDED_SUBDIR, keep)


def _shared_save_id() -> str:
    return sl.save_id_str(collectives.broadcast_int(sl.save_id_int(sl.new_save_id()), src=0) or 0)


def _disk_save(state: dict[str, Any], step: int, root: Path, keep: int) -> Path:
    import torch.distributed.checkpoint as dcp  # heavy (about 1.5 s); only for sharded checkpoints

    save_id = _shared_save_id()
    tmp = root / sl.tmp_dir_name(step, save_id)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    metadata = dcp.save(state, checkpoint_id=tmp)  # every rank writes its shards; rank 0 the metadata
    if _rank() == 0:
        sl.write_json(tmp / sl.MANIFEST, _manifest(metadata, step, save_id))
        data = sl.commit(root, tmp, step, save_id, durable=True)
        sl.write_latest(root, step)
        sl.prune(root, keep)
        sl.remove_temp_dirs(root, older_than=step)
    else:
        data = root / sl.data_dir_name(step, save_id)
    _barrier()  # nobody goes on (and possibly loads) before the commit
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


def _flash_save(state: dict[str, Any], step: int, shm: Path, ckpt_dir: str | os.PathLike[str] | None) -> Path:
    import torch.distributed.checkpoint as dcp

    from elastic import segments, shard_segments

    global _previous
    if not shm.is_dir():
        raise CheckpointError(
            f"the agent's shared-memory folder {shm} ({SHM_DIR_ENV}) does not exist; "
            "is the elastic-run agent of this worker still running?"
        )
    root = shm / SHARDED_SUBDIR
    root.mkdir(exist_ok=True)
    protect: set[str] = set()
    if _previous is not None and _previous[0] == root:
        _wait_committed(root, _previous[1], _previous[2])
        protect.add(sl.data_dir_name(_previous[1], _previous[2]))
    _replication_wait(shm, step)
    save_id = _shared_save_id()
    tmp = root / sl.tmp_dir_name(step, save_id)
    tmp.mkdir(exist_ok=True)
    pool = shard_segments.pool_for(root)
    pool.fresh_bytes, pool.prefault_s = 0, 0.0
    writer = shard_segments.SegmentWriter(tmp, pool, step, save_id, protect)
    first = _previous is None or _previous[0] != root
    try:
        with shard_segments.crc_off():
            metadata = dcp.save(state, storage_writer=writer, planner=shard_segments.CachingPlanner())
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
    if _node_local_rank() != 0:
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


def _space_error(step: int, shm: Path, need: int, free: int) -> CheckpointError:
    replicas = sum(sl.tree_size(p) for p in (shm / sl.REPLICAS_SUBDIR).glob("*/*/.step_*"))
    own = sum(sl.tree_size(p) for p in (shm / SHARDED_SUBDIR).glob(".step_*"))
    return CheckpointError(
        f"not enough shared memory for the sharded checkpoint of step {step}: it needs about "
        f"{need / (1 << 20):.1f} MiB more in {shm}, only {free / (1 << 20):.1f} MiB is available "
        f"(this node's double buffer takes {own / (1 << 20):.1f} MiB, replicas held for peers "
        f"{replicas / (1 << 20):.1f} MiB). Enlarge /dev/shm to at least 3 times this node's shards plus "
        "the replicas it holds (--replicas times a peer node's shards)"
    )


# -- load -------------------------------------------------------------------------------------------
def _held(shm: Path | None, disk: Path | None) -> dict[tuple[int, str], dict[str, Path]]:
    """The files of sharded saves this node holds: ``(step, save id) -> {file name: path}``."""
    roots: list[tuple[Path, bool]] = []  # (root, parts: uncommitted data folders count too)
    if shm is not None:
        roots.append((shm / SHARDED_SUBDIR, False))
        roots += [(p / SHARDED_SUBDIR, False) for p in sorted((shm / sl.REPLICAS_SUBDIR).glob("*"))]
    if disk is not None:
        # A node's part persisted to a folder of its own (no shared file system) is never committed
        # there; its files are whole (each renamed in), and the union over the nodes may be complete.
        roots.append((disk / SHARDED_SUBDIR, True))
    held: dict[tuple[int, str], dict[str, Path]] = {}
    for root, parts in roots:
        for step, save_id, data in sl.data_folders(root) if parts else sl.committed(root):
            files = held.setdefault((step, save_id), {})
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(data):
                    if sl.file_id(entry.name) is not None or entry.name in (sl.METADATA, sl.MANIFEST):
                        files.setdefault(entry.name, Path(entry.path))
    return held


def _encode(held: dict[tuple[int, str], dict[str, Path]]) -> list[int]:
    """Triples (step, save id, file): a data file's id, or ``-1 - n`` for metadata + manifest of n files."""
    flat: list[int] = []
    for (step, save_id), files in held.items():
        sid = sl.save_id_int(save_id)
        manifest = sl.read_manifest(files[sl.MANIFEST].parent) if sl.MANIFEST in files else None
        if manifest is not None and sl.METADATA in files:
            flat += [step, sid, -1 - len(manifest)]
        for name in files:
            fid = sl.file_id(name)
            if fid is not None:
                flat += [step, sid, fid]
    return flat


def _gather(flat: list[int], world: int) -> list[list[int]]:
    if world <= 1:
        return [flat]
    device = collectives._device()
    length = torch.tensor([len(flat)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    longest = int(length.item())
    padded = torch.full((max(longest, 3),), _MISSING, dtype=torch.int64, device=device)
    if flat:
        padded[: len(flat)] = torch.tensor(flat, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g.tolist()[:longest] for g in gathered]


def _choose(lists: list[list[int]], wanted: int | None) -> tuple[int, int] | None:
    """The newest (step, save id int) whose files the ranks hold together (``wanted``: that step)."""
    expected: dict[tuple[int, int], int] = {}
    files: dict[tuple[int, int], set[int]] = {}
    for flat in lists:
        for i in range(0, len(flat) - 2, 3):
            step, sid, fid = flat[i : i + 3]
            if step < 0:
                continue
            if fid < 0:
                expected[(step, sid)] = -1 - fid
            else:
                files.setdefault((step, sid), set()).add(fid)
    complete = [key for key, n in expected.items() if len(files.get(key, ())) == n]
    if wanted is not None:
        complete = [key for key in complete if key[0] == wanted]
    return max(complete) if complete else None


def _verify_replica(path: Path) -> str:
    """'' when ``path`` (a replica's file) matches the sha256 its sender sent, else why not."""
    hashes_file = path.parent / sl.HASHES
    if not hashes_file.exists():
        return ""  # not a replica (own memory or disk)
    try:
        expected = json.loads(hashes_file.read_text())[path.name]
    except (OSError, ValueError, KeyError):
        return f"{path}: no recorded hash"
    actual = sl.sha256_file(path)
    if actual == expected:
        return ""
    return f"{path}: sha256 {actual[:12]}... differs from the sent {expected[:12]}..."


def load_sharded(
    state: dict[str, Any], step: int | None = None, ckpt_dir: str | os.PathLike[str] | None = None
) -> int | None:
    """Load a sharded checkpoint into ``state`` in place (resharded to this world); call it on every rank.

    The ranks agree on the newest step whose files the job holds anywhere (memory, replicas kept for
    peers, disk); files a node lacks travel to it over the process group (see the module doc).

    Returns:
        The step loaded, or ``None`` when no rank holds a sharded checkpoint (``state`` is untouched).

    Raises:
        CheckpointError: ``step`` was given and there is no complete checkpoint of it, or a replica's
            content does not match its hash.
    """
    import torch.distributed.checkpoint as dcp

    global _received
    _received = 0
    shm_text = os.environ.get(SHM_DIR_ENV)
    shm = Path(shm_text) if shm_text and Path(shm_text).is_dir() else None
    folder = ckpt_dir or os.environ.get(CKPT_DIR_ENV) or None
    disk = Path(folder) if folder else None
    held = _held(shm, disk)
    if os.environ.get(CKPT_RESET_ENV, "") in ("1", "true", "yes"):
        held = {}
    world = collectives.world_size()
    lists = _gather(_encode(held), world)
    choice = _choose(lists, step)
    if choice is None:
        if step is not None:
            where = disk if shm is None else f"memory or {disk}"
            raise CheckpointError(f"no complete sharded checkpoint of step {step} in {where}")
        partial = sorted({flat[i] for flat in lists for i in range(0, len(flat) - 2, 3) if flat[i] >= 0})
        if partial:
            # A lost node's shards with no replica anywhere: a fresh start would lose the job's progress.
            raise CheckpointError(
                f"the job holds parts of sharded checkpoints (steps {partial[-3:]}) but no step in full "
                "(a lost node's shards had no replica, or --replicas 0); starting fresh would lose the "
                "job's progress: to do so on purpose, run elastic-run with --ckpt-reset "
                f"({CKPT_RESET_ENV}=1) or a new job id, or give --ckpt-dir the folder of the persisted ones"
            )
        return None
    chosen, sid_int = choice
    save_id = sl.save_id_str(sid_int)
    mine = held.get((chosen, save_id), {})
    manifest = next((m for p in mine.values() if (m := sl.read_manifest(p.parent)) is not None), None)
    path, assembled = _assemble(state, chosen, save_id, mine, manifest, shm, world)
    try:
        dcp.load(state, storage_reader=_reader(path, shm))
    finally:
        _barrier()
        if assembled:
            shutil.rmtree(path.parent if path.parent.name.startswith("elastic-restore-") else path, True)
    if shm is not None and _node_local_rank() == 0:
        sl.prune(shm / SHARDED_SUBDIR, MEMORY_KEEP, newest=chosen)  # newer saves were a rolled-back run
    log.info("restored the sharded checkpoint of step %d", chosen)
    report(chosen)
    report_checkpoint(chosen)
    return chosen


def _reader(path: Path, shm: Path | None) -> Any:
    """DCP's reader of ``path``: files in shared memory are copied from their mapping (one copy, no read
    into a temporary tensor; :mod:`elastic.shard_reader`), files on disk read as DCP reads them."""
    from torch.distributed.checkpoint import FileSystemReader

    from elastic.shard_reader import MappedReader

    in_memory = shm is not None and path.resolve().is_relative_to(shm.resolve())
    return MappedReader(path) if in_memory else FileSystemReader(path)


def _any(flag: bool, world: int) -> bool:
    """True on every rank when ``flag`` is true on any."""
    if world <= 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=collectives._device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _assemble(
    state: dict[str, Any],
    step: int,
    save_id: str,
    mine: dict[str, Path],
    manifest: dict[str, int] | None,
    shm: Path | None,
    world: int,
) -> tuple[Path, bool]:
    """The folder ``dcp.load`` reads on this node, and whether this rank assembled it (and removes it).

    A node that holds the whole step in one folder reads it there. Any other node assembles, in a folder
    of its own, links to the files it holds and the files it lacks, received from a rank that holds
    each, but only the files its ranks' load plans read (:mod:`elastic.shard_restore`). Every rank
    calls it (collectives); replicas are checked against their sha256 where read or sent.
    """
    from elastic import shard_restore as sr

    lists = _gather(_encode({(step, save_id): mine}), world)
    holders: dict[int, list[int]] = {}
    metadata_holders = []
    for rank, flat in enumerate(lists):
        for i in range(0, len(flat) - 2, 3):
            if flat[i] < 0:
                continue
            if flat[i + 2] < 0:
                metadata_holders.append(rank)
            else:
                holders.setdefault(flat[i + 2], []).append(rank)
    # Every rank learns the file names from a holder of the manifest.
    manifest_bytes = collectives.broadcast_bytes(
        json.dumps(manifest).encode() if manifest is not None else None, src=metadata_holders[0]
    )
    if manifest_bytes is None:
        raise CheckpointError(f"the manifest of the sharded checkpoint of step {step} is missing")
    names = {fid: n for n in json.loads(manifest_bytes) if (fid := sl.file_id(n)) is not None}
    everything = [sl.METADATA, *names.values()]
    folders = {mine[n].parent for n in everything if n in mine}
    whole = len(folders) == 1 and all(n in mine for n in everything)  # one folder holds it all
    keys = [flat[0] for flat in _gather([sr.node_key(shm)], world)]
    rank = _rank()
    writer_of = sr.writers(keys)
    writes = not whole and writer_of[rank] == rank
    target = next(iter(folders)) if whole else _restore_dir(shm, step, save_id)
    if writes:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        if sl.METADATA in mine:
            _link_or_copy(mine[sl.METADATA], target / sl.METADATA)
    if len(set(metadata_holders)) < max(world, 1):  # small: to every rank, the ones that lack it write it
        owner = min(metadata_holders)
        data = collectives.broadcast_bytes(mine[sl.METADATA].read_bytes() if rank == owner else None, owner)
        if writes and sl.METADATA not in mine and data is not None:
            (target / sl.METADATA).write_bytes(data)
    _barrier()  # the metadata is in place: each rank plans its reads from it
    reads = sr.files_read(state, target)
    read_ids = sorted(names) if reads is None else sorted(f for f, n in names.items() if n in reads)
    needs = sr.node_needs([[f for f in got if f >= 0] for got in _gather(read_ids, world)], writer_of)
    transfers = sr.plan_transfers(needs, holders)
    # The node's writer checks the replicas its node reads, a sender those it sends.
    node_reads = needs.get(rank, ()) if writer_of[rank] == rank else ()
    checked = {names[f] for f in node_reads if names[f] in mine}
    checked |= {names[t.file] for t in transfers if t.src == rank}
    bad = [why for n in sorted(checked) if (why := _verify_replica(mine[n]))]
    if _any(bool(bad), world):
        if writes:
            shutil.rmtree(target, ignore_errors=True)
        why = "; ".join(bad or ["on another node"])
        raise CheckpointError(f"a replica of the sharded checkpoint of step {step} is damaged: {why}")
    if writes:
        for fid in sorted(needs.get(rank, ())):
            if names[fid] in mine:
                _link_or_copy(mine[names[fid]], target / names[fid])
    global _received
    received = _received = sr.run_transfers(transfers, rank, names, mine, target)
    if received:
        log.info("received %.1f MiB of step %d's shards from other nodes", received / (1 << 20), step)
    _barrier()  # every node's writer has its files before anyone reads
    return target, writes


def _restore_dir(shm: Path | None, step: int, save_id: str) -> Path:
    """Where a node assembles a step it holds only in parts (shared memory: one per node)."""
    if shm is not None:
        return shm / _RESTORE_SUBDIR / sl.data_dir_name(step, save_id)
    private = Path(os.environ.get("TMPDIR", "/tmp")) / f"elastic-restore-{os.getpid()}"
    return private / sl.data_dir_name(step, save_id)


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
