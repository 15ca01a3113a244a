"""Fenced commits of persisted checkpoints into a folder that several agents may share (``--ckpt-dir``).

When rank 0 moves to another node, the old node's slow persist can finish after the new node's. A
commit therefore runs under an exclusive ``flock`` of the folder's ``.fence`` file, whose content is the
newest round that committed there (``{"round": R}``), and follows :func:`decide`:

* a checkpoint of an older round than the fence's is not published (its run was abandoned by a restart;
  the newer round's files are never replaced by it);
* ``latest`` never moves to an older step than the one it names;
* only checkpoints older than the committed one are pruned (a newer file is another writer's);
* only temp files whose writer is provably dead are removed (:func:`elastic.checkpoint.layout.writer_dead`).

The lock is waited for at most ``lock_timeout_s`` (a writer hung on a dead NFS server holds it), polling
so that a stopping keeper can cancel the wait. Where the file system has no ``flock`` the commit goes on
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
_POLL_S = 0.05
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_warned_no_flock = False


class FenceLockTimeoutError(errors.CheckpointError, TimeoutError):
    """Another writer held the folder's fence lock for longer than the wait allowed (or it was cancelled)."""


@dataclass(frozen=True)
class Decision:
    """What a commit does with a finished temp file, and why (for the log)."""

    publish: bool  # rename the temp file to its final name (else remove it)
    move_latest: bool  # point ``latest`` at it
    why: str


def decide(round_: int | None, step: int, fenced_round: int | None, latest_step: int | None) -> Decision:
    """The commit of checkpoint ``step`` of round ``round_`` (None: unknown, an old worker) into a folder
    whose fence names ``fenced_round`` and whose ``latest`` names ``latest_step`` (None: none)."""
    if round_ is not None and fenced_round is not None and round_ < fenced_round:
        return Decision(False, False, f"round {round_} was superseded by round {fenced_round}")
    if latest_step is not None and step < latest_step:
        return Decision(True, False, f"latest names the newer step {latest_step}")
    return Decision(True, True, "newest")


@contextlib.contextmanager
def fence_lock(directory: Path, timeout_s: float, cancel: threading.Event) -> Iterator[int]:
    """Hold the folder's fence lock; yields the fence file's descriptor (read and written in place: the
    lock belongs to the inode, so the file is never replaced)."""
    global _warned_no_flock
    fd = os.open(directory / FENCE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
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
                    f"another writer holds the lock of {directory / FENCE_FILE}"
                    + (" (gave up: stopping)" if cancel.is_set() else f" for more than {timeout_s:g}s")
                )
            cancel.wait(_POLL_S)  # flock has no timeout; poll, so that a stop can end the wait
        yield fd
    finally:
        os.close(fd)  # releases the lock


def read_round(fd: int) -> int | None:
    """The round in the fence file, or None (empty, or unreadable: e.g. torn by a crash mid-write)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return int(data["round"]) if isinstance(data, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def write_round(fd: int, round_: int) -> None:
    data = json.dumps({"round": round_}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def commit(
    directory: Path,
    tmp: Path,
    final: Path,
    *,
    round_: int | None,
    step: int,
    keep: int,
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> Decision:
    """Publish the durable temp file ``tmp`` as ``final`` (checkpoint ``step`` of ``round_``) under the
    fence; the temp file is gone afterwards in every case."""
    try:
        with fence_lock(directory, lock_timeout_s, cancel or threading.Event()) as fd:
            if cancel is not None and cancel.is_set():
                raise FenceLockTimeoutError("the keeper gave this persist up (stopping)")
            fenced = read_round(fd)
            marked = layout.read_marker(directory)
            decision = decide(round_, step, fenced, layout.step_of(marked.name) if marked else None)
            if not decision.publish:
                return decision
            os.replace(tmp, final)
            layout.fsync_dir(directory)
            if decision.move_latest:
                layout.write_marker(directory, final)
            if round_ is not None and (fenced is None or round_ > fenced):
                write_round(fd, round_)
            layout.prune(directory, final, keep, drop_newer=False)
            layout.remove_temp_files(directory)
            return decision
    finally:
        tmp.unlink(missing_ok=True)  # not published (or already renamed: then a no-op)
