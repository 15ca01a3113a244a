"""Fenced commits of persisted checkpoints into a folder that several agents may share (``--ckpt-dir``).

When rank 0 moves to another node, the old node's slow persist can finish after the new node's; and the
same folder is used again by a resubmitted job, whose rounds start at 1 again. A commit therefore runs
under an exclusive ``flock`` of the folder's ``.fence`` file, whose content names the newest writer that
committed there, ``{"round": R, "incarnation": I}``, and follows :func:`decide`:

* the **job incarnation** (``Assignment.job_incarnation``: chosen by the job's master when the job is
  created, kept across master failovers, a new one for each submission; a fixed-width hex wall-clock
  time, then a random part, so that later submissions compare greater) orders submissions: a checkpoint
  of an older incarnation than the fence's is not published (a writer of a finished or abandoned
  submission); one of a newer incarnation is published whatever the round numbers, moves ``latest``
  (even to an older step: the new submission's state is the job's now) and records its incarnation and
  round in the fence;
* within one incarnation (or where either side has none: written by an older master or agent), rounds
  order writers: a checkpoint of an older round than the fence's is not published (its run was abandoned
  by a restart; the newer round's files are never replaced by it);
* ``latest`` never moves to an older step than the one it names (but for a new incarnation, above);
* only checkpoints older than the committed one are pruned (a newer file is another writer's);
* only temp files whose writer is provably dead are removed (:func:`elastic.checkpoint.layout.writer_dead`).

A persist that is not published is an error for the keeper (logged, counted, reported to the master): a
deposed writer, or a submission running next to a newer one on the same folder. The incarnation's order
is the masters' wall clocks: two submissions started within the clock skew of their masters' hosts may be
misordered (the later one is then refused, loudly).

The lock is waited for at most ``lock_timeout_s``, polling so that a stopping keeper can cancel the wait.
A commit holds it for milliseconds; one held for ``break_after_s`` (default 10 s) belongs to a writer that
is frozen (its node SIGSTOPped or cut off: the master declares it dead, but the kernel keeps its lock) or
hung on dead storage, and would otherwise keep every other node of the job from persisting. The waiter then
breaks it: it replaces the fence file by a copy (a new inode: ``flock`` belongs to the inode) and locks the
copy. A writer whose fence file was replaced while it held the lock has lost it: just before it publishes
it checks that the file it locked is still the folder's fence (:func:`still_holds`), and gives its commit
up if not (not published, an error for its keeper) instead of moving ``latest`` on stale knowledge.
Where the file system has no ``flock`` the commit goes on
unlocked (warned once): the decisions still hold, only two commits at the same instant may race.
Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elastic import errors
from elastic.checkpoint import layout

log = logging.getLogger(__name__)

FENCE_FILE = ".fence"
DEFAULT_LOCK_TIMEOUT_S = 60.0
#: A fence lock held this long is broken (module doc): far longer than any commit takes.
DEFAULT_BREAK_AFTER_S = 10.0
_POLL_S = 0.05
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_warned_no_flock = False


class FenceLockTimeoutError(errors.CheckpointError, TimeoutError):
    """Another writer held the folder's fence lock for longer than the wait allowed (or it was cancelled)."""


class FenceLostError(errors.CheckpointError):
    """This writer's fence lock was broken while it held it (it was frozen or hung): it must not publish."""


@dataclass(frozen=True)
class Decision:
    """What a commit does with a finished temp file, and why (for the log)."""

    publish: bool  # rename the temp file to its final name (else remove it)
    move_latest: bool  # point ``latest`` at it
    why: str
    #: Not published because a newer round of the same submission committed: the job went on without it.
    moved_on: bool = False


@dataclass(frozen=True)
class Fence:
    """What a folder's ``.fence`` file names: the newest writer that committed there."""

    round: int | None = None  # None: no round recorded (an empty or torn file)
    incarnation: str = ""  # "": none recorded (no commit yet, or one of an older agent or master)


def decide(
    round_: int | None,
    step: int,
    fenced_round: int | None,
    latest_step: int | None,
    incarnation: str = "",
    fenced_incarnation: str = "",
) -> Decision:
    """The commit of checkpoint ``step`` of round ``round_`` (None: unknown, an old worker) of job
    incarnation ``incarnation`` ("": unknown, an old master) into a folder whose fence names
    ``fenced_round`` and ``fenced_incarnation`` and whose ``latest`` names ``latest_step`` (None: none).
    See the module doc."""
    if incarnation and incarnation != fenced_incarnation:
        if fenced_incarnation and incarnation < fenced_incarnation:
            return Decision(
                False,
                False,
                f"job incarnation {incarnation} was superseded by a newer submission of the job "
                f"(incarnation {fenced_incarnation}) writing to the same folder",
            )
        return Decision(True, True, "the first checkpoint of a new submission of the job")
    if round_ is not None and fenced_round is not None and round_ < fenced_round:
        return Decision(False, False, f"round {round_} was superseded by round {fenced_round}", moved_on=True)
    if latest_step is not None and step < latest_step:
        return Decision(True, False, f"latest names the newer step {latest_step}")
    return Decision(True, True, "newest")


