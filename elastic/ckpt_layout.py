"""File layout of replicated checkpoints, shared by the worker library and the agent's checkpoint keeper.

Standard library only: the agent persists and prunes checkpoints with these helpers and never imports
torch. The same layout is used on disk (``--ckpt-dir``) and in the agent's shared-memory folder::

    step_0000000010.pt                     torch.save({"step": 10, "state": <the dict given to save>})
    step_0000000020.pt
    latest                                 "step_0000000020.pt" (disk only)
    .step_0000000030.pt.<pid>.<hex>.tmp    a write in progress, or the leftover of a killed one

A checkpoint file appears under its final name only by ``rename`` once it is complete, so a reader sees
either a whole checkpoint or none; temp files are never read.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

LATEST_MARKER = "latest"
STEP_FILE = re.compile(r"^step_(\d{10,})\.pt$")
TMP_SUFFIX = ".tmp"


def step_file_name(step: int) -> str:
    return f"step_{step:010d}.pt"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step named by a checkpoint file name, or None for any other name."""
    match = STEP_FILE.match(os.path.basename(path))
    return int(match.group(1)) if match else None


def temp_path(path: Path) -> Path:
    """A fresh temp name next to ``path`` (hidden, unique per process and call)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Write through ``write(fileobj)`` to a temp file next to ``path``, then rename it over ``path``.

    ``durable``: fsync the file before the rename and the folder after it (disk); skip both for a
    memory-backed folder, where there is nothing to flush.
    """
    tmp = temp_path(path)
    # os.open rather than tempfile.mkstemp: mkstemp makes files 0600, these follow the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
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


def remove_temp_files(directory: Path) -> None:
    """Remove leftovers of killed writes (one writer per folder is assumed, see the module doc)."""
    for entry in directory.iterdir():
        if entry.name.endswith(TMP_SUFFIX) and entry.name.startswith((".step_", f".{LATEST_MARKER}.")):
            entry.unlink(missing_ok=True)


def prune(directory: Path, current: Path, keep: int) -> None:
    """Keep ``current`` and the newest ``keep - 1`` older checkpoints.

    Checkpoints of steps *after* ``current`` are removed as well: they belong to a run that was rolled
    back (training resumed from an earlier step), and ``current`` is the newest state of this run.
    """
    current_step = step_of(current.name)
    older = []
    for step, path in checkpoint_files(directory):
        if path == current:
            continue
        if current_step is not None and step > current_step:
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
