"""Checkpoints for data-parallel training: :func:`save` and :func:`load_latest`.

v0 writes straight to disk. A save is atomic: the state goes to a temporary file that is flushed,
fsynced and renamed to ``step_<step:010d>.pt``; then a ``latest`` marker naming that file is replaced
the same way. A reader therefore sees either the previous checkpoint or the new one, never a torn file.
The directory keeps the newest ``keep`` checkpoints.

Layout of ``ckpt_dir``::

    step_0000000010.pt   {"step": 10, "state": <the dict given to save>}
    step_0000000020.pt
    latest               "step_0000000020.pt"

One writer per directory is assumed (global rank 0 of one job), so a ``*.tmp`` file found there is the
leftover of a save that was killed midway; readers ignore it and the next save removes it.

The API (``save(state, step)`` / ``load_latest() -> (state, step)``) is meant to outlive this
implementation: a later version copies the state to agent-owned shared memory and persists it in the
background, behind the same calls.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

CKPT_DIR_ENV = "ELASTIC_CKPT_DIR"
LATEST_MARKER = "latest"
_STEP_FILE = re.compile(r"^step_(\d{10,})\.pt$")
_TMP_SUFFIX = ".tmp"

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """Checkpoint files exist but none of them can be loaded."""


def _resolve_dir(ckpt_dir: str | os.PathLike[str] | None) -> Path:
    if ckpt_dir is None:
        ckpt_dir = os.environ.get(CKPT_DIR_ENV) or None
    if ckpt_dir is None:
        raise ValueError(
            f"no checkpoint directory: pass ckpt_dir or set the {CKPT_DIR_ENV} environment variable"
        )
    return Path(ckpt_dir)


def _resolve_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    raw = os.environ.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"RANK must be an integer, got {raw!r}") from None


def _step_file_name(step: int) -> str:
    return f"step_{step:010d}.pt"


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through ``write(fileobj)`` to a temp file next to ``path``, fsync it, rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
    # os.open rather than tempfile.mkstemp: mkstemp makes files 0600, these should follow the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _checkpoint_files(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint files in the directory as (step, path), newest first."""
    found = []
    for entry in ckpt_dir.iterdir():
        match = _STEP_FILE.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    found.sort(reverse=True)
    return found


def _prune(ckpt_dir: Path, current: Path, keep: int) -> None:
    """Keep ``current`` and the newest ``keep - 1`` other checkpoints; drop leftover temp files."""
    others = [path for _, path in _checkpoint_files(ckpt_dir) if path != current]
    for path in others[keep - 1 :]:
        path.unlink(missing_ok=True)
    for entry in ckpt_dir.iterdir():
        if entry.name.endswith(_TMP_SUFFIX) and entry.name.startswith((".step_", f".{LATEST_MARKER}.")):
            entry.unlink(missing_ok=True)


def save(
    state: dict[str, Any],
    step: int,
    ckpt_dir: str | os.PathLike[str] | None = None,
    *,
    keep: int = 3,
    rank: int | None = None,
) -> Path | None:
    """Save ``state`` as the checkpoint of ``step``, atomically.

    The state of data-parallel training is the same on every rank, so only global rank 0 writes; the
    other ranks return at once. Call it on every rank all the same: later versions may need them.

    Args:
        state: what to restore later, e.g. ``{"model": m.state_dict(), "optimizer": o.state_dict()}``.
            Keep to tensors, numbers, strings, None and containers of them: :func:`load_latest` loads
            with ``weights_only=True``.
        step: training steps completed; names the file, and the newest step is what is resumed.
        ckpt_dir: directory (created if needed); default the ``ELASTIC_CKPT_DIR`` environment variable.
        keep: how many checkpoints to keep, this one included (>= 1).
        rank: global rank of the caller; default the ``RANK`` environment variable, else 0.

    Returns:
        The path written on rank 0, ``None`` on the other ranks.

    Raises:
        ValueError: no directory configured, or a negative ``step``, or ``keep < 1``.
        TypeError: ``state`` is not a dict.
    """
    directory = _resolve_dir(ckpt_dir)
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if _resolve_rank(rank) != 0:
        return None

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / _step_file_name(step)
    _atomic_write(path, lambda f: torch.save({"step": step, "state": state}, f))
    # The marker moves only after the checkpoint it names is durable.
    _atomic_write(directory / LATEST_MARKER, lambda f: f.write(path.name.encode()))
    _prune(directory, path, keep)
    return path


def _load_file(path: Path, map_location: Any) -> tuple[dict[str, Any], int]:
    # weights_only=True: unpickling may only rebuild tensors, primitives and containers, never run code,
    # so a checkpoint directory on a shared filesystem cannot be used to execute code in the job. Model
    # and optimizer state dicts and RNG states (byte tensors) all fit. Other types can be allowed with
    # torch.serialization.add_safe_globals before loading.
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if not (
        isinstance(payload, dict)
        and isinstance(payload.get("step"), int)
        and isinstance(payload.get("state"), dict)
    ):
        raise CheckpointError(f"{path} is not a checkpoint written by elastic.save")
    return payload["state"], payload["step"]


def _read_marker(directory: Path) -> Path | None:
    try:
        name = (directory / LATEST_MARKER).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    # Only ever a file name of ours: a marker cannot point outside the directory.
    return directory / name if _STEP_FILE.match(name) else None


def load_latest(
    ckpt_dir: str | os.PathLike[str] | None = None, *, map_location: Any = "cpu"
) -> tuple[dict[str, Any], int] | None:
    """Load the newest complete checkpoint.

    Tries the file named by the ``latest`` marker first, then the ``step_*.pt`` files newest first, so a
    missing marker, or one naming a missing or unreadable file, falls back to the next good checkpoint.
    Temp files of unfinished saves are never read.

    Args:
        ckpt_dir: directory; default the ``ELASTIC_CKPT_DIR`` environment variable.
        map_location: passed to :func:`torch.load`; default loads tensors to CPU.

    Returns:
        ``(state, step)`` as given to :func:`save`, or ``None`` when there is no checkpoint yet.

    Raises:
        ValueError: no directory configured.
        CheckpointError: checkpoint files exist but none can be loaded.
    """
    directory = _resolve_dir(ckpt_dir)
    if not directory.is_dir():
        return None
    candidates: list[Path] = []
    marked = _read_marker(directory)
    if marked is not None and marked.is_file():
        candidates.append(marked)
    candidates += [path for _, path in _checkpoint_files(directory) if path != marked]

    errors = []
    for path in candidates:
        try:
            return _load_file(path, map_location)
        except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError, CheckpointError) as exc:
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            errors.append(f"{path.name}: {exc}")
    if errors:
        raise CheckpointError(f"no loadable checkpoint in {directory}; tried " + "; ".join(errors))
    return None
