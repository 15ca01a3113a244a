"""Restore of sharded checkpoints (:func:`elastic.sharded.load_sharded`): which step, which files move, and
the folder ``dcp.load`` reads on each node.

**Which step.** Each node lists the files it holds (its own memory, the replicas it keeps for peers, the
disk folder) as int64 triples ``(step, save id, file)`` (:func:`held`, :func:`encode`); the ranks exchange
the lists and pick the newest step whose files they hold together (:func:`choose`).

**Which files move.** A node assembles the files its ranks' DCP load plans read (not every file of the
step): at an unchanged world size with every node holding its own shards nothing moves; at another world
size (re-sharding) a node receives only the files whose chunks overlap its ranks' new shards. Each missing
file travels once per node that needs it, point to point (``dist.send``/``dist.recv``) from one rank that
holds it to the node's writer (the lowest rank of the node), straight into the file's pages. The planning
functions are pure (tested without a process group); :func:`run_transfers` performs a list that every rank
computed identically, in that order, which cannot deadlock: the first unfinished transfer's two ranks have
finished everything before it.

**The folder.** Where the node holds the chosen step whole, its own folder; else one it assembles
(:func:`assemble`) from the files it holds and the files it lacks, received from ranks that hold them.
Every file read from memory is checked against its recorded digest first (a replica's ``hashes.json``, a
node's own ``.xxh3`` files: :func:`elastic.checkpoint.shard_layout.check_file`); a damaged one is
reported and left out (:class:`DamagedShardsError`), and the restore chooses again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic import collectives, errors
from elastic.checkpoint import hostmem
from elastic.checkpoint import shard_layout as sl
from elastic.checkpoint.digest import CheckpointCorruptError
from elastic.checkpoint.env import CheckpointError
from elastic.report import report_corrupt


# -- which step -------------------------------------------------------------------------------------
def held(shm: Path | None, disk: Path | None) -> dict[tuple[int, str], dict[str, Path]]:
    """The files of sharded saves this node holds: ``(step, save id) -> {file name: path}``."""
    roots: list[tuple[Path, bool]] = []  # (root, parts: uncommitted data folders count too)
    if shm is not None:
        roots.append((shm / sl.SHARDED_SUBDIR, False))
        roots += [(p / sl.SHARDED_SUBDIR, False) for p in sorted((shm / sl.REPLICAS_SUBDIR).glob("*"))]
    if disk is not None:
        # A node's part persisted to a folder of its own (no shared file system) is never committed
        # there; its files are whole (each renamed in), and the union over the nodes may be complete.
        roots.append((disk / sl.SHARDED_SUBDIR, True))
    held: dict[tuple[int, str], dict[str, Path]] = {}
    for root, parts in roots:
        for step, save_id, data in sl.data_folders(root) if parts else sl.committed(root):
            files = held.setdefault((step, save_id), {})
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(data):
                    if sl.file_id(entry.name) is not None or entry.name in (sl.METADATA, sl.MANIFEST):
                        files.setdefault(entry.name, Path(entry.path))
    return held


def encode(held: dict[tuple[int, str], dict[str, Path]]) -> list[int]:
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


def choose(lists: list[list[int]], wanted: int | None) -> tuple[int, int] | None:
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


# -- which files move -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """One file sent from rank ``src`` to rank ``dst`` (a node's writer)."""

    file: int
    src: int
    dst: int


def node_key(shm: Path | None) -> int:
    """A number that ranks of one node share: its host and shared-memory folder (where it assembles).

    Without shared memory each process assembles in a private folder: the process is its own node.
    """
    where = str(shm.resolve()) if shm is not None else f"pid {os.getpid()}"
    digest = hashlib.blake2b(f"{socket.gethostname()}:{where}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)  # an int64 collective carries it


def writers(keys: list[int]) -> list[int]:
    """For each rank, its node's writer: the lowest rank with the same node key."""
    first: dict[int, int] = {}
    for rank, key in enumerate(keys):
        first.setdefault(key, rank)
    return [first[key] for key in keys]


def node_needs(reads: Sequence[Iterable[int]], writer_of: list[int]) -> dict[int, set[int]]:
    """The files each node's ranks read, by the node's writer rank."""
    needs: dict[int, set[int]] = {}
    for rank, files in enumerate(reads):
        needs.setdefault(writer_of[rank], set()).update(files)
    return needs


def plan_transfers(needs: Mapping[int, set[int]], holders: Mapping[int, list[int]]) -> list[Transfer]:
    """The sends that give every node the files it needs and lacks.

    Args:
        needs: writer rank -> files its node reads.
        holders: file -> the ranks holding it (all ranks of a node hold the same files).

    Each file goes from the holder with the fewest sends so far (ties: the lowest rank), to spread the
    load over the nodes that hold replicas of one file.

    Raises:
        ValueError: a needed file is held by no rank (the step chosen was not complete).
    """
    transfers: list[Transfer] = []
    sent: dict[int, int] = {}
    for writer in sorted(needs):
        for fid in sorted(needs[writer]):
            owners = holders.get(fid, [])
            if writer in owners:
                continue
            if not owners:
                raise ValueError(f"no rank holds file {fid} of the checkpoint")
            src = min(owners, key=lambda r: (sent.get(r, 0), r))
            sent[src] = sent.get(src, 0) + 1
            transfers.append(Transfer(fid, src, writer))
    return transfers


def files_read(state: dict[str, Any], folder: Path) -> set[str] | None:
    """Names of the data files that ``dcp.load(state, checkpoint_id=folder)`` reads on this rank.

    Computed with DCP's public planner and reader API the way ``dcp.load`` does it (Stateful values by
    their ``state_dict()``). ``None`` when it cannot be told (the caller then assembles every file and
    ``dcp.load`` reports the real error, on every rank, after the collectives all ranks go through).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.stateful import Stateful

    try:
        metadata = FileSystemReader(folder).read_metadata()
        plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in sorted(state.items())}
        planner = DefaultLoadPlanner()
        planner.set_up_planner(plain, metadata, is_coordinator=False)
        plan = planner.create_local_plan()
        storage = metadata.storage_data or {}
        return {storage[item.storage_index].relative_path for item in plan.items}
    except Exception:  # noqa: BLE001 - any failure here is dcp.load's to report, after the collectives
        return None


def _device() -> torch.device:
    return collectives.collective_device(str(dist.get_backend()))


def send_file(path: Path, dst: int) -> None:
    """Send ``path``'s bytes to rank ``dst`` (its size first); the pages are mapped, not copied."""
    device = _device()
    size = path.stat().st_size
    dist.send(torch.tensor([size], dtype=torch.int64, device=device), dst)
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: a send only reads it
            payload = torch.frombuffer(mapped, dtype=torch.uint8)
        dist.send(payload.to(device), dst)
        del payload  # the map closes only when no tensor exports it


def recv_file(path: Path, src: int) -> None:
    """Receive a file sent by :func:`send_file` on rank ``src`` into ``path`` (straight into its pages)."""
    device = _device()
    size_t = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size_t, src)
    size = int(size_t.item())
    with open(path, "w+b") as f:
        if size == 0:
            return
        f.truncate(size)
        with mmap.mmap(f.fileno(), size) as mapped:
            _recv_into(mapped, size, src, device)


def recv_memory(src: int) -> mmap.mmap | None:
    """Receive a file sent by :func:`send_file` on rank ``src`` into private memory of this process (an
    anonymous map, faulted in huge pages where the kernel allows: :mod:`elastic.checkpoint.hostmem`);
    None for an empty file. For a file only this process reads: no shared-memory file's pages to fault
    in one by one (tmpfs has no huge pages here), and the memory goes with the map."""
    device = _device()
    size_t = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size_t, src)
    size = int(size_t.item())
    if size == 0:
        return None
    mapped = hostmem.anonymous(size)
    _recv_into(mapped, size, src, device)
    return mapped


