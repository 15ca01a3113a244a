"""File layout of replicated checkpoints, shared by the worker library and the agent's checkpoint keeper.

Standard library only: the agent persists and prunes checkpoints with these helpers and never imports
torch. The same layout is used on disk (``--ckpt-dir``) and in the agent's shared-memory folder::

    step_0000000010.pt                     {"step": 10, "state": <the dict given to save>}: flash format
                                           (elastic.checkpoint.flash) or torch.save (disk saves)
    step_0000000020.pt
    latest                                 "step_0000000020.pt" (disk only)
    .step_0000000030.pt.<host>.<pid>.<hex>.tmp
                                           a write in progress, or the leftover of a killed one
    .segment.<hex>                         a spare flash-save segment (memory only,
    elastic.checkpoint.segments)

A checkpoint file appears under its final name only by ``rename`` once it is complete, so a reader sees
either a whole checkpoint or none; temp files are never read. A temp name carries its writer's host and
pid, so that a leftover is removed only once its writer is provably dead (same host, process gone, see
:func:`alive_since`): writers on other hosts sharing a folder never lose a write in progress.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO

LATEST_MARKER = "latest"
STEP_FILE = re.compile(r"^step_(\d{10,})\.pt$")
TMP_SUFFIX = ".tmp"
TEMP_FILE = re.compile(r"^\.(?P<final>.+)\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")
_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9-]+")


@dataclass(frozen=True)
class TempName:
    """What a temp file's name says about its write: the final name, the writer's host tag and pid."""

    final: str
    host: str
    pid: int


def host_tag() -> str:
    """This host's name as it appears in temp names (dots and other characters replaced by ``_``)."""
    return _HOST_UNSAFE.sub("_", socket.gethostname())[:63] or "_"


def parse_temp_name(name: str) -> TempName | None:
    """The parts of a temp name made by :func:`temp_path`; None for any other name."""
    match = TEMP_FILE.match(name)
    return TempName(match["final"], match["host"], int(match["pid"])) if match else None


