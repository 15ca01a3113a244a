"""Restore of sharded checkpoints (:func:`elastic.sharded.load_sharded`): which step, which files move, and
the folder ``dcp.load`` reads on each node.

**Which step.** Each node lists the files it holds (its own memory, the replicas it keeps for peers, the
disk folder) as int64 triples ``(step, save id, file)`` (:func:`held`, :func:`encode`); the ranks exchange
the lists and pick the newest step whose files they hold together (:func:`choose`).

**Which files move.** A node assembles the files its ranks' DCP load plans read (not every file of the
step): at an unchanged world size with every node holding its own shards nothing moves; at another world
size (re-sharding) a node receives only the files whose chunks overlap its ranks' new shards. Each missing
file travels once per node that needs it, point to point (``dist.send``/``dist.recv``) from one rank that
holds it to the node's writer (the lowest rank of the node). A file that other ranks of the node read too
is received into the node's folder (:func:`run_transfers`, straight into the file's pages); a file that
only its receiver reads is received while DCP loads (:class:`Deferred`), when the receiver knows which of
the state's tensors each record loads: the sender sends the file's record layout first, and each large
tensor record's bytes land straight in the tensor (no intermediate buffer, no copy after the receive;
:func:`recv_records`). The planning functions are pure (tested without a process group); every rank
performs a list of transfers that it computed identically, in that order, which cannot deadlock: the
first unfinished transfer's two ranks have finished everything before it.

**The folder.** Where the node holds the chosen step whole, its own folder; else one it assembles
(:func:`assemble`) from the files it holds and the files it lacks, received from ranks that hold them.
Every file read from memory is checked against its recorded digest first (a replica's ``hashes.json``, a
node's own ``.xxh3`` files: :func:`elastic.checkpoint.shard_layout.check_file`); a damaged one is
reported and left out (:class:`DamagedShardsError`), and the restore chooses again.
"""

from __future__ import annotations

import concurrent.futures
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from elastic import collectives, errors
from elastic.checkpoint import dcp_io, digest, hostmem
from elastic.checkpoint import shard_layout as sl
from elastic.checkpoint.dcp_io import RecordBytes
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


def private_files(reads: Sequence[Iterable[int]], writer_of: list[int]) -> dict[int, set[int]]:
    """For each node's writer rank, the files that it alone reads of its node's ranks: received into its
    own memory (:class:`Deferred`), not into the node's folder."""
    private: dict[int, set[int]] = {}
    for writer in sorted(set(writer_of)):
        others = {f for r, files in enumerate(reads) if r != writer and writer_of[r] == writer for f in files}
        private[writer] = set(reads[writer]) - others
    return private


def run_transfers(
    transfers: list[Transfer], rank: int, names: Mapping[int, str], source: Mapping[str, Path], target: Path
) -> int:
    """Perform this rank's part of ``transfers`` in order, into files; returns the bytes received.

    Args:
        names: file id -> file name.
        source: file name -> this rank's copy (for the files it sends).
        target: the folder received files are written to (this rank's node's assembly folder).
    """
    received = 0
    for t in transfers:
        if t.src == rank:
            send_file(source[names[t.file]], t.dst)
        elif t.dst == rank:
            path = target / names[t.file]
            recv_file(path, t.src)
            received += path.stat().st_size
    return received


# -- files received straight into the state ---------------------------------------------------------
#: Tensor data of at least this many bytes travels in a message of its own, received straight into the
#: state's tensor; smaller records travel with the bytes around them (a message costs tens of
#: microseconds on gloo: a record of 64 KiB copies in about as long).
DIRECT_MIN_BYTES = 64 << 10


def chunks(
    size: int, layout: Sequence[RecordBytes], min_direct: int = DIRECT_MIN_BYTES
) -> list[tuple[int, int, int]]:
    """How a data file of ``size`` bytes travels: ``(start, end, i)`` messages in file order, where ``i``
    is the index in ``layout`` of the tensor record whose data the message is (plain records of at least
    ``min_direct`` bytes), ``-1`` for the bytes between them. Both sides compute it from the layout the
    sender sends, so they agree on every message's length."""
    out: list[tuple[int, int, int]] = []
    pos = 0
    for i, rec in sorted(enumerate(layout), key=lambda e: e[1].start):
        if not rec.plain or rec.nbytes < min_direct or rec.start < pos:
            continue
        if rec.start > pos:
            out.append((pos, rec.start, -1))
        out.append((rec.start, rec.start + rec.nbytes, i))
        pos = rec.start + rec.nbytes
    if size > pos:
        out.append((pos, size, -1))
    return out


