"""Shared-memory segments of flash saves: files that are allocated and pre-faulted once, then reused.

The first touch of a fresh tmpfs page costs far more than copying into it (about 3 s per GiB on a
small VM, against well under 0.1 s for the copy), and so does mapping an existing file anew (page-table
faults). A flash save therefore writes into a *segment*: a file of the shared-memory folder that this
process keeps mapped (``mmap``, ``MAP_SHARED``) from one save to the next:

* **recycle**: the next save takes a file that the save will make surplus anyway (the oldest of the
  :data:`keep` checkpoints, a checkpoint of a rolled-back step, the same step saved again) or a spare,
  renames it to a temp name and overwrites it in place; the commit is the rename to ``step_<N>.pt``, as
  for a new file, so a writer killed mid-save never leaves a torn checkpoint visible. In steady state
  the ``keep`` (2) files alternate: a double buffer, whose newest file is never touched by a save.
* **pre-fault**: new pages are faulted once, with ``MADV_POPULATE_WRITE`` (Linux 5.14+; else
  ``posix_fallocate`` and a write of zeros), when a segment is created or grows. The first save also
  creates a spare of its size, so that the second save recycles too (the first-save cost).
* **locks**: a reader that copies a checkpoint whole (the agent's keeper, a restore) holds a shared
  ``flock`` on it (:func:`elastic.checkpoint.layout.open_shared`); a segment is recycled only under
  ``LOCK_EX | LOCK_NB``. A file under a reader is left alone and another one is used: a spare, else a
  new segment. A surplus file that a reader still holds becomes the spare (at most one), so that
  a slow persist costs one more segment of memory, not a fresh allocation at every save.
* **space**: growth that the folder cannot hold gives memory back (the spare, then every checkpoint but
  the newest) and then raises :class:`NoSpaceError` with the bytes needed and available.

Spares are named ``.segment.<hex>``: hidden, never read as checkpoints, adopted by the next writer of
the folder (e.g. a restarted worker), removed with the folder by the agent. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic import errors
from elastic.checkpoint import layout

log = logging.getLogger(__name__)

SPARE_PREFIX = ".segment."
#: Room left free beside a segment: a save never fills the folder to its last page.
HEADROOM_BYTES = 1 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python < 3.13 lacks the name
_ZEROS = bytes(8 << 20)

Key = tuple[int, int]  # (st_dev, st_ino): a segment is its inode, whatever its name


class NoSpaceError(errors.CheckpointError):
    """The folder cannot hold a segment: ``need`` more bytes, ``free`` available."""

    def __init__(self, need: int, free: int) -> None:
        super().__init__(f"{need} bytes needed, {free} available")
        self.need, self.free = need, free


@dataclass
class Segment:
    """An open, mapped segment file; ``path`` is its name now (a temp name while it is written)."""

    path: Path
    fd: int
    key: Key
    mm: mmap.mmap | None = None


@dataclass(frozen=True)
class Acquired:
    """A segment ready for a save, and what getting it cost."""

    segment: Segment
    fresh_bytes: int  # pages allocated for it (0: all reused)
    prefault_s: float  # seconds spent faulting pages in (allocating and mapping)


def _key(info: os.stat_result) -> Key:
    return info.st_dev, info.st_ino


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _populate(segment: Segment, size: int) -> None:
    """Fault every page of the mapping in, writable, so the save's copy takes no page faults."""
    assert segment.mm is not None
    try:
        segment.mm.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError as exc:
        if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
            raise NoSpaceError(size, -1) from exc  # tmpfs full: a write would have been a SIGBUS
        if exc.errno != errno.EINVAL:
            raise
    # An older kernel: reserve the blocks (a write into a full tmpfs is a SIGBUS, not an error), then
    # touch every page.
    try:
        os.posix_fallocate(segment.fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise NoSpaceError(size, -1) from exc
        raise
    for offset in range(0, size, len(_ZEROS)):
        end = min(size, offset + len(_ZEROS))
        segment.mm[offset:end] = _ZEROS[: end - offset]


class SegmentPool:
    """The segments of one writer (local rank 0 of a node) in one shared-memory folder.

    Not thread-safe: one save at a time (the caller serialises).
    """

    def __init__(self, directory: Path, keep: int, free_bytes: Callable[[Path], int]) -> None:
        self.directory = directory
        self.keep = keep
        self.free_bytes = free_bytes
        self._mapped: dict[Key, Segment] = {}
        # The folder as listed by the last acquire, and the name of the file it recycled: the commit
        # works from it instead of listing again after the copy, when the CPU caches are cold. None
        # when something was removed since (it is listed again then).
        self._listing: tuple[list[tuple[int, Path]], list[Path]] | None = None
        self._claimed: Path | None = None

    # -- a save's segment ------------------------------------------------------------------------
    def acquire(self, final: Path, size: int) -> Acquired:
        """A segment of exactly ``size`` bytes under a temp name for ``final``, locked (``LOCK_EX``),
        mapped and pre-faulted: a recycled one when possible, else a new one."""
        self.forget_removed()
        segment, self._claimed = None, None
        for path in self._candidates(final, size):
            segment = self._claim(path, final)
            if segment is not None:
                self._claimed = path
                break
        if segment is None:
            segment = self._create(layout.temp_path(final), lock=True)
        try:
            fresh, seconds = self._fit(segment, size)
        except BaseException:
            self.abort(segment)
            raise
        return Acquired(segment, fresh, seconds)

    def commit(self, segment: Segment, final: Path) -> int:
        """Publish the written segment as ``final`` (the rename is the commit), then retire the surplus;
        returns the number of segments the folder holds now (checkpoints and spares)."""
        try:
            os.replace(segment.path, final)
        except BaseException:
            self.abort(segment)
            raise
        segment.path = final
        fcntl.flock(segment.fd, fcntl.LOCK_UN)
        steps, spares = self._listing if self._listing is not None else self._scan()
        gone = {self._claimed, final}
        steps = sorted(
            [(s, p) for s, p in steps if p not in gone] + [(layout.step_of(final.name) or 0, final)]
        )
        steps.reverse()
        spares = [p for p in spares if p not in gone]
        self._listing = self._claimed = None
        surplus = self._surplus(final, steps)
        for path in surplus:
            if not spares:
                # Kept as the spare: most likely a reader holds it (else it would have been recycled).
                spares = [self.directory / f"{SPARE_PREFIX}{secrets.token_hex(6)}"]
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, spares[0])
            else:
                self._remove(path)
        return len(steps) - len(surplus) + len(spares)

    def abort(self, segment: Segment) -> None:
        """Give up a save: its temp file goes (its old content is lost anyway), and so does the mapping."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)
        self._forget(segment.key)

    def ensure_double_buffer(self, size: int, held: int) -> Acquired | None:
        """After a save: make sure the folder holds ``keep`` segments (it holds ``held``), creating a
        spare of ``size`` (pre-faulted) when it holds fewer, so that the next save recycles instead of
        allocating. Skipped, with a log line, when the folder has no room for it."""
        if held >= self.keep:
            return None
        segment = self._create(self.directory / f"{SPARE_PREFIX}{secrets.token_hex(6)}", lock=False)
        try:
            fresh, seconds = self._fit(segment, size, make_room=False)
        except NoSpaceError:
            self.abort(segment)
            log.info("no room for a second shared-memory segment: the next save allocates its own")
            return None
        except BaseException:
            self.abort(segment)
            raise
        return Acquired(segment, fresh, seconds)

    def close(self) -> None:
        """Unmap and close every segment (the files stay)."""
        for key in list(self._mapped):
            self._forget(key)

    # -- internals -------------------------------------------------------------------------------
    def _scan(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """One listing of the folder: its checkpoints ``(step, path)`` newest first, and its spares."""
        steps, spares = [], []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if entry.name.startswith(SPARE_PREFIX):
                        spares.append(Path(entry.path))
                    elif (step := layout.step_of(entry.name)) is not None and entry.is_file(
                        follow_symlinks=False
                    ):
                        steps.append((step, Path(entry.path)))
        except FileNotFoundError:
            pass
        steps.sort(reverse=True)
        return steps, sorted(spares)

    def _surplus(self, final: Path, steps: list[tuple[int, Path]]) -> list[Path]:
        """The checkpoints that ``layout.prune(directory, final, keep)`` would remove after this save:
        every step after ``final``'s (a rolled-back run's) and all but the newest ``keep - 1`` before it."""
        current = layout.step_of(final.name)
        newer: list[Path] = []
        older: list[Path] = []
        for step, path in steps:
            if path != final:
                (newer if current is not None and step > current else older).append(path)
        return newer + older[self.keep - 1 :]

    def _candidates(self, final: Path, size: int) -> list[Path]:
        """Files this save may overwrite, the cheapest first: mapped at the right size, then big enough."""
        steps, spares = self._listing = self._scan()
        paths = self._surplus(final, steps) + [p for _, p in steps if p == final] + spares

        def cost(path: Path) -> int:
            try:
                info = path.stat()
            except FileNotFoundError:
                return 3
            mapped = self._mapped.get(_key(info))
            if mapped is not None and mapped.mm is not None and len(mapped.mm) == size:
                return 0
            return 1 if info.st_blocks * 512 >= size else 2

        return sorted(paths, key=cost)

    def _claim(self, path: Path, final: Path) -> Segment | None:
        """Lock ``path`` and rename it to a temp name for ``final``; None when a reader holds it or it
        went away."""
        try:
            info = path.stat()
        except FileNotFoundError:
            return None
        segment = self._mapped.get(_key(info))
        opened = segment is None
        if segment is None:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                return None
            segment = Segment(path, fd, _key(os.fstat(fd)))
        if not _try_lock(segment.fd):
            if opened:
                os.close(segment.fd)
            return None
        try:
            # Locked: no reader can start on it now; the name must still be this file's (lock, then check).
            if _key(path.stat()) != segment.key:
                raise FileNotFoundError(path)
            tmp = layout.temp_path(final)
            # A temp file's writer is judged alive by its pid and the file's mtime (ckpt_layout.writer_dead):
            # the recycled file's mtime is older than this process, so renew it before the rename.
            os.utime(segment.fd)
            os.rename(path, tmp)
        except FileNotFoundError:
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
            if opened:
                os.close(segment.fd)
            return None
        segment.path = tmp
        self._mapped[segment.key] = segment
        return segment

    def _create(self, path: Path, *, lock: bool) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        segment = Segment(path, fd, _key(os.fstat(fd)))
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)  # new and unnamed elsewhere: never contended
        self._mapped[segment.key] = segment
        return segment

    def _fit(self, segment: Segment, size: int, *, make_room: bool = True) -> tuple[int, float]:
        """Size, map and pre-fault ``segment`` for ``size`` bytes; (bytes newly allocated, seconds).

        ``make_room``: free space by dropping older memory copies when short (a save); else only
        check it (a spare is never worth a checkpoint)."""
        info = os.fstat(segment.fd)
        if segment.mm is not None and len(segment.mm) == size and info.st_size == size:
            return 0, 0.0  # the steady state: mapped and faulted in by an earlier save
        fresh = max(0, size - info.st_blocks * 512)
        if fresh and make_room:
            self._make_room(fresh + HEADROOM_BYTES)
        elif fresh and (free := self.free_bytes(self.directory)) < fresh + HEADROOM_BYTES:
            raise NoSpaceError(fresh + HEADROOM_BYTES, free)
        started = time.perf_counter()
        if segment.mm is not None:
            segment.mm.close()
            segment.mm = None
        os.ftruncate(segment.fd, size)
        segment.mm = mmap.mmap(segment.fd, size)
        try:
            _populate(segment, size)
        except NoSpaceError as exc:
            raise NoSpaceError(fresh + HEADROOM_BYTES, self.free_bytes(self.directory)) from exc
        return fresh, time.perf_counter() - started

    def _make_room(self, need: int) -> None:
        """Free space for ``need`` bytes: the spares, then every checkpoint but the newest (what a crash
        during this save falls back to); NoSpaceError if that is not enough."""
        if self.free_bytes(self.directory) >= need:
            return
        steps, spares = self._scan()
        self._listing = None  # stale from here on
        for path in spares + [path for _, path in steps[1:]]:
            self._remove(path)
        free = self.free_bytes(self.directory)
        if free < need:
            raise NoSpaceError(need, free)

    def _remove(self, path: Path) -> None:
        """Unlink ``path`` and unmap it, so that its pages go back (unless a reader still has it open)."""
        try:
            key = _key(path.stat())
            path.unlink()
        except FileNotFoundError:
            return
        self._forget(key)

    def forget_removed(self) -> None:
        """Unmap segments that someone else removed (a restore's rollback, the agent at its stop)."""
        for key, segment in list(self._mapped.items()):
            if os.fstat(segment.fd).st_nlink == 0:
                self._forget(key)

    def _forget(self, key: Key) -> None:
        segment = self._mapped.pop(key, None)
        if segment is None:
            return
        if segment.mm is not None:
            try:
                segment.mm.close()
            except BufferError:  # a tensor still views it: the mapping goes when that tensor does
                log.debug("segment %s still in use; unmapped later", segment.path)
        os.close(segment.fd)
