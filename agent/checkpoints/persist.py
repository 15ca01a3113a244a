"""One persist of a checkpoint from the node's shared memory to disk, as the keeper's thread runs it.

A replicated checkpoint file is first checked against the digest its save recorded (:func:`verify`: a
damaged one is never persisted, the keeper reports it), then written to a temp file next to its final
name (flushed as it goes, see :func:`copy`) in torch's own file format (:func:`torch_source`: the
worker's flash file is converted on the way, so that ``torch.load(path, weights_only=True)`` reads it
without this project), then committed fenced by the job's incarnation and the worker's round
(:mod:`agent.checkpoints.fence`: rename, fsync the folder, move ``latest`` never backwards within a
submission, prune only older files). A node's sharded save is persisted by
:mod:`agent.checkpoints.sharded_persist` (the node completing a step commits it). A checkpoint the worker
replaced in memory before its persist began is skipped: a newer one exists and its report follows.

Room on disk: when the folder's free space is less than the checkpoint's size, or the copy fails with a
full disk (``ENOSPC``, ``EDQUOT``), the checkpoints older than the newest complete one (the one ``latest``
names) are pruned (:func:`make_room`, logged) and the copy is tried once more; ``keep`` is a wish, the
newest complete checkpoint a must. A persist that is not published (superseded) or fails is logged as a
warning here and counted and reported by the keeper.

Test hook (the only one): ``ELASTIC_PERSIST_DELAY_S`` (:func:`parse_persist_delay`, ``D`` or ``D@S``)
pauses every persist of a step >= ``S`` for ``D`` seconds right after the first chunk of the temp file
is written, i.e. in the middle of the copy.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from agent.checkpoints import fence as ckpt_fence
from agent.checkpoints import sharded_persist
from elastic.checkpoint import digest, layout, shard_layout, torch_format

log = logging.getLogger(__name__)

PERSIST_DELAY_ENV = "ELASTIC_PERSIST_DELAY_S"
_COPY_CHUNK = 8 << 20
_SYNC_EVERY = 256 << 20
#: The errors of a full disk (or quota), after which room is made and the copy tried once more.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})

#: ``copy(src, dst)``: the copy of one file's bytes, as the keeper runs it (progress, test pause).
Copy = Callable[[BinaryIO, BinaryIO], None]


def parse_persist_delay(text: str | None) -> tuple[float, int]:
    """``"D"`` or ``"D@S"`` → ``(D seconds, from step S)``; empty → no delay."""
    if not text:
        return 0.0, 0
    seconds, _, step = text.partition("@")
    try:
        delay, first = float(seconds), int(step or 0)
    except ValueError:
        raise ValueError(f"{PERSIST_DELAY_ENV} must be SECONDS or SECONDS@STEP, got {text!r}") from None
    if delay < 0:
        raise ValueError(f"{PERSIST_DELAY_ENV} must not be negative, got {text!r}")
    return delay, first


@dataclass(frozen=True)
class Request:
    """A checkpoint to persist: its step, file in memory (a sharded save: the node's data folder, and
    ``save_id``), target folder, the worker's round and the job's incarnation (the fence's order)."""

    step: int
    source: Path
    target: Path
    round: int | None
    save_id: str = (
        ""  # a sharded save's (agent.checkpoints.sharded_persist); "" for a replicated checkpoint file
    )
    incarnation: str = ""  # the job submission's (Assignment.job_incarnation); "" from an older master

    @property
    def kind(self) -> str:
        return "sharded" if self.save_id else "file"


def sharded_request(
    step: int, link: Path, target: Path, round_number: int | None, incarnation: str = ""
) -> Request | None:
    """The request for a node's sharded save of ``step``, reported by its ``step_<N>`` ``link`` in memory,
    to persist to ``<target>/sharded``; None when a newer save replaced it meanwhile."""
    try:
        match = shard_layout.DATA_DIR.match(os.readlink(link))
    except OSError:
        match = None
    if match is None or int(match.group(1)) != step:
        log.info("sharded checkpoint of step %d was replaced in memory before its persist; skipped", step)
        return None
    source = link.parent / match.group(0)
    return Request(
        step, source, target / shard_layout.SHARDED_SUBDIR, round_number, match.group(2), incarnation
    )


def newest_in(folder: Path, last: Request) -> Request | None:
    """The newest checkpoint of ``last``'s kind in the memory ``folder``, to persist where ``last`` went."""
    if last.kind == "sharded":
        saves = shard_layout.committed(folder / shard_layout.SHARDED_SUBDIR)[:1]
        newest = [Request(s, data, last.target, last.round, sid, last.incarnation) for s, sid, data in saves]
    else:
        files = layout.checkpoint_files(folder)[:1]
        newest = [Request(s, path, last.target, last.round, "", last.incarnation) for s, path in files]
    return newest[0] if newest else None


@dataclass(frozen=True)
class Outcome:
    """What a persist did. Neither published nor superseded: skipped (replaced in memory) or given up."""

    published: bool = False  # the files are in the target folder
    committed: bool = False  # and the step is complete there: the keeper's persisted step moves
    superseded: bool = False  # not published: a newer round or submission committed to the folder
    why: str = ""  # why it was superseded (the fence's decision), for the keeper's report
    moved_on: bool = False  # superseded by a newer round of the same submission (the fence's ``moved_on``)


def copy(
    src: BinaryIO, dst: BinaryIO, on_progress: Callable[[], None], pause: Callable[[], object] | None = None
) -> None:
    """Copy ``src`` to ``dst`` in chunks, calling ``on_progress`` after each and ``pause`` (the test
    hook) after the first."""
    first = True
    unsynced = 0
    while chunk := src.read(_COPY_CHUNK):
        dst.write(chunk)
        unsynced += len(chunk)
        if unsynced >= _SYNC_EVERY:
            # Flush as we go: the final fsync then stays short, so that a long silence means a hung
            # disk (the keeper's stall_s), not a large checkpoint's last flush.
            dst.flush()
            os.fdatasync(dst.fileno())
            unsynced = 0
        on_progress()
        if first and pause is not None:
            dst.flush()  # the torn temp file is visible on disk during the pause
            pause()
        first = False


def persist(
    request: Request, *, keep: int, copy: Copy, lock_timeout_s: float, cancel: threading.Event
) -> Outcome:
    """Persist ``request`` (see the module doc), keeping the newest ``keep`` in its target folder.

    ``cancel``: set when the keeper's stop gives this persist up; it ends a wait for the fence lock, and
    nothing is published after it is set.

    Raises:
        OSError: the copy or the commit failed (disk full, EIO, the fence lock held too long...).
        CheckpointCorruptError: the checkpoint's bytes in memory do not match their digest (nothing was
            written).
    """
    if request.save_id:
        return _persist_sharded(request, keep, copy, lock_timeout_s, cancel)
    started = time.monotonic()
    try:
        # Open first: the worker may prune or recycle the file any time; an open file under the
        # shared lock stays readable and unchanged.
        src = layout.open_shared(request.source)
    except FileNotFoundError:
        log.info("checkpoint of step %d was replaced in memory before its persist; skipped", request.step)
        return Outcome()
    with src:
        verify(src, request)  # damaged bytes are never persisted (CheckpointCorruptError)
        request.target.mkdir(parents=True, exist_ok=True)
        final = request.target / request.source.name
        size = os.fstat(src.fileno()).st_size
        if free_bytes(request.target) < size:
            make_room(request.target, f"{size} bytes needed for step {request.step}")
        source = torch_source(src, request.step)
        try:
            tmp = layout.write_temp(final, lambda dst: copy(source(), dst))
        except OSError as exc:
            if exc.errno not in DISK_FULL or not make_room(request.target, str(exc)):
                raise
            # Once more; a second failure raises.
            tmp = layout.write_temp(final, lambda dst: copy(source(), dst))
    if cancel.is_set():  # the stop gave this persist up: publish nothing behind its back
        tmp.unlink(missing_ok=True)
        return Outcome()
    decision = ckpt_fence.commit(
        request.target,
        tmp,
        final,
        round_=request.round,
        step=request.step,
        keep=keep,
        incarnation=request.incarnation,
        lock_timeout_s=lock_timeout_s,
        cancel=cancel,
    )
    if not decision.publish:
        log.warning("the checkpoint of step %d was not persisted: %s", request.step, decision.why)
        return Outcome(superseded=True, why=decision.why, moved_on=decision.moved_on)
    log.debug(
        "persisted the checkpoint of step %d to %s in %.2fs (%s)",
        request.step,
        final,
        time.monotonic() - started,
        decision.why,
    )
    return Outcome(published=True, committed=True)


def verify(src: BinaryIO, request: Request) -> None:
    """Check the flash file open as ``src`` against the digest its save recorded (one more read of its
    bytes in memory, at xxh3's speed); a file without one (version 1, a ``torch.save`` file) passes, and
    a torn frame is left to :func:`torch_source` (it is copied as it is, with a warning).

    Raises:
        CheckpointCorruptError: the bytes differ from the digest; the message names the file.
    """
    try:
        digest.verify_file(src, str(request.source))
    except digest.CheckpointCorruptError:
        log.error("the checkpoint of step %d in memory failed its digest check: not persisted", request.step)
        raise
    except ValueError:
        pass


def torch_source(src: BinaryIO, step: int) -> Callable[[], BinaryIO]:
    """What to write for the checkpoint file open as ``src``: a call returns a fresh reader of it, from
    the start. A flash file (the worker's raw format) becomes a ``torch.save`` file
    (:mod:`elastic.checkpoint.torch_format`), so that plain ``torch.load(path, weights_only=True)`` reads
    it without this project; any other file (the worker's ``torch.save`` fallback, a step restored from
    disk and kept in memory) is torch's format already and is copied as it is. A flash file that cannot
    be converted (damaged, or written by a newer version) is copied as it is, with a warning:
    ``elastic.load`` still reads it."""

    def verbatim() -> BinaryIO:
        src.seek(0)
        return src

    head = verbatim().read(len(torch_format.FLASH_MAGIC))
    if not torch_format.is_flash(head):
        return verbatim
    try:
        frame = torch_format.read_frame(src)
        data_pkl = torch_format.pickle_of(frame)  # what torch's format cannot hold shows before any write
    except torch_format.NotConvertible as exc:
        log.warning(
            "the checkpoint of step %d is persisted in elastic's flash format, which needs elastic.load "
            "to read (%s)",
            step,
            exc,
        )
        return verbatim
    # A cast: the copy only reads its source, and the Reader is a read-only file object.
    return lambda: cast(BinaryIO, torch_format.Reader(torch_format.torch_file(src, frame, data_pkl)))


def _persist_sharded(
    request: Request, keep: int, copy: Copy, lock_timeout_s: float, cancel: threading.Event
) -> Outcome:
    started = time.monotonic()

    def attempt() -> sharded_persist.Outcome:
        return sharded_persist.persist(
            request.source,
            request.target,
            step=request.step,
            save_id=request.save_id,
            round_=request.round,
            keep=keep,
            copy=copy,
            incarnation=request.incarnation,
            lock_timeout_s=lock_timeout_s,
            cancel=cancel,
        )

    try:
        try:
            outcome = attempt()
        except OSError as exc:
            if exc.errno not in DISK_FULL or not make_room_sharded(request.target, request.step, str(exc)):
                raise
            outcome = attempt()  # once more; a second failure raises
    except FileNotFoundError:
        log.info(
            "sharded checkpoint of step %d was replaced in memory before its persist; skipped",
            request.step,
        )
        return Outcome()
    if not outcome.published:
        if cancel.is_set():
            return Outcome()
        log.warning("the sharded checkpoint of step %d was not persisted: %s", request.step, outcome.why)
        return Outcome(superseded=True, why=outcome.why)
    log.debug(
        "persisted this node's part of the sharded checkpoint of step %d to %s in %.2fs%s",
        request.step,
        request.target,
        time.monotonic() - started,
        " (the step is complete there)" if outcome.committed else "",
    )
    return Outcome(published=True, committed=outcome.committed)


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still write in ``folder``'s file system (unknown: unbounded)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return 1 << 62
    return stat.f_bavail * stat.f_frsize


def make_room(folder: Path, why: str) -> int:
    """Remove the replicated checkpoints of ``folder`` older than the newest complete one (the one
    ``latest`` names; none without it), and dead writers' temp files; returns the bytes freed (logged)."""
    marked = layout.read_marker(folder)
    newest = layout.step_of(marked.name) if marked is not None and marked.exists() else None
    freed = layout.remove_temp_files(folder)
    if newest is not None:
        for step, path in layout.checkpoint_files(folder):
            if step < newest:
                freed += _size(path)
                path.unlink(missing_ok=True)
    if freed:
        log.warning(
            "%s is short of space (%s): removed checkpoints older than step %s to make room (%d bytes)",
            folder,
            why,
            newest,
            freed,
        )
    return freed


def make_room_sharded(root: Path, step: int, why: str) -> int:
    """The same for the sharded steps of ``root`` (``<ckpt_dir>/sharded``): of the steps before ``step``,
    only the newest complete one stays; returns the bytes freed (logged)."""
    before = _tree_size(root)
    sharded_persist.prune(root, step, keep=1)  # dead writers' temp files go too
    freed = max(0, before - _tree_size(root))
    if freed:
        log.warning(
            "%s is short of space (%s): removed sharded steps older than the newest complete one (%d bytes)",
            root,
            why,
            freed,
        )
    return freed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tree_size(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        total += sum(_size(Path(folder) / name) for name in files)
    return total


def check_folder(folder: Path) -> str:
    """Why ``folder`` (``--ckpt-dir``) cannot hold checkpoints, in one line; "" when it can: it exists or
    can be created, and a probe file can be created and removed there (checked at the agent's start)."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder}: {exc.strerror or exc}"
    probe = folder / f".elastic-probe.{layout.host_tag()}.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        return f"cannot write to {folder}: {exc.strerror or exc}"
    return ""