def _records_of(metadata: Metadata, name: str) -> list[tuple[int, int]]:
    return sorted({(i.offset, i.length) for i in metadata.storage_data.values() if i.relative_path == name})


def send_records(path: Path, dst: int, metadata: Metadata, checked: mmap.mmap | None = None) -> None:
    """Send a data file to rank ``dst``: its size, the layout of its tensor records
    (:func:`elastic.checkpoint.dcp_io.record_layout`) and its recorded digest first, then its bytes in
    :func:`chunks`; from ``checked`` (the file mapped by a digest check) where given."""
    device = _device()
    if checked is not None:
        _send_mapped(checked, path, dst, metadata, device)
        return
    size = path.stat().st_size
    if size == 0:
        dist.send(torch.tensor([0, 0, 0], dtype=torch.int64, device=device), dst)
        return
    # The page tables filled in one call: faulting 4 KiB pages in one by one inside the kernel's copy
    # into the socket costs more.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) as mapped:
        _send_mapped(mapped, path, dst, metadata, device)


def _send_mapped(mapped: mmap.mmap, path: Path, dst: int, metadata: Metadata, device: torch.device) -> None:
    size = len(mapped)
    layout = dcp_io.record_layout(mapped, _records_of(metadata, path.name))
    recorded = (sl.recorded_text(path) or "").encode()  # the receiver checks the bytes against it
    dist.send(torch.tensor([size, len(layout), len(recorded)], dtype=torch.int64, device=device), dst)
    if layout:
        flat = [v for r in layout for v in (r.record, r.start, r.nbytes, int(r.plain))]
        dist.send(torch.tensor(flat, dtype=torch.int64, device=device), dst)
    if recorded:
        dist.send(torch.tensor(list(recorded), dtype=torch.uint8, device=device), dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: a send only reads it
        payload = torch.frombuffer(mapped, dtype=torch.uint8)
    for start, end, _ in chunks(size, layout):
        dist.send(payload[start:end].to(device), dst)
    del payload  # the map closes only when no tensor exports it


def _direct_target(
    item: ReadItem, rec: RecordBytes, metadata: Metadata, planner: LoadPlanner, device: torch.device
) -> torch.Tensor | None:
    """The state's tensor that ``rec``'s bytes, received as they are, load exactly (``item`` reads the
    whole record into a contiguous tensor of the record's dtype and shape, on the group's device); None
    when they do not (the record is then received with the other bytes and copied as DCP copies it)."""
    info = metadata.storage_data[item.storage_index]
    entry = metadata.state_dict_metadata.get(item.storage_index.fqn)
    if item.type != LoadItemType.TENSOR or info.transform_descriptors or not rec.plain:
        return None
    if not isinstance(entry, TensorStorageMetadata) or any(item.storage_offsets):
        return None
    chunk = next(
        (c for c in entry.chunks if tuple(c.offsets) == tuple(item.storage_index.offset or ())), None
    )
    if chunk is None or tuple(chunk.sizes) != tuple(item.lengths):
        return None
    target = planner.resolve_tensor(item).detach()
    if (
        target.dtype != entry.properties.dtype
        or target.device.type != "cpu"  # its bytes are checked as they arrive (on the host)
        or target.device != device
        or not target.is_contiguous()
        or tuple(target.size()) != tuple(item.lengths)
        or target.numel() * target.element_size() != rec.nbytes
    ):
        return None
    return target


@dataclass
class Received:
    """What :func:`recv_records` received."""

    mapped: mmap.mmap | None  # the bytes not received into the state (None: none)
    loaded: set[int]  # indices of the plan's items loaded straight into the state
    size: int  # bytes received
    direct: int  # of them, straight into the state
    why: str  # '' when the bytes match the digest the sender recorded for the file (or none is), else why


def recv_records(
    src: int, items: Sequence[tuple[int, ReadItem]], metadata: Metadata, planner: LoadPlanner
) -> Received:
    """Receive a data file sent by :func:`send_records` on rank ``src``: each large tensor record that
    one of ``items`` (this rank's reads of the file, with their indices in its plan) loads whole goes
    straight into the state's tensor (no intermediate copy, into memory the caller allocated); the
    rest into a private map, read from there afterwards. Every byte is checked, in file order as it
    arrives, against the digest the sender recorded for the file (:attr:`Received.why`: the caller must
    not use the bytes when it is set).

    Whatever this rank decides, it receives every message the sender sends (a failure to place a record
    sends it to the map): the sender never waits on a receive that does not come."""
    device = _device()
    header = torch.zeros(3, dtype=torch.int64, device=device)
    dist.recv(header, src)
    size, count, digest_length = (int(v) for v in header.tolist())
    if size == 0:
        return Received(None, set(), 0, 0, "")
    layout: list[RecordBytes] = []
    if count:
        flat = torch.zeros(4 * count, dtype=torch.int64, device=device)
        dist.recv(flat, src)
        values = flat.tolist()
        layout = [
            RecordBytes(values[i], values[i + 1], values[i + 2], bool(values[i + 3]))
            for i in range(0, len(values), 4)
        ]
    verifier = None
    if digest_length:
        recorded = torch.zeros(digest_length, dtype=torch.uint8, device=device)
        dist.recv(recorded, src)
        verifier = digest.Verifier(bytes(recorded.cpu().tolist()).decode())
    by_record: dict[int, list[tuple[int, ReadItem]]] = {}
    for index, item in items:
        by_record.setdefault(metadata.storage_data[item.storage_index].offset, []).append((index, item))
    plan = chunks(size, layout)
    targets: dict[int, tuple[int, ReadItem, torch.Tensor]] = {}
    for _, _, i in plan:
        readers = by_record.get(layout[i].record, []) if i >= 0 else []
        if len(readers) != 1:
            continue
        try:
            target = _direct_target(readers[0][1], layout[i], metadata, planner, device)
        except Exception:  # noqa: BLE001 - any doubt: the record goes the copying way, which reports errors
            target = None
        if target is not None:
            targets[i] = (*readers[0], target)
    rest = sum(end - start for start, end, i in plan if i not in targets)
    # Huge pages only where most of the file lands in the map: each touched huge page is 2 MiB to zero.
    mapped = hostmem.anonymous(size, huge=rest * 2 >= size) if rest else None
    view = torch.frombuffer(mapped, dtype=torch.uint8) if mapped is not None else None
    got = Received(mapped, set(), size, 0, "")
    placed: list[tuple[int, ReadItem, torch.Tensor]] = []
    try:
        for start, end, i in plan:
            if i in targets:
                part = targets[i][2].view(-1).view(torch.uint8)
                dist.recv(part, src)
                placed.append(targets[i])
                got.direct += end - start
            elif view is not None:
                part = view[start:end]
                if device.type == "cpu":
                    dist.recv(part, src)
                else:
                    staged = torch.empty(end - start, dtype=torch.uint8, device=device)
                    dist.recv(staged, src)
                    part.copy_(staged)
            else:
                continue
            if verifier is not None:
                verifier.update(part.numpy())
            del part
    finally:
        del view  # no tensor may export the map when it is closed
    if verifier is not None:
        got.why = verifier.why(f"a file from rank {src}")
    if not got.why:  # damaged bytes are never committed: the restore chooses again
        for index, item, target in placed:
            planner.commit_tensor(item, target)
            got.loaded.add(index)
    return got


@dataclass
class Deferred:
    """The transfers of a restore's files that only their receiving rank reads, run when DCP reads
    (:class:`~elastic.checkpoint.dcp_io.Exchange`; :class:`~elastic.checkpoint.dcp_io.MappedReader` calls
    it on every rank between the same two collectives): the receiver then knows which of the state's
    tensors each record loads, and receives large ones straight into them (:func:`recv_records`).

    Receiving into fresh memory costs a page fault per page inside the kernel's copy (on the development
    VM 4x the transfer itself); the state's tensors are allocated, and usually touched, already.

    Digest checks that would delay the transfers run beside them: the receiver checks a file as it
    arrives (the sender sends its recorded digest first), the writer checks the files only it reads
    while its sends run (:meth:`verify_local`). A failed check is raised by :meth:`finish` after every
    transfer completed (no rank is left waiting on another), on the detecting rank, as
    :class:`DamagedShardsError`; DCP raises it on every rank, and :func:`elastic.sharded.load_sharded`
    leaves the damaged files out and chooses again, loading the whole state anew."""

    transfers: list[Transfer]
    rank: int
    names: Mapping[int, str]  # file id -> file name
    source: Mapping[str, Path]  # file name -> this rank's copy (for the files it sends)
    step: int
    node_keys: list[int]  # each rank's node (shard_restore.node_key), to name a damaged sender's file
    #: Files of this rank's node checked against their digest by this rank, mapped (by name): the files
    #: it sends are sent from these maps, the ones it reads read from them; closed by :meth:`close`.
    checked: dict[str, mmap.mmap] = field(default_factory=dict)
    check_later: list[str] = field(default_factory=list)  # names of files only this rank reads, unchecked
    received: int = 0  # bytes this rank received
    direct: int = 0  # of them, straight into the state's tensors
    maps: dict[str, mmap.mmap] = field(default_factory=dict)  # files received into memory, by name
    bad: dict[Path, str] = field(default_factory=dict)  # files of this node that failed a check here
    remote: list[tuple[int, str, str]] = field(default_factory=list)  # (sender, file, why) failed here

    def involves_me(self) -> bool:
        return bool(self.check_later) or any(self.rank in (t.src, t.dst) for t in self.transfers)

    def receives(self) -> bool:
        return any(t.dst == self.rank for t in self.transfers)

    def __call__(
        self, metadata: Metadata, plan: LoadPlan, planner: LoadPlanner
    ) -> tuple[dict[str, mmap.mmap], set[int]]:
        loaded: set[int] = set()
        for t in self.transfers:
            name = self.names[t.file]
            if t.src == self.rank:
                send_records(self.source[name], t.dst, metadata, self.checked.get(name))
            elif t.dst == self.rank:
                items = [
                    (i, item)
                    for i, item in enumerate(plan.items)
                    if metadata.storage_data[item.storage_index].relative_path == name
                ]
                got = recv_records(t.src, items, metadata, planner)
                if got.mapped is not None:
                    self.maps[name] = got.mapped
                loaded |= got.loaded
                self.received += got.size
                self.direct += got.direct
                if got.why:
                    self.remote.append((t.src, name, got.why))
        if self.received:
            log.info(
                "received %.1f MiB of shards from other nodes while loading (%.1f MiB into the state)",
                self.received / (1 << 20),
                self.direct / (1 << 20),
            )
        return dict(self.maps), loaded

    def verify_local(self) -> dict[str, mmap.mmap]:
        """Check the files only this rank reads (on every core); returns the good ones mapped, by name."""
        bad, maps = _check_files([self.source[n] for n in self.check_later])
        self.bad |= bad
        good = {p.name: m for p, m in maps.items()}
        self.checked |= good
        return good

    def rejected(self) -> set[str]:
        """Names of files whose bytes failed a check here: nothing more is read from them."""
        return {p.name for p in self.bad} | {name for _, name, _ in self.remote}

    def finish(self) -> None:
        """Raise :class:`DamagedShardsError` when a file failed its check on this rank (reported first)."""
        if not self.bad and not self.remote:
            return
        for path, why in self.bad.items():
            log.error(
                "a file of the sharded checkpoint of step %d failed its digest check: %s", self.step, why
            )
            report_corrupt(self.step, str(path))
        for src, _name, why in self.remote:
            log.error(
                "a file of step %d received from rank %d failed its digest check: %s", self.step, src, why
            )
        raise DamagedShardsError(self.step, dict(self.bad), list(self.remote))

    def damaged(self, failures: Mapping[int, DamagedShardsError]) -> set[Path]:
        """This node's files named by ``failures`` (raised on those ranks): the damaged files that ranks
        of this node found, and the files this node sent that failed their check where they arrived
        (reported here, by their holder). Paths found on other nodes are theirs (the same path may name
        another file here)."""
        mine = self.node_keys[self.rank]
        paths: set[Path] = set()
        for rank, failure in failures.items():
            if self.node_keys[rank] == mine:
                paths |= set(failure.bad)
            for src, name, _ in failure.remote:
                if self.node_keys[src] == mine and name in self.source:
                    paths.add(self.source[name])
                    if src == self.rank:
                        report_corrupt(self.step, str(self.source[name]))
        return paths

    def close(self) -> None:
        """Free the files received into memory and unmap the checked ones (now, or once no tensor views
        them)."""
        _close_maps(self.maps)
        _close_maps(self.checked)
        self.maps, self.checked = {}, {}


def _close_maps(maps: Mapping[str, mmap.mmap]) -> None:
    for mapped in maps.values():
        with contextlib.suppress(BufferError):
            mapped.close()


# -- the folder dcp.load reads ----------------------------------------------------------------------
log = logging.getLogger(__name__)


class DamagedShardsError(CheckpointCorruptError):
    """Files of the chosen sharded step failed their digest check (on this rank: :attr:`bad`, path -> why;
    empty when they were on another rank; :attr:`remote`: ``(sender rank, file name, why)`` of files
    received from another node that failed their check here). Every rank raises it together; the restore
    leaves the damaged files out and chooses again (another holder's copy, or an older step)."""

    def __init__(
        self, step: int, bad: dict[Path, str], remote: list[tuple[int, str, str]] | None = None
    ) -> None:
        self.step, self.bad, self.remote = step, bad, list(remote or [])
        why = "; ".join([*bad.values(), *(w for _, _, w in self.remote)]) or "on another node"
        errors.CheckpointError.__init__(
            self, f"a file of the sharded checkpoint of step {step} is damaged: {why}"
        )
        self.what, self.recorded, self.computed = why, "", ""

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised inside DCP's read, it travels to every rank pickled (torch's CheckpointException).
        return (DamagedShardsError, (self.step, self.bad, self.remote))


