"""Memory-speed ``torch.distributed.checkpoint`` (DCP) storage for sharded flash checkpoints: the writer into
reused shared-memory segments, the replay of a recorded save, and the reader from mapped files.

Only public formats and APIs of DCP: its ``StorageWriter``/``FileSystemWriter`` and
``StorageReader``/``FileSystemReader``, save and load planners, metadata and plans; the files written are
byte for byte what ``FileSystemWriter`` writes (``FileSystemReader`` and ``dcp.load`` read them), so the
agent can persist them to disk unchanged.

**Writes.** ``FileSystemWriter`` writes each rank's shards into ``__<rank>_<i>.distcp`` (one ``torch.save``
record per tensor) through its file system object. :class:`SegmentWriter` is that writer with the file
system replaced (``FileSystemWriter.fs``, the hook DCP's fsspec writer uses too) by :class:`SegmentFS`,
whose data files are *segments*: files of the agent's shared-memory folder that this process keeps mapped
from one save to the next (as :mod:`elastic.checkpoint.segments` does for replicated state):

* a save **recycles** the file this process wrote two saves ago (the double buffer: the newest committed
  step is never touched), renaming it into the new save's temp folder and overwriting it in place; a
  file under a reader (the agent replicating or persisting it holds a shared ``flock``) is left alone
  and a new segment is made;
* new pages are **pre-faulted** once (``MADV_POPULATE_WRITE``), so the copy takes no page faults;
* each data file's digest (:mod:`elastic.checkpoint.digest`, xxh3_128) is computed as its bytes go in,
  each write hashed right after its copy, and written beside it (``<file>.xxh3``,
  :func:`elastic.checkpoint.shard_layout.check_file` checks it at restore);
* CRC32 of the records is off while it writes (``torch.utils.serialization.config.save.compute_crc32``,
  torch's documented switch; ``torch.load`` does not check it): a CRC pass would cost 4x the copy.

**Replays.** A DCP save exchanges plans and write results between all ranks (about nine small collectives,
10-20 ms on gloo) around copying the shards, which alone takes as long as a memcpy. While the state keeps
its structure, every save writes the same file, byte for byte, but for the tensors' bytes and the pickled
small objects (a step counter, a learning rate): torch.save's headers and pickles do not change (CRC32 is
off for flash saves), and DCP's metadata (which item lies where) is the same too. So a full DCP save is
*recorded* (:class:`Recorder`: every write of this rank's data file, and which item it came from), and
later saves *replay* it (:class:`Replay`): the constant chunks as they were, each item's current bytes in
its place, and the recorded metadata. Flash saves replay only when every rank can (one all-reduce,
:mod:`elastic.checkpoint.shard_save`); otherwise they make a full DCP save again, recorded anew. A rank can
replay when DCP would plan the same items for it now (same keys, shapes, dtypes, shard offsets) and every
item is as long as it was.

**Reads.** ``FileSystemReader`` loads each tensor record of a ``.distcp`` file with ``torch.load`` from a
file view: the record's bytes are read into a new tensor (one copy, into freshly allocated pages that
fault in one by one), which is then copied into the state's tensor (a second copy). For files in shared
memory (a node's own flash checkpoint, a replica, files received at restore) :class:`MappedReader` maps
the file (``MAP_POPULATE``: the page-table entries are filled in one call, no fault per page) and copies
each record's bytes straight from the mapping into the state's tensor: one copy, from memory that is
resident already. This is what makes a restore from memory faster than one from disk's page cache. It
uses ``torch.load(map_location="meta")`` for a record's dtype and layout (it reads no tensor data) and the
zip format (stdlib :mod:`zipfile`) for where the record's storage bytes lie; a record that does not fit
this shape (more than one storage, compressed, a stream transform) is read by ``FileSystemReader``'s own
path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import io
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import warnings
import zipfile
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, WriteItem
from torch.futures import Future

from elastic.checkpoint import shard_layout
from elastic.checkpoint.segments import NoSpaceError

# -- writes -----------------------------------------------------------------------------------------
log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
SPARE_PREFIX = shard_layout.SPARE_PREFIX
_SPARE = -1  # the step of a spare segment
_PAGE = mmap.PAGESIZE
_TORCH_COPY_MIN = 1 << 20  # larger writes use torch's copy (its intra-op threads)


@dataclass
class _Segment:
    fd: int
    mm: mmap.mmap | None
    key: tuple[int, int]
    name: str  # file name (``__R_I.distcp``)
    step: int  # the save it holds
    save_id: str
    size: int  # file size now


class SegmentPool:
    """The data-file segments one process wrote into one sharded folder (``<shm>/sharded``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self.fresh_bytes = 0  # pages newly allocated by the last save
        self.prefault_s = 0.0

    def forget_removed(self) -> None:
        """Unmap segments whose files were removed (pruned, swept)."""
        for segment in list(self._segments):
            if os.fstat(segment.fd).st_nlink == 0:
                self._forget(segment)

    def _forget(self, segment: _Segment) -> None:
        self._segments.remove(segment)
        if segment.mm is not None:
            with contextlib.suppress(BufferError):
                segment.mm.close()
        os.close(segment.fd)

    def close(self) -> None:
        for segment in list(self._segments):
            self._forget(segment)

    def _where(self, segment: _Segment) -> Path | None:
        """The path of a segment's file now (its save's data or temp folder, or the spare's name),
        checked by inode."""
        if segment.step == _SPARE:
            places = [self.root / segment.name]
        else:
            places = [
                self.root / folder / segment.name
                for folder in (
                    shard_layout.data_dir_name(segment.step, segment.save_id),
                    shard_layout.tmp_dir_name(segment.step, segment.save_id),
                )
            ]
        for path in places:
            with contextlib.suppress(FileNotFoundError):
                info = path.stat()
                if (info.st_dev, info.st_ino) == segment.key:
                    return path
        return None

    def open(self, path: Path, step: int, save_id: str, protect: set[str]) -> _Segment:
        """A segment under ``path`` (in the save's temp folder), locked ``LOCK_EX``: a recycled one
        (not of a save in ``protect``, the data folders to keep) when one is free, else a new file."""
        with self._lock:
            self.forget_removed()
            for segment in sorted(self._segments, key=lambda s: s.step):
                if shard_layout.data_dir_name(segment.step, segment.save_id) in protect:
                    continue
                if segment.step == step and segment.save_id == save_id:
                    continue
                current = self._where(segment)
                if current is None:
                    continue
                try:
                    fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a reader (the agent) holds it
                try:
                    os.utime(segment.fd)
                    os.rename(current, path)
                except FileNotFoundError:
                    fcntl.flock(segment.fd, fcntl.LOCK_UN)
                    continue
                segment.name, segment.step, segment.save_id = path.name, step, save_id
                return segment
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            info = os.fstat(fd)
            segment = _Segment(fd, None, (info.st_dev, info.st_ino), path.name, step, save_id, 0)
            self._segments.append(segment)
            return segment

    def ensure(self, segment: _Segment, end: int) -> None:
        """Grow ``segment`` to hold ``end`` bytes: allocate and pre-fault the new pages only. The mapping
        grows in place (``mremap``), so the pages already mapped keep their page-table entries: a new
        mapping would fault every page in again at the next save (about as slow as the copy itself)."""
        if end <= segment.size and segment.mm is not None:
            return
        started = time.perf_counter()
        old = segment.size
        self._allocate(segment.fd, old, end - old)
        segment.size = end
        if segment.mm is None:
            segment.mm = mmap.mmap(segment.fd, end)
        else:
            segment.mm.resize(end)  # the file has this size already (fallocate): only the mapping grows
        start = old // _PAGE * _PAGE
        with contextlib.suppress(OSError):
            segment.mm.madvise(_MADV_POPULATE_WRITE, start, end - start)
        self.fresh_bytes += end - old
        self.prefault_s += time.perf_counter() - started

    def _allocate(self, fd: int, offset: int, length: int) -> None:
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                stats = os.statvfs(self.root)
                raise NoSpaceError(length, stats.f_bavail * stats.f_frsize) from exc
            raise

    def finish(self, segment: _Segment, length: int) -> None:
        """The save wrote ``length`` bytes: cut the file to them (no-op in steady state), unlock."""
        if segment.size != length:
            if segment.mm is not None and length:
                segment.mm.resize(length)  # in place: the remaining pages stay mapped
            elif segment.mm is not None:
                segment.mm.close()
                segment.mm = None
                os.ftruncate(segment.fd, 0)
            else:
                os.ftruncate(segment.fd, length)
            segment.size = length
        fcntl.flock(segment.fd, fcntl.LOCK_UN)

    def add_spares(self, step: int, save_id: str) -> None:
        """After this process's first save: a pre-faulted spare segment of the size of each segment of
        that save, so that the second save (the other half of the double buffer) allocates nothing
        either; the first save bears the cost (reported). Skipped when the folder has no room."""
        with self._lock:
            sizes = [s.size for s in self._segments if (s.step, s.save_id) == (step, save_id) and s.size]
            for size in sizes:
                name = f"{SPARE_PREFIX}{os.getpid()}.{secrets.token_hex(4)}"
                fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                info = os.fstat(fd)
                spare = _Segment(fd, None, (info.st_dev, info.st_ino), name, _SPARE, "", 0)
                self._segments.append(spare)
                try:
                    self.ensure(spare, size)
                except NoSpaceError:
                    self._forget(spare)
                    os.unlink(self.root / name)
                    log.info("no room for a spare shared-memory segment: the next save allocates its own")
                    return


class SegmentStream(io.RawIOBase):
    """A write-only stream into a segment, growing it when needed; every write told to ``recorder``."""

    def __init__(self, pool: SegmentPool, segment: _Segment, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.pool, self.segment, self.pos, self.recorder = pool, segment, 0, recorder
        #: The file's digest (elastic.checkpoint.digest), fed each write's bytes right after their copy.
        self.hasher = shard_layout.digest_hasher()

    def _hash(self, start: int) -> None:
        """Feed the bytes just written (``start`` to the position) to the digest, while still in cache."""
        assert self.segment.mm is not None
        with memoryview(self.segment.mm) as view:
            self.hasher.update(view[start : self.pos])

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.recorder is not None:
            self.recorder.wrote(self.segment.name, view)
        n = len(view)
        self.pool.ensure(self.segment, self.pos + n)
        if n >= _TORCH_COPY_MIN:
            with warnings.catch_warnings():  # the source is read-only (a tensor's bytes): only read here
                warnings.simplefilter("ignore", UserWarning)
                self._copy_in(torch.frombuffer(view, dtype=torch.uint8))
        else:
            assert self.segment.mm is not None
            self.segment.mm[self.pos : self.pos + n] = view
            self.hasher.update(view)
            self.pos += n
        return n

    def write_chunk(self, chunk: bytes | torch.Tensor) -> None:
        """Append a replayed chunk (:class:`Replay`): bytes, or a uint8 tensor copied
        straight in."""
        if isinstance(chunk, bytes):
            self.write(chunk)
        else:
            self.pool.ensure(self.segment, self.pos + chunk.numel())
            self._copy_in(chunk)

    def _copy_in(self, src: torch.Tensor) -> None:
        """Copy the uint8 tensor ``src`` to the stream's position (the segment holds room for it)."""
        n = src.numel()
        assert self.segment.mm is not None
        torch.frombuffer(self.segment.mm, dtype=torch.uint8, count=n, offset=self.pos).copy_(src)
        self.pos += n
        self._hash(self.pos - n)

    def fileno(self) -> int:
        return self.segment.fd


class SegmentFS(FileSystem):
    """DCP's file system with ``.distcp`` writes going into segments (everything else: plain files)."""

    def __init__(
        self, pool: SegmentPool, step: int, save_id: str, protect: set[str], recorder: Recorder | None = None
    ) -> None:
        super().__init__()
        self.pool, self.step, self.save_id, self.protect = pool, step, save_id, protect
        self.recorder = recorder

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        if "w" not in mode or shard_layout.file_id(path.name) is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        segment = self.pool.open(path, self.step, self.save_id, self.protect)
        stream = SegmentStream(self.pool, segment, self.recorder)
        try:
            yield stream
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
            raise
        self.pool.finish(segment, stream.pos)
        # The digest the restore checks this file against (shard_layout.check_file).
        shard_layout.digest_path(path).write_text(stream.hasher.hexdigest())


class SegmentWriter(FileSystemWriter):
    """``FileSystemWriter`` whose data files are segments of ``pool`` (see the module doc)."""

    def __init__(
        self,
        path: Path,
        pool: SegmentPool,
        step: int,
        save_id: str,
        protect: set[str],
        recorder: Recorder | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.fs = SegmentFS(pool, step, save_id, protect, recorder)


class CachingPlanner(DefaultSavePlanner):
    """DCP's default planner with its plan cache on (``enable_plan_caching``, public API): while the
    state's structure does not change, the ranks send empty plans and reuse the cached global plan and
    metadata, instead of planning and exchanging every shard's description at every save. The cache is
    DCP's, per planner class (so flash saves do not share it with the script's own ``dcp.save`` calls)."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        super().__init__(enable_plan_caching=True)
        self.recorder = recorder

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if self.recorder is not None:
            self.recorder.resolved(write_item, data)
        return data


@contextlib.contextmanager
def crc_off() -> Generator[None, None, None]:
    """torch.save without its CRC32 pass while a flash save writes (torch's documented switch)."""
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous


_pools: dict[Path, SegmentPool] = {}


def pool_for(root: Path) -> SegmentPool:
    """This process's segment pool of ``root`` (made on first use; its segments stay mapped)."""
    key = root.resolve()
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = SegmentPool(root)
    return pool


# -- replays ----------------------------------------------------------------------------------------
#: A write at least this long that came from no item makes a save unreplayable: constant chunks (zip
#: headers, pickles of a tensor's shape) are far shorter.
MAX_CONSTANT_BYTES = 1 << 16

#: One chunk of a recorded file: constant bytes, or (the item whose bytes go there, their length).
Step = bytes | tuple[WriteItem, int]
#: One chunk of a file to write now: bytes, or a tensor's storage as uint8.
Chunk = bytes | torch.Tensor


def _address(view: memoryview) -> int:
    if not len(view):
        return 0
    with warnings.catch_warnings():  # a read-only buffer: only its address is read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def _tensor_bytes(data: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CPU tensor's bytes as uint8, in order: what torch.save writes for it, whether DCP
    wrote the tensor itself or a clone (it clones a view of a larger storage). None for other tensors."""
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    return data.reshape(-1).view(torch.uint8)


def _replayable(data: Any) -> bool:
    """Whether a resolved item's bytes can be put in place again: a contiguous CPU tensor, a pickle."""
    if isinstance(data, torch.Tensor):
        return data.device.type == "cpu" and data.is_contiguous()
    return isinstance(data, io.BytesIO)


def _chunk(data: Any) -> Chunk | None:
    """What goes into the file for a resolved item now."""
    if isinstance(data, torch.Tensor):
        return _tensor_bytes(data)
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    return None


def local_plan(state: dict[str, Any], is_coordinator: bool) -> tuple[DefaultSavePlanner, list[tuple]]:
    """A fresh planner set up on ``state``, and what DCP plans for this rank (no collective)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=is_coordinator)
    plan = planner.create_local_plan()
    return planner, [(item.index, item.type, item.tensor_data) for item in plan.items]


class Recorder:
    """Watches one full DCP save of this rank: each item as DCP resolves it, then the writes of its bytes.

    DCP resolves an item, then writes it (torch.save: headers, a pickle, the data). The write of the item's
    data is told from the headers by its address (the tensor's own memory, the pickle's buffer) or, for a
    clone DCP made, by its length and content. Every item's data must be found, once, and no long write may
    be left unexplained; otherwise the save is not replayed."""

    def __init__(self) -> None:
        self._items: list[tuple[WriteItem, Any, bool]] = []  # (item, resolved data, its data was written)
        self._files: dict[str, list[Step]] = {}
        self._broken = False

    def resolved(self, item: WriteItem, data: Any) -> None:
        """DCP's planner resolved ``item`` to ``data``, which it writes next."""
        if not _replayable(data):
            self._broken = True  # a device tensor, a non-contiguous one: never replayed
        self._items.append((item, data, False))

    def wrote(self, file_name: str, view: memoryview) -> None:
        """``view`` was written to the end of ``file_name``."""
        steps = self._files.setdefault(file_name, [])
        if self._items and not self._items[-1][2] and self._is_data(self._items[-1][1], view):
            item, data, _ = self._items[-1]
            self._items[-1] = (item, None, True)  # its data is not kept past the match
            steps.append((item, len(view)))
        elif len(view) < MAX_CONSTANT_BYTES:
            steps.append(bytes(view))
        else:
            self._broken = True

    @staticmethod
    def _is_data(data: Any, view: memoryview) -> bool:
        if isinstance(data, io.BytesIO):  # DCP writes the pickle's own buffer
            with data.getbuffer() as own:
                return _address(own) == _address(view) and len(own) == len(view)
        chunk = _tensor_bytes(data) if isinstance(data, torch.Tensor) else None
        if chunk is None or chunk.numel() != len(view):
            return False
        if chunk.data_ptr() == _address(view):
            return True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.equal(torch.frombuffer(view, dtype=torch.uint8), chunk)

    def replay(self, metadata: Metadata, local_keys: list[tuple], is_coordinator: bool) -> Replay | None:
        """What later saves replay, or None when this save cannot be replayed."""
        if self._broken or not all(written for _, _, written in self._items):
            return None
        return Replay(self._files, metadata, local_keys, is_coordinator)


@dataclasses.dataclass
class Replay:
    """One rank's recorded save: each data file's chunks in order, DCP's metadata of that save, and the
    local plan it came from."""

    files: dict[str, list[Step]]
    metadata: Metadata
    local_keys: list[tuple]
    is_coordinator: bool

    def prepare(self, state: dict[str, Any]) -> dict[str, list[Chunk]] | None:
        """Each file's chunks for ``state``, or None when ``state`` would not be written the same way (its
        structure changed, or an item's length: a step counter that grew a byte)."""
        planner, keys = local_plan(state, self.is_coordinator)
        if keys != self.local_keys:
            return None
        out: dict[str, list[Chunk]] = {}
        for name, steps in self.files.items():
            chunks: list[Chunk] = []
            for step in steps:
                if isinstance(step, bytes):
                    chunks.append(step)
                    continue
                item, length = step
                chunk = _chunk(planner.resolve_data(item))
                if chunk is None or (len(chunk) if isinstance(chunk, bytes) else chunk.numel()) != length:
                    return None
                chunks.append(chunk)
            out[name] = chunks
        return out


# -- reads ------------------------------------------------------------------------------------------
_STORAGE_RECORD = re.compile(r"^[^/]+/data/\d+$")  # torch.save's storage records: <archive>/data/<key>
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... name and extra lengths
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


class _ViewStream(io.RawIOBase):
    """A read-only, seekable stream over a memoryview (no copy of the bytes it is not asked for)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        chunk = self.view[self.pos : self.pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self.pos += n
        return n


def record_storage(view: memoryview) -> tuple[int, int, torch.Tensor] | None:
    """Where a ``torch.save`` record (``view``) keeps its one storage: ``(offset of its bytes in the
    record, their length, the tensor's layout on the meta device)``; None when the record is not one
    uncompressed storage."""
    with zipfile.ZipFile(_ViewStream(view)) as archive:
        records = [info for info in archive.infolist() if _STORAGE_RECORD.match(info.filename)]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = records[0]
    signature, name_length, extra_length = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if signature != _LOCAL_HEADER_SIGNATURE:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    stream = cast(IO[bytes], _ViewStream(view))  # a binary file object, as torch.load reads one
    meta = torch.load(stream, map_location="meta", weights_only=True)  # layout only
    if not isinstance(meta, torch.Tensor) or meta.untyped_storage().nbytes() != info.file_size:
        return None
    return start, info.file_size, meta


def record_tensor(view: memoryview, base: int, mapped: mmap.mmap) -> torch.Tensor | None:
    """The tensor of a ``torch.save`` record (``view``, at offset ``base`` of ``mapped``) as a view of
    the mapping, without copying its data; None when the record is not one uncompressed storage."""
    found = record_storage(view)
    if found is None:
        return None
    start, nbytes, meta = found
    with warnings.catch_warnings():  # a read-only mapping: the tensor is only read (copied from)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=base + start)
    typed = raw.view(meta.dtype) if nbytes else torch.empty(0, dtype=meta.dtype)
    return typed.as_strided(meta.size(), meta.stride(), meta.storage_offset())


@dataclass(frozen=True)
class RecordBytes:
    """Where a tensor record's data lies in its file (:func:`record_layout`)."""

    record: int  # the record's offset in the file (DCP's ``_StorageInfo.offset``)
    start: int  # the first byte of the tensor's data in the file
    nbytes: int
    #: The data is the tensor's elements in order, nothing else (contiguous, from the storage's start,
    #: filling it): bytes received straight into a contiguous tensor of its dtype and shape load it.
    plain: bool


def record_layout(mapped: mmap.mmap | memoryview, records: list[tuple[int, int]]) -> list[RecordBytes]:
    """For each ``(offset, length)`` record of a data file (mapped), where its tensor's data lies; records
    that are not one uncompressed storage (pickled objects, several storages) are left out."""
    layout = []
    view = memoryview(mapped)
    try:
        for offset, length in sorted(records):
            record = view[offset : offset + length]
            try:
                found = record_storage(record)
            except Exception:  # noqa: BLE001 - a record that does not parse travels as plain bytes
                found = None
            finally:
                record.release()
            if found is None:
                continue
            start, nbytes, meta = found
            plain = (
                meta.is_contiguous()
                and meta.storage_offset() == 0
                and meta.numel() * meta.element_size() == nbytes
            )
            layout.append(RecordBytes(offset, offset + start, nbytes, plain))
    finally:
        view.release()
    return layout


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class Exchange(Protocol):
    """A rank's part of a restore's transfers and digest checks, run by :class:`MappedReader` when DCP
    reads (every rank then runs it, between the same two collectives).
    :class:`elastic.checkpoint.shard_restore.Deferred` is the one in use."""

    def receives(self) -> bool:
        """Whether this rank receives files (else it only sends, and touches no planner)."""
        ...

    def __call__(
        self, metadata: Metadata, plan: LoadPlan, planner: LoadPlanner
    ) -> tuple[dict[str, mmap.mmap], set[int]]:
        """Run the transfers: returns the files received into this process's memory by name, and the
        indices of this rank's plan items they loaded already."""
        ...

    def verify_local(self) -> dict[str, mmap.mmap]:
        """Check the files of this node that only this rank reads; returns the good ones mapped."""
        ...

    def rejected(self) -> set[str]:
        """Names of files that failed a check: nothing is read from them."""
        ...

    def finish(self) -> None:
        """Raise when a file failed its check (after every transfer completed)."""
        ...


class MappedReader(FileSystemReader):
    """``FileSystemReader`` that copies tensors straight from the mapped data files (see the module doc).

    For files in shared memory (tmpfs): mapping a file on disk would fault its pages in one by one
    (``map_files=False``: the folder's files are read by ``FileSystemReader``'s own path). Files received
    from another node into this process's memory (``in_memory``, by name: anonymous maps,
    :func:`elastic.checkpoint.shard_restore.recv_memory`) are read from there; they are not in ``path``.
    ``exchange`` runs first, when DCP reads: the transfers a restore performs while it knows where each
    item goes (:data:`Exchange`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        in_memory: Mapping[str, mmap.mmap] | None = None,
        exchange: Exchange | None = None,
        map_files: bool = True,
    ) -> None:
        super().__init__(path)
        self.in_memory = dict(in_memory or {})
        self.exchange, self.map_files = exchange, map_files
        self.metadata: Metadata | None = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        exchange = self.exchange
        if exchange is None:
            return self._read(plan, planner)
        if self.metadata is None:
            raise AssertionError("read_data before set_up_storage_reader")
        if exchange.receives():
            received, loaded = exchange(self.metadata, plan, planner)
            self.in_memory.update(received)
            self.in_memory.update(exchange.verify_local())
            self._read(self._without(plan, loaded, exchange.rejected()), planner)
        else:
            # Only sends (no planner call): they run while this rank checks and loads its own files,
            # each on a core of its own (a send's time is the kernel's copy into the socket).
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="elastic-send") as pool:
                sending = pool.submit(exchange, self.metadata, plan, planner)
                try:
                    self.in_memory.update(exchange.verify_local())
                    self._read(self._without(plan, set(), exchange.rejected()), planner)
                finally:
                    sending.result()
        exchange.finish()
        return self._done()

    def _without(self, plan: LoadPlan, loaded: set[int], rejected: set[str]) -> LoadPlan:
        """``plan`` less the items loaded already and the items of files that failed their check."""
        return LoadPlan(
            [
                item
                for i, item in enumerate(plan.items)
                if i not in loaded and self.storage_data[item.storage_index].relative_path not in rejected
            ]
        )

    @staticmethod
    def _done() -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if self.storage_data[item.storage_index].transform_descriptors:
                self._write_in_memory()  # DCP's own reader opens every file by name
                return super().read_data(plan, planner)  # a stream transform (e.g. compression)
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        fallback: list[ReadItem] = []
        for relative_path, items in per_file.items():
            held = self.in_memory.get(relative_path)
            if held is not None:
                fallback += self._read_mapped(held, items, planner)
            elif self.map_files:
                fallback += self._read_file(Path(self.path) / relative_path, items, planner)
            else:
                fallback += items
        if fallback:
            self._write_in_memory()
            super().read_data(LoadPlan(fallback), planner)
        return self._done()

    def _write_in_memory(self) -> None:
        """Write the files held in memory into the folder, for DCP's own reader (a rare fallback)."""
        for name, mapped in self.in_memory.items():
            path = Path(self.path) / name
            if not path.exists():
                path.write_bytes(mapped)

    def _read_file(self, path: Path, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Load ``items`` from the mapped ``path``; returns the items left to ``FileSystemReader``."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return items
            mapped = mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        try:
            return self._read_mapped(mapped, items, planner)
        finally:
            with contextlib.suppress(BufferError):  # a tensor still exports it: unmapped when freed
                mapped.close()

    def _read_mapped(self, mapped: mmap.mmap, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Load ``items`` from ``mapped`` (a data file's bytes); returns the items left to
        ``FileSystemReader``."""
        left: list[ReadItem] = []
        view = memoryview(mapped)
        record: memoryview | None = None
        try:
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                info = self.storage_data[item.storage_index]
                record = view[info.offset : info.offset + info.length]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(bytes(record)))
                    continue
                source = record_tensor(record, info.offset, mapped)
                if source is None:
                    left.append(item)
                    continue
                source = _narrow(source, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise AssertionError(
                        f"req {item.storage_index} mismatch sizes {target.size()} vs {source.size()}"
                    )
                target.copy_(source)
                del source
                planner.commit_tensor(item, target)
        finally:
            record = None
            view.release()
        return left
