"""The node's shared-memory checkpoint folder: its name, its owner record, taking it and giving it back.

:func:`take` takes ``<root>/elastic-<job>-<node>/`` (mode 0700, ``root`` is ``/dev/shm``) by an exclusive
``flock`` of its ``.lock`` file, held until :func:`release`: a held lock is a live agent of the same job and
node, an error; a free one means its previous owner is gone, however it ended (killed, an unreaped zombie,
another PID namespace), and its leftovers are removed (takeover).
Other ``elastic-*`` folders whose lock is free are removed too (crashed agents with another node id); a
folder without a lock file (an older agent's) is judged by its owner record (host, pid, start time).

The lock: the owner holds an exclusive ``flock`` on ``<folder>/.lock`` from start to stop. The kernel drops it
when the owner's process ends, however it ends (SIGKILL, a zombie not yet reaped, a process of another PID
namespace whose pid means nothing here), so a free lock proves that the previous owner is gone, and a held
one that it lives. A dying owner releases it only once all its threads are gone (its main thread may
already show as a zombie), so a held lock is waited for :data:`HELD_GRACE_S` before it counts as a live
owner's (the agent is a small process: its teardown takes milliseconds). A new lock file is created under a
temp name, locked, then linked into place: a ``.lock`` that another agent can see is always already held.

The checkpoint keeper (:mod:`agent.checkpoints.keeper`) owns the folder while the agent runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from elastic import errors
from elastic.checkpoint import layout

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/dev/shm")
#: Environment variable naming another folder for the agents' checkpoint folders (a tmpfs): jobs that share
#: a host but must not see each other's folders (stale-folder removal included) each get a root of their own.
ROOT_ENV = "ELASTIC_SHM_ROOT"
FOLDER_PREFIX = "elastic-"
OWNER_FILE = ".owner"
LOCK_FILE = ".lock"
#: How long a held lock is waited for before its holder counts as alive (a dying owner still holds it).
HELD_GRACE_S = 2.0
_POLL_S = 0.05
_ATTEMPTS = 5
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class KeeperError(errors.CheckpointError):
    """The shared-memory folder cannot be set up (e.g. another live agent holds it)."""


class RootError(KeeperError):
    """``ELASTIC_SHM_ROOT`` names no folder: a usage error."""


class FolderHeldError(errors.CheckpointError):
    """Another live process holds the folder's lock."""


def root_from(environ: Mapping[str, str]) -> Path:
    """The root of the agents' checkpoint folders: ``$ELASTIC_SHM_ROOT`` where set, else ``/dev/shm``.

    Raises:
        RootError: the variable names something that is not an existing folder.
    """
    value = environ.get(ROOT_ENV, "")
    if not value:
        return DEFAULT_ROOT
    root = Path(value)
    if not root.is_dir():
        raise RootError(f"{ROOT_ENV}={value} is not a folder; create it (on a tmpfs) or unset {ROOT_ENV}")
    return root


def folder_name(job_id: str, node_id: str) -> str:
    """``elastic-<job>-<node>``, with characters outside ``[A-Za-z0-9_.-]`` replaced (the owner record
    keeps the exact ids)."""

    def clean(text: str) -> str:
        return _UNSAFE.sub("_", text)[:100] or "_"

    return f"{FOLDER_PREFIX}{clean(job_id)}-{clean(node_id)}"


