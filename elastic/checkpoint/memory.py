"""A replicated checkpoint's write into the agent's shared memory, on the local rank 0 of each node.

The flash writer (:mod:`elastic.checkpoint.flash_save`) copies the state into a reused segment in the raw
format of :mod:`elastic.checkpoint.flash_format`; a state that format does not describe falls back to
``torch.save`` into a new file (:mod:`elastic.checkpoint.torch_fallback`). Memory keeps the last
:data:`MEMORY_KEEP` saves; when space is short the older goes first, and a save that still does not fit is a
:class:`CheckpointError` naming the sizes and how to enlarge ``/dev/shm``.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.checkpoint import flash_format, flash_save, layout, segments, torch_fallback
from elastic.checkpoint.env import SHM_DIR_ENV, CheckpointError
from elastic.checkpoint.torch_fallback import estimated_size

#: Flash saves kept in shared memory per node: the newest and the one before it.
MEMORY_KEEP = 2

log = logging.getLogger(__name__)
_warned_fallback = False


def free_bytes(directory: Path) -> int:
    """Bytes available in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _space_error(
    step: int, directory: Path, need: int, free: int, size: int | None = None
) -> CheckpointError:
    # ``size``: one flash file; memory holds MEMORY_KEEP of them (the double buffer), plus one while the
    # agent persists the oldest.
    total = "" if size is None else f" (the {MEMORY_KEEP} saves memory keeps take {_mib(MEMORY_KEEP * size)})"
    return CheckpointError(
        f"not enough shared memory for the checkpoint of step {step}: it needs about {_mib(need)} more in "
        f"{directory}{total}, only {_mib(free)} is available. Enlarge /dev/shm (docker run --shm-size, or "
        "a Kubernetes emptyDir with medium: Memory and a sizeLimit) to at least "
        f"{MEMORY_KEEP + 1} times the checkpoint size"
    )


def _ensure_space(directory: Path, step: int, need: int) -> None:
    """Make room for a checkpoint of ``need`` bytes, or raise a CheckpointError naming the sizes.

    When space is short, memory gives up the older of its two saves first (the newest is kept: it is
    what a crash during this save falls back to).
    """
    free = free_bytes(directory)
    if free >= need:
        return
    for _, path in layout.checkpoint_files(directory)[1:]:
        path.unlink(missing_ok=True)
    free = free_bytes(directory)
    if free < need:
        raise _space_error(step, directory, need, free)


def write(state: dict[str, Any], step: int, directory: Path, on_commit: Callable[[], None]) -> Path:
    """Flash-save into the agent's folder (:mod:`elastic.checkpoint.flash_save`); ``on_commit()`` once it is
    visible (later, from a background thread, when device copies are still running at the return)."""
    global _warned_fallback
    if not directory.is_dir():
        raise CheckpointError(
            f"the agent's shared-memory folder {directory} ({SHM_DIR_ENV}) does not exist; "
            "is the elastic-run agent of this worker still running?"
        )
    # A lambda: the module global is looked up at each call (tests replace it).
    writer = flash_save.writer_for(directory, MEMORY_KEEP, lambda folder: free_bytes(folder))
    try:
        return writer.save(state, step, on_commit)
    except flash_format.Unsupported as exc:
        if not _warned_fallback:
            _warned_fallback = True
            log.warning("elastic.save: the state holds %s: saving with torch.save (slower)", exc)
    except segments.NoSpaceError as exc:
        raise _space_error(step, directory, exc.need, exc.free, flash_format.plan(state).size) from None
    except flash_save.AsyncSaveError as exc:
        raise CheckpointError(str(exc)) from exc
    path = _write_torch_memory_checkpoint(state, step, directory)
    writer.forget_removed()  # the pruned segments' memory goes back now
    on_commit()
    return path


def _write_torch_memory_checkpoint(state: dict[str, Any], step: int, directory: Path) -> Path:
    """The fallback for states the flash format does not describe: torch.save into a new file."""
    need = estimated_size(state)
    _ensure_space(directory, step, need)
    try:
        return torch_fallback.write(state, step, directory, MEMORY_KEEP)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _space_error(step, directory, need, free_bytes(directory)) from exc
        raise