def step_file_name(step: int) -> str:
    return f"step_{step:010d}.pt"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step named by a checkpoint file name, or None for any other name."""
    match = STEP_FILE.match(os.path.basename(path))
    return int(match.group(1)) if match else None


def temp_path(path: Path) -> Path:
    """A fresh temp name next to ``path``: hidden, unique per writer (host and pid) and call."""
    return path.with_name(f".{path.name}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> Path:
    """Write through ``write(fileobj)`` to a fresh temp file next to ``path`` and return its path; the
    caller renames it (the commit) or removes it. ``durable``: fsync the file. Removed on failure."""
    tmp = temp_path(path)
    # os.open rather than tempfile.mkstemp: mkstemp makes files 0600, these follow the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Write through ``write(fileobj)`` to a temp file next to ``path``, then rename it over ``path``.

    ``durable``: fsync the file before the rename and the folder after it (disk); skip both for a
    memory-backed folder, where there is nothing to flush.
    """
    tmp = write_temp(path, write, durable=durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint files in ``directory`` as ``(step, path)``, newest first; [] if it is missing."""
    found = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        step = step_of(entry.name)
        if step is not None and entry.is_file():
            found.append((step, entry))
    found.sort(reverse=True)
    return found


# -- is a temp file's writer alive? ----------------------------------------------------------------
# A temp file names its writer's pid (temp_path). The writer is alive when a process with that pid exists,
# is not a zombie, and started no later than the file's last modification: a pid reused by a younger
# process cannot be the writer. Process start times come from /proc (Linux); elsewhere only the pid's
# existence is checked.

#: Clock slack when comparing a process's start time with a file's modification time: the kernel's boot
#: time is given in whole seconds.
SLACK_S = 1.0


@cache
def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _state_and_start(pid: int) -> tuple[str, float | None] | None:
    """``(state letter, start time in epoch seconds or None)`` from ``/proc/<pid>/stat``; None without it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        return ("X", None)  # gone between the existence check and here
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    boot = _boot_time()
    try:
        state, ticks = fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None
    started = None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    return state, started


def alive_since(pid: int, before: float) -> bool:
    """True when the process ``pid`` is alive (not a zombie) and started no later than ``before`` (epoch
    seconds, e.g. a file's mtime, give or take :data:`SLACK_S`): it may be the one that wrote the file."""
    if pid <= 0:
        return False  # not a process id (0 and negatives address process groups in kill)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    info = _state_and_start(pid)
    if info is None:
        return True  # cannot tell more than that the pid exists
    state, started = info
    if state in ("Z", "X"):
        return False
    return started is None or started <= before + SLACK_S


def writer_dead(name: str, modified: float, *, writers_stopped: bool = False) -> bool:
    """Whether the writer of the temp file ``name`` (last modified at ``modified``) is provably dead:
    of this host, and its process is gone (or its pid now belongs to a younger process). A name that
    says nothing (another host's, or no pid) counts as dead only when the caller knows that every writer
    of the folder has stopped (``writers_stopped``: the agent's workers, for its shared memory)."""
    temp = parse_temp_name(name)
    if temp is None or temp.host != host_tag():
        return writers_stopped
    return not alive_since(temp.pid, modified)


def remove_temp_files(directory: Path, *, writers_stopped: bool = False) -> int:
    """Remove the temp files whose writer is dead (see :func:`writer_dead`); returns the bytes freed.

    Never a write in progress: another process's temp file stays while that process lives."""
    freed = 0
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # renamed (committed) or removed meanwhile
        if stat.S_ISREG(info.st_mode) and writer_dead(
            entry.name, info.st_mtime, writers_stopped=writers_stopped
        ):
            entry.unlink(missing_ok=True)
            freed += info.st_size
    return freed


def prune(directory: Path, current: Path, keep: int, *, drop_newer: bool = True) -> None:
    """Keep ``current`` and the newest ``keep - 1`` older checkpoints.

    ``drop_newer``: checkpoints of steps *after* ``current`` are removed as well: they belong to a run
    that was rolled back (training resumed from an earlier step), and ``current`` is the newest state of
    this run. A folder that other writers share (the agents' ``--ckpt-dir``) passes False: a newer file
    there may be another writer's, and is never this writer's to delete.
    """
    current_step = step_of(current.name)
    older = []
    for step, path in checkpoint_files(directory):
        if path == current:
            continue
        if current_step is not None and step > current_step:
            if drop_newer:
                path.unlink(missing_ok=True)
        else:
            older.append(path)
    for path in older[keep - 1 :]:
        path.unlink(missing_ok=True)


def read_marker(directory: Path) -> Path | None:
    """The checkpoint named by the ``latest`` marker, or None (no marker, or not a name of ours)."""
    try:
        name = (directory / LATEST_MARKER).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    # Only ever a file name of ours: a marker cannot point outside the directory.
    return directory / name if STEP_FILE.match(name) else None


def write_marker(directory: Path, checkpoint: Path) -> None:
    """Point ``latest`` at ``checkpoint`` (atomically and durably; call once the checkpoint is durable)."""
    atomic_write(directory / LATEST_MARKER, lambda f: f.write(checkpoint.name.encode()))


# -- reading a checkpoint that its writer may recycle ------------------------------------------------
def open_shared(path: Path) -> BinaryIO:
    """Open a checkpoint to read it whole, holding a shared ``flock`` so that a flash writer does not
    recycle it meanwhile (see :mod:`elastic.checkpoint.segments`: a writer takes ``LOCK_EX | LOCK_NB`` before
    it renames a file away to overwrite it).

    Raises FileNotFoundError, like a checkpoint pruned before it was opened, when the file is being
    recycled or was recycled between the open and the lock (the name no longer names the open file).
    On a file system without ``flock`` the file is read unlocked: no writer recycles files there.
    """
    f = open(path, "rb")  # noqa: SIM115 - returned open
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileNotFoundError(errno.ENOENT, "being recycled by its writer", str(path)) from None
        except OSError:
            pass  # no flock here (e.g. some network file systems)
        opened, named = os.fstat(f.fileno()), os.stat(path)
        if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):
            raise FileNotFoundError(errno.ENOENT, "checkpoint was recycled by its writer", str(path))
    except BaseException:
        f.close()
        raise
    return f


@contextlib.contextmanager
def map_shared(path: Path) -> Iterator[mmap.mmap | bytes]:
    """A checkpoint file mapped read-only (``MAP_POPULATE``: its page-table entries filled in one call, no
    fault per page), under :func:`open_shared`'s lock for as long as the context lasts: a restore reads
    the bytes where they lie instead of copying them into a fresh ``bytes`` first. An empty file is
    ``b""`` (nothing to map). The map closes at the exit unless a buffer still exports it (then it is
    unmapped once that is freed)."""
    with open_shared(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        try:
            yield mapped
        finally:
            with contextlib.suppress(BufferError):
                mapped.close()


def read_shared(path: Path) -> bytes:
    """The bytes of a checkpoint file, read under :func:`open_shared`'s lock."""
    with open_shared(path) as f:
        return f.read()