def mib(nbytes: int) -> str:
    """``nbytes`` for a log line."""
    return f"{nbytes / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Owner:
    """The owner record of a folder (``.owner``): which agent process took it."""

    job: str
    node: str
    host: str
    pid: int
    started: float  # process create time, so that a reused pid is not taken for the owner

    def alive(self) -> bool:
        """Whether the owner process still runs (True when that cannot be told)."""
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True  # cannot tell: leave it alone

    @classmethod
    def me(cls, job: str, node: str) -> Owner:
        """The record of this process."""
        return cls(job, node, socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def read(cls, folder: Path) -> Owner | None:
        """The record in ``folder``, or None when it is missing or unreadable."""
        try:
            data = json.loads((folder / OWNER_FILE).read_text())
            return cls(
                str(data["job"]),
                str(data["node"]),
                str(data["host"]),
                int(data["pid"]),
                float(data["started"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def take(root: Path, folder: Path, job_id: str, node_id: str) -> int:
    """Remove stale folders under ``root``, then take ``folder`` (see the module doc) and write its owner
    record; returns the lock's file descriptor, for :func:`release`.

    Raises:
        KeeperError: another live agent holds the folder, or it cannot be created or set up.
    """
    remove_stale(root, folder)
    try:
        fd = acquire(folder)
    except FolderHeldError:
        holder = Owner.read(folder)
        who = f"pid {holder.pid} on {holder.host}" if holder else "owner record not written yet"
        raise KeeperError(
            f"another agent ({who}) of job {job_id} node {node_id} holds {folder}; "
            "give each agent its own --node-id"
        ) from None
    except OSError as exc:
        raise KeeperError(f"cannot create {folder}: {exc}") from exc
    try:
        _take_over(folder)
        record = json.dumps(Owner.me(job_id, node_id).__dict__).encode()
        layout.atomic_write(folder / OWNER_FILE, lambda f: f.write(record), durable=False)
    except OSError as exc:
        release(folder, fd)
        raise KeeperError(f"cannot set up {folder}: {exc}") from exc
    return fd


def release(folder: Path, fd: int) -> None:
    """Remove the folder, then release its lock (after the removal: nobody takes it over half-removed)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.close(fd)


def keep_unpersisted(folder: Path, fd: int) -> Path:
    """Keep the folder (its newest checkpoint is not on disk): renamed to ``<root>/elastic-unpersisted-
    <name>-<pid>`` without its lock file and owner record, so that no later agent takes it over or removes
    it as a dead agent's (:func:`remove_stale` leaves a folder with neither alone); returns its new path
    (the folder itself when it cannot be renamed). The user removes it once the checkpoint is copied."""
    kept = folder.with_name(
        f"{FOLDER_PREFIX}unpersisted-{folder.name.removeprefix(FOLDER_PREFIX)}-{os.getpid()}"
    )
    for name in (OWNER_FILE, LOCK_FILE):
        with contextlib.suppress(OSError):
            (folder / name).unlink()
    try:
        folder.rename(kept)
    except OSError as exc:
        log.warning("cannot rename %s to %s (%s): kept under its own name", folder, kept, exc)
        kept = folder
    os.close(fd)
    return kept


def _take_over(folder: Path) -> None:
    """Remove what a dead previous owner left in the folder (all but the lock we now hold)."""
    previous = Owner.read(folder)
    freed = 0
    for entry in folder.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            continue
        try:
            freed += entry.lstat().st_size
        except FileNotFoundError:
            continue
        entry.unlink(missing_ok=True)
    if previous is not None:
        log.info(
            "took over the checkpoint memory of a dead agent (pid %d on %s): %s, %s freed",
            previous.pid,
            previous.host,
            folder,
            mib(freed),
        )


def remove_stale(root: Path, own: Path) -> None:
    """Remove other agents' folders under ``root`` whose owner is gone (``own`` is taken by :func:`take`).

    Raises:
        KeeperError: ``root`` does not exist.
    """
    try:
        entries = [e for e in root.iterdir() if e.name.startswith(FOLDER_PREFIX) and e.is_dir()]
    except FileNotFoundError:
        raise KeeperError(f"the shared-memory root {root} does not exist") from None
    for folder in entries:
        if folder == own:
            continue
        try:
            fd = try_lock(folder / LOCK_FILE)
        except FileNotFoundError:
            if _dead_by_owner_record(folder):  # an older agent's folder, without a lock file
                _discard(folder)
            continue
        except OSError:
            continue  # not ours to judge (e.g. another user's)
        if fd is None:
            continue  # its agent lives
        try:
            _discard(folder)
        finally:
            os.close(fd)


def _dead_by_owner_record(folder: Path) -> bool:
    owner = Owner.read(folder)
    # No record: not a folder of ours, or one still being set up. Another host's (a shared /dev/shm):
    # its pids mean nothing here.
    return owner is not None and owner.host == socket.gethostname() and not owner.alive()


def _discard(folder: Path) -> None:
    """Remove a dead agent's folder: renamed away first, so that a new folder of that name is never hit."""
    log.info("removing the checkpoint memory of a dead agent: %s", folder)
    trash = folder.with_name(f".{folder.name}.{os.getpid()}.removing")
    try:
        folder.rename(trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


# -- the folder's lock ------------------------------------------------------------------------------------
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
