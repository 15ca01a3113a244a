"""Ownership of a shared-memory checkpoint folder by a lock held for the agent's lifetime.

The owner holds an exclusive ``flock`` on ``<folder>/.lock`` from start to stop. The kernel drops it
when the owner's process ends, however it ends (SIGKILL, a zombie not yet reaped, a process of another
PID namespace whose pid means nothing here), so a free lock proves that the previous owner is gone, and
a held one that it lives. A dying owner releases it only once all its threads are gone (its main
thread may already show as a zombie), so a held lock is waited for :data:`HELD_GRACE_S` before it
counts as a live owner's (the agent is a small process: its teardown takes milliseconds). A new lock file is
created under a temp name, locked, then linked into place: a ``.lock`` that another agent can see is
always already held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from elastic import errors
from elastic.checkpoint import layout

LOCK_FILE = ".lock"
#: How long a held lock is waited for before its holder counts as alive (a dying owner still holds it).
HELD_GRACE_S = 2.0
_POLL_S = 0.05
_ATTEMPTS = 5


class FolderHeldError(errors.CheckpointError):
    """Another live process holds the folder's lock."""


def try_lock(path: Path) -> int | None:
    """A descriptor holding an exclusive lock of the existing file ``path``; None while another process
    holds it. Raises FileNotFoundError when there is no such file."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file of ``fd`` (a stopping owner may have removed it)."""
    try:
        named, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _create_locked(path: Path) -> int | None:
    """Create ``path`` already locked; None when another process created it first."""
    tmp = layout.temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.link(tmp, path)  # unlike rename, never replaces a lock file that appeared meanwhile
        except FileExistsError:
            os.close(fd)
            return None
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return fd


def acquire(folder: Path, grace_s: float = HELD_GRACE_S) -> int:
    """Lock ``folder`` (created, mode 0700, if missing) for this process; returns the descriptor to keep
    open until the folder is released. Raises :class:`FolderHeldError` when another process still holds
    it after ``grace_s``."""
    path = folder / LOCK_FILE
    deadline = time.monotonic() + grace_s
    attempts = 0
    while attempts < _ATTEMPTS:
        folder.mkdir(mode=0o700, exist_ok=True)
        try:
            fd = try_lock(path)
        except FileNotFoundError:
            fd = _create_locked(path)
            if fd is None:
                attempts += 1
                continue  # another agent created it first: try to lock theirs
        if fd is None:
            if time.monotonic() >= deadline:
                raise FolderHeldError(str(folder))
            time.sleep(_POLL_S)  # flock has no timeout; the holder may be dying
            continue
        if _still_named(fd, path):
            return fd
        os.close(fd)  # we locked a lock file that its stopping owner just removed: start over
        attempts += 1
    raise FolderHeldError(str(folder))
