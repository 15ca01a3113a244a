"""Memory-speed DCP writes: ``torch.distributed.checkpoint``'s file-system writer, writing into reused,
pre-faulted shared-memory segments.

``FileSystemWriter`` writes each rank's shards into ``__<rank>_<i>.distcp`` (one ``torch.save`` record per
tensor) through its file system object. :class:`SegmentWriter` is that writer with the file system
replaced (``FileSystemWriter.fs``, the hook DCP's fsspec writer uses too) by :class:`SegmentFS`, whose data
files are *segments*: files of the agent's shared-memory folder that this process keeps mapped from one
save to the next (as :mod:`elastic.checkpoint.segments` does for replicated state):

* a save **recycles** the file this process wrote two saves ago (the double buffer: the newest committed
  step is never touched), renaming it into the new save's temp folder and overwriting it in place; a
  file under a reader (the agent replicating or persisting it holds a shared ``flock``) is left alone
  and a new segment is made;
* new pages are **pre-faulted** once (``MADV_POPULATE_WRITE``), so the copy takes no page faults;
* CRC32 of the records is off while it writes (``torch.utils.serialization.config.save.compute_crc32``,
  torch's documented switch; ``torch.load`` does not check it): a CRC pass would cost 4x the copy.

The files are byte for byte what ``FileSystemWriter`` writes (``FileSystemReader`` and ``dcp.load``
read them), so the agent can persist them to disk unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import mmap
import os
import secrets
import threading
import time
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItem

from elastic.checkpoint import shard_layout
from elastic.checkpoint.segments import NoSpaceError
from elastic.checkpoint.shard_replay import Recorder

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


class _SegmentStream(io.RawIOBase):
    """A write-only stream into a segment, growing it when needed; every write told to ``recorder``."""

    def __init__(self, pool: SegmentPool, segment: _Segment, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.pool, self.segment, self.pos, self.recorder = pool, segment, 0, recorder

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:  # type: ignore[override]
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
            self.pos += n
        return n

    def write_chunk(self, chunk: bytes | torch.Tensor) -> None:
        """Append a replayed chunk (elastic.checkpoint.shard_replay): bytes, or a uint8 tensor copied
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
        stream = _SegmentStream(self.pool, segment, self.recorder)
        try:
            yield stream
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
            raise
        self.pool.finish(segment, stream.pos)


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