def _recv_into(mapped: mmap.mmap, size: int, src: int, device: torch.device) -> None:
    """Receive ``size`` bytes from rank ``src`` straight into ``mapped`` (through the device when the
    group's backend sends device tensors); no view of the map outlives the call, so it can be closed."""
    target = torch.frombuffer(mapped, dtype=torch.uint8)
    if device.type == "cpu":
        dist.recv(target, src)
    else:
        staged = torch.empty(size, dtype=torch.uint8, device=device)
        dist.recv(staged, src)
        target.copy_(staged)
    del target


def run_transfers(
    transfers: list[Transfer],
    rank: int,
    names: Mapping[int, str],
    source: Mapping[str, Path],
    target: Path,
    private: Iterable[int] = (),
) -> tuple[int, dict[str, mmap.mmap]]:
    """Perform this rank's part of ``transfers`` in order; returns the bytes received, and the files
    received into this process's memory (:func:`recv_memory`) by name.

    Args:
        names: file id -> file name.
        source: file name -> this rank's copy (for the files it sends).
        target: the folder received files are written to (this rank's node's assembly folder).
        private: files only this rank reads: received into its memory, not into ``target``.
    """
    received = 0
    in_memory: dict[str, mmap.mmap] = {}
    private = set(private)
    for t in transfers:
        if t.src == rank:
            send_file(source[names[t.file]], t.dst)
        elif t.dst == rank and t.file in private:
            mapped = recv_memory(t.src)
            if mapped is None:
                (target / names[t.file]).touch()
            else:
                in_memory[names[t.file]] = mapped
                received += len(mapped)
        elif t.dst == rank:
            path = target / names[t.file]
            recv_file(path, t.src)
            received += path.stat().st_size
    return received, in_memory