@contextlib.contextmanager
def fence_lock(
    directory: Path, timeout_s: float, cancel: threading.Event, break_after_s: float = DEFAULT_BREAK_AFTER_S
) -> Iterator[int]:
    """Hold the folder's fence lock; yields the fence file's descriptor (read and written in place: the
    lock belongs to the inode, so the file is never replaced but by a breaker, module doc)."""
    global _warned_no_flock
    path = directory / FENCE_FILE
    fd = _open(path)
    try:
        deadline = time.monotonic() + timeout_s
        break_at = time.monotonic() + break_after_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if still_holds(fd, directory):
                    break
                fd = _reopen(fd, path)  # a breaker replaced the file while this one waited: lock the new one
                continue
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                if not _warned_no_flock:
                    _warned_no_flock = True
                    log.warning(
                        "%s has no flock (%s): checkpoint commits there are not locked", directory, exc
                    )
                break
            if cancel.is_set() or time.monotonic() >= deadline:
                raise FenceLockTimeoutError(
                    f"another writer holds the lock of {path}"
                    + (" (gave up: stopping)" if cancel.is_set() else f" for more than {timeout_s:g}s")
                )
            if time.monotonic() >= break_at:
                fd = _break(fd, path, break_after_s)
                break_at = time.monotonic() + break_after_s
                continue
            cancel.wait(_POLL_S)  # flock has no timeout; poll, so that a stop can end the wait
        yield fd
    finally:
        os.close(fd)  # releases the lock


def still_holds(fd: int, directory: Path) -> bool:
    """Whether the fence file ``fd`` is open on is still the folder's (no breaker replaced it)."""
    try:
        return os.fstat(fd).st_ino == os.stat(directory / FENCE_FILE).st_ino
    except FileNotFoundError:
        return False


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)


def _reopen(fd: int, path: Path) -> int:
    os.close(fd)
    return _open(path)


def _break(fd: int, path: Path, held_s: float) -> int:
    """Replace the fence file that ``fd`` is open on (its lock held for ``held_s`` by a frozen writer) by a
    copy, unless another waiter did already; returns a descriptor of the folder's fence file now."""
    if still_holds(fd, path.parent):
        tmp = path.with_name(f"{FENCE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        content = os.pread(fd, 4096, 0)
        new = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            os.write(new, content)
            os.fsync(new)
        finally:
            os.close(new)
        os.replace(tmp, path)
        layout.fsync_dir(path.parent)
        log.warning(
            "the checkpoint fence lock of %s was held for over %gs (its writer is frozen or its storage "
            "hangs): broke it",
            path.parent,
            held_s,
        )
    return _reopen(fd, path)


def check_still_holds(fd: int, directory: Path) -> None:
    """Raise :class:`FenceLostError` when this writer's fence lock was broken (it was frozen meanwhile)."""
    if not still_holds(fd, directory):
        raise FenceLostError(
            f"the fence lock of {directory} was broken while this writer held it (it was frozen or its "
            "storage hung): not published, the folder moved on without it"
        )


def read_fence(fd: int) -> Fence:
    """What the fence file names (nothing when empty, or unreadable: e.g. torn by a crash mid-write)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return Fence()
    if not isinstance(data, dict):
        return Fence()
    try:
        round_ = int(data["round"])
    except (ValueError, KeyError, TypeError):
        round_ = None
    incarnation = data.get("incarnation", "")
    return Fence(round_, incarnation if isinstance(incarnation, str) else "")


def advanced(fence: Fence, round_: int | None, incarnation: str) -> Fence | None:
    """The fence after a published commit of round ``round_`` of ``incarnation``, or None when it stays:
    a new incarnation replaces the fence (its rounds start again), a newer round of the same one moves it."""
    if incarnation and incarnation != fence.incarnation:
        return Fence(round_, incarnation)
    if round_ is not None and (fence.round is None or round_ > fence.round):
        return Fence(round_, fence.incarnation)
    return None


def write_fence(fd: int, fence: Fence) -> None:
    """Replace the fence file's content (in place: the lock belongs to the inode) and make it durable."""
    record: dict[str, object] = {"round": fence.round}
    if fence.incarnation:
        record["incarnation"] = fence.incarnation
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)


def commit(
    directory: Path,
    tmp: Path,
    final: Path,
    *,
    round_: int | None,
    step: int,
    keep: int,
    incarnation: str = "",
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> Decision:
    """Publish the durable temp file ``tmp`` as ``final`` (checkpoint ``step`` of ``round_`` of job
    ``incarnation``) under the fence; the temp file is gone afterwards in every case."""
    try:
        with fence_lock(directory, lock_timeout_s, cancel or threading.Event()) as fd:
            if cancel is not None and cancel.is_set():
                raise FenceLockTimeoutError("the keeper gave this persist up (stopping)")
            fenced = read_fence(fd)
            marked = layout.read_marker(directory)
            latest = layout.step_of(marked.name) if marked else None
            decision = decide(round_, step, fenced.round, latest, incarnation, fenced.incarnation)
            if not decision.publish:
                return decision
            check_still_holds(fd, directory)
            os.replace(tmp, final)
            layout.fsync_dir(directory)
            if decision.move_latest:
                layout.write_marker(directory, final)
            new_fence = advanced(fenced, round_, incarnation)
            if new_fence is not None:
                write_fence(fd, new_fence)
            layout.prune(directory, final, keep, drop_newer=False)
            layout.remove_temp_files(directory)
            return decision
    finally:
        tmp.unlink(missing_ok=True)  # not published (or already renamed: then a no-op)
