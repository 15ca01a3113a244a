"""The folder ``dcp.load`` reads on a node, for :func:`elastic.sharded.load_sharded`: where the node holds
the chosen step whole, its own folder; else one it assembles from the files it holds and the files it
lacks, received from ranks that hold them (only those its ranks' load plans read:
:mod:`elastic.checkpoint.shard_restore`). Replicas are checked against the sha256 their sender sent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from elastic import collectives
from elastic.checkpoint import shard_layout as sl
from elastic.checkpoint.env import CheckpointError
from elastic.checkpoint.shard_holdings import encode

log = logging.getLogger(__name__)

_RESTORE_SUBDIR = "restore"


def assemble(
    state: dict[str, Any],
    step: int,
    save_id: str,
    mine: dict[str, Path],
    manifest: dict[str, int] | None,
    shm: Path | None,
    world: int,
) -> tuple[Path, bool, int]:
    """The folder ``dcp.load`` reads on this node, whether this rank assembled it (and removes it), and
    the bytes this rank received from other nodes.

    A node that holds the whole step in one folder reads it there. Any other node assembles, in a folder
    of its own, links to the files it holds and the files it lacks, received from a rank that holds
    each, but only the files its ranks' load plans read (:mod:`elastic.checkpoint.shard_restore`). Every rank
    calls it (collectives); replicas are checked against their sha256 where read or sent.
    """
    from elastic.checkpoint import shard_restore as sr

    lists = collectives.gather_ints(encode({(step, save_id): mine}), world)
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
    keys = [flat[0] for flat in collectives.gather_ints([sr.node_key(shm)], world)]
    rank = collectives.rank()
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
    collectives.barrier()  # the metadata is in place: each rank plans its reads from it
    reads = sr.files_read(state, target)
    read_ids = sorted(names) if reads is None else sorted(f for f, n in names.items() if n in reads)
    needs = sr.node_needs(
        [[f for f in got if f >= 0] for got in collectives.gather_ints(read_ids, world)], writer_of
    )
    transfers = sr.plan_transfers(needs, holders)
    # The node's writer checks the replicas its node reads, a sender those it sends.
    node_reads = needs.get(rank, ()) if writer_of[rank] == rank else ()
    checked = {names[f] for f in node_reads if names[f] in mine}
    checked |= {names[t.file] for t in transfers if t.src == rank}
    bad = [why for n in sorted(checked) if (why := _verify_replica(mine[n]))]
    if collectives.any_rank(bool(bad), world):
        if writes:
            shutil.rmtree(target, ignore_errors=True)
        why = "; ".join(bad or ["on another node"])
        raise CheckpointError(f"a replica of the sharded checkpoint of step {step} is damaged: {why}")
    if writes:
        for fid in sorted(needs.get(rank, ())):
            if names[fid] in mine:
                _link_or_copy(mine[names[fid]], target / names[fid])
    received = sr.run_transfers(transfers, rank, names, mine, target)
    if received:
        log.info("received %.1f MiB of step %d's shards from other nodes", received / (1 << 20), step)
    collectives.barrier()  # every node's writer has its files before anyone reads
    return target, writes, received


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


def reader(path: Path, shm: Path | None) -> Any:
    """DCP's reader of ``path``: files in shared memory are copied from their mapping (one copy, no read
    into a temporary tensor; :mod:`elastic.checkpoint.shard_reader`), files on disk read as DCP reads them."""
    from torch.distributed.checkpoint import FileSystemReader

    from elastic.checkpoint.shard_reader import MappedReader

    in_memory = shm is not None and path.resolve().is_relative_to(shm.resolve())
    return MappedReader(path) if in_memory else FileSystemReader(path)