_RESTORE_SUBDIR = "restore"


@dataclass
class Assembled:
    """What :func:`assemble` made of a step on this rank."""

    folder: Path  # the folder dcp.load reads (its metadata, and the files in it)
    writes: bool  # this rank assembled the folder (and removes it after the load)
    received: int  # bytes this rank received from other nodes into the folder
    #: The transfers of files only their receiver reads, run when DCP reads (:func:`reader`).
    deferred: Deferred

    def close(self) -> None:
        """Free what the deferred transfers received into memory."""
        self.deferred.close()


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
    transfers = plan_transfers(needs, holders)
    # Files that only their receiver (a node's writer) reads are received while DCP reads, into the
    # state's tensors where they fit (Deferred); the others now, into the node's folder.
    private = private_files(reads_by_rank, writer_of)
    later = [t for t in transfers if t.file in private.get(t.dst, ())]
    now = [t for t in transfers if t.file not in private.get(t.dst, ())]
    # Every file is checked against its recorded digest before the restore returns: the node's writer
    # checks now the files its node's ranks read and the files it sends into another node's folder; a
    # file only the writer itself reads is checked while its sends run (Deferred.verify_local), and a
    # file received into the state by its receiver as it arrives (recv_records): the check then costs
    # no time of its own on the restore's critical path. Bytes that fail it are never kept: the ranks
    # choose again and load everything anew.
    node_reads = needs.get(rank, ()) if writer_of[rank] == rank else ()
    own_private = (
        {names[f] for f in private.get(rank, ()) if names[f] in mine} if writer_of[rank] == rank else set()
    )
    checked = {names[f] for f in node_reads if names[f] in mine} - own_private
    checked |= {names[t.file] for t in now if t.src == rank}
    sent_later = {names[t.file] for t in later if t.src == rank}
    bad, maps = _check_files([mine[n] for n in sorted(checked)])
    bad |= {
        mine[n]: f"{mine[n]}: no recorded digest in {sl.HASHES}"
        for n in sent_later
        if sl.recorded_text(mine[n]) == ""
    }
    mapped = {p.name: m for p, m in maps.items()}
    if collectives.any_rank(bool(bad), world):
        _close_maps(mapped)
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
    received = run_transfers(now, rank, names, mine, target)
    if received:
        log.info("received %.1f MiB of step %d's shards from other nodes", received / (1 << 20), step)
    collectives.barrier()  # every node's writer has its files before anyone reads
    deferred = Deferred(later, rank, names, mine, step, keys, mapped)
    deferred.check_later = sorted(own_private - set(mapped))
    return Assembled(target, writes, received, deferred)