# -- the folder dcp.load reads ----------------------------------------------------------------------
log = logging.getLogger(__name__)


class DamagedShardsError(CheckpointCorruptError):
    """Files of the chosen sharded step failed their digest check (on this rank: :attr:`bad`, path -> why;
    empty when they were on another rank). Every rank raises it together; the restore leaves the damaged
    files out and chooses again (another holder's copy, or an older step)."""

    def __init__(self, step: int, bad: dict[Path, str]) -> None:
        self.step, self.bad = step, bad
        why = "; ".join(bad.values()) or "on another node"
        errors.CheckpointError.__init__(
            self, f"a file of the sharded checkpoint of step {step} is damaged: {why}"
        )
        self.what, self.recorded, self.computed = why, "", ""


_RESTORE_SUBDIR = "restore"


@dataclass
class Assembled:
    """What :func:`assemble` made of a step on this rank."""

    folder: Path  # the folder dcp.load reads (its metadata, and the files in it)
    writes: bool  # this rank assembled the folder (and removes it after the load)
    received: int  # bytes this rank received from other nodes
    #: Files received into this process's memory (only this rank reads them), by name: the reader
    #: (:func:`reader`) copies from them; :meth:`close` frees them.
    in_memory: dict[str, mmap.mmap]

    def close(self) -> None:
        """Free the files received into memory (unmapped now, or once no tensor views them)."""
        for mapped in self.in_memory.values():
            with contextlib.suppress(BufferError):
                mapped.close()
        self.in_memory = {}


def assemble(
    state: dict[str, Any],
    step: int,
    save_id: str,
    mine: dict[str, Path],
    manifest: dict[str, int] | None,
    shm: Path | None,
    world: int,
) -> Assembled:
    """The folder ``dcp.load`` reads on this node, whether this rank assembled it (and removes it), the
    bytes this rank received from other nodes, and the files it received into its own memory.

    A node that holds the whole step in one folder reads it there. Any other node assembles, in a folder
    of its own, links to the files it holds and the files it lacks, received from a rank that holds
    each, but only the files its ranks' load plans read (:func:`files_read`). Every rank
    calls it (collectives); files are checked against their recorded digest where read or sent
    (:class:`DamagedShardsError` on every rank when one fails).
    """
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
    keys = [flat[0] for flat in collectives.gather_ints([node_key(shm)], world)]
    rank = collectives.rank()
    writer_of = writers(keys)
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
    reads = files_read(state, target)
    read_ids = sorted(names) if reads is None else sorted(f for f, n in names.items() if n in reads)
    reads_by_rank = [[f for f in got if f >= 0] for got in collectives.gather_ints(read_ids, world)]
    needs = node_needs(reads_by_rank, writer_of)
    # Files that only this rank (a node's writer) reads go into its memory, not the node's folder.
    others = {f for r, files in enumerate(reads_by_rank) if r != rank and writer_of[r] == rank for f in files}
    private = set(read_ids) - others if writes else set()
    transfers = plan_transfers(needs, holders)
    # The node's writer checks the replicas its node reads, a sender those it sends.
    node_reads = needs.get(rank, ()) if writer_of[rank] == rank else ()
    checked = {names[f] for f in node_reads if names[f] in mine}
    checked |= {names[t.file] for t in transfers if t.src == rank}
    bad = {mine[n]: why for n in sorted(checked) if (why := sl.check_file(mine[n]))}
    if collectives.any_rank(bool(bad), world):
        if writes:
            shutil.rmtree(target, ignore_errors=True)
        for path, why in bad.items():
            log.error("a file of the sharded checkpoint of step %d failed its digest check: %s", step, why)
            report_corrupt(step, str(path))
        raise DamagedShardsError(step, bad)
    if writes:
        for fid in sorted(needs.get(rank, ())):
            if names[fid] in mine:
                _link_or_copy(mine[names[fid]], target / names[fid])
    received, in_memory = run_transfers(transfers, rank, names, mine, target, private)
    if received:
        log.info("received %.1f MiB of step %d's shards from other nodes", received / (1 << 20), step)
    collectives.barrier()  # every node's writer has its files before anyone reads
    return Assembled(target, writes, received, in_memory)


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


def reader(path: Path, shm: Path | None, in_memory: Mapping[str, mmap.mmap] | None = None) -> Any:
    """DCP's reader of ``path``: files in shared memory, or received into this process's memory
    (``in_memory``, by name), are copied from their mapping (one copy, no read into a temporary tensor;
    :class:`elastic.checkpoint.dcp_io.MappedReader`), files on disk read as DCP reads them."""
    from torch.distributed.checkpoint import FileSystemReader

    from elastic.checkpoint.dcp_io import MappedReader

    if in_memory or (shm is not None and path.resolve().is_relative_to(shm.resolve())):
        return MappedReader(path, in_memory)
    return FileSystemReader(path)