def _check_files(paths: list[Path]) -> tuple[dict[Path, str], dict[Path, mmap.mmap]]:
    """The files among ``paths`` that fail their digest check, with why, and the others mapped
    (:func:`elastic.checkpoint.shard_layout.check_mapped`: the restore reads or sends them from that
    map). Checked on every core: the hash releases the GIL, and each file's page tables are filled by
    the thread that maps it."""
    workers = min(len(paths), os.cpu_count() or 1)
    if workers < 2:
        found = [sl.check_mapped(p) for p in paths]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            found = list(pool.map(sl.check_mapped, paths))
    bad = {p: why for p, (why, _) in zip(paths, found, strict=True) if why}
    return bad, {p: mapped for p, (_, mapped) in zip(paths, found, strict=True) if mapped is not None}


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


def reader(path: Path, shm: Path | None, deferred: Deferred | None = None) -> Any:
    """DCP's reader of ``path`` on this rank: files in shared memory are copied from their mapping (one
    copy, no read into a temporary tensor; :class:`elastic.checkpoint.dcp_io.MappedReader`), files on
    disk read as DCP reads them; the ``deferred`` transfers this rank takes part in run when it reads."""
    from torch.distributed.checkpoint import FileSystemReader

    exchange = deferred if deferred is not None and deferred.involves_me() else None
    checked = deferred.checked if deferred is not None else {}
    if shm is not None and path.resolve().is_relative_to(shm.resolve()):
        return dcp_io.MappedReader(path, checked, exchange)
    if exchange is not None or checked:
        return dcp_io.MappedReader(path, checked, exchange, map_files=False)
    return FileSystemReader(path)
