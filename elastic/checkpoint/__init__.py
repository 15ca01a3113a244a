"""Checkpoints: flash saves into the agent's shared memory, restores from whichever holder has the step.

Promises: a worker's :func:`save` returns once the state's bytes are in shared memory the agent owns (so a
crashed worker's last save survives it), in the raw flash format written into reused, pre-faulted segments
(``flash``: the format, the writer and its background device copies; ``segments``: the segment pool), with
``torch.save`` as the fallback; :func:`load` / :func:`load_latest` restore the newest step any rank holds,
the same step on every rank (``replicated``). Sharded (DCP) saves follow the same rules per node:
``shard_save`` (flash and disk saves, replayed when the state keeps its structure), ``shard_restore``
(which step, which files move between nodes, the folder ``dcp.load`` reads) and ``dcp_io`` (DCP's writer,
replay and reader on shared memory); the worker API for them is :mod:`elastic.sharded`. File layouts
(``layout``, ``shard_layout``) are standard library only, because the agent reads them and never imports
torch. Every flash checkpoint carries a digest of its saved bytes (``digest``: xxh3_128, computed during
the save's copy, checked before a restore builds a tensor; standard library and xxhash only):
:func:`digest_of` reads a file's recorded digest without parsing it, :func:`verify_file` checks a file's
bytes against it (:class:`CheckpointCorruptError` on a mismatch).

Raises: :class:`CheckpointError` (``elastic.errors``) for a state that does not fit shared memory (the
message names the sizes) or checkpoint files none of which can be loaded (a copy whose bytes fail its
digest is skipped and reported, never loaded).

Owns: the checkpoint file formats and layouts, and the environment a worker's checkpoint calls read
(``env``). Importing this package imports no torch; the worker API below resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.lazy import lazy_exports

_LAZY_ATTRS: dict[str, str] = {
    "save": "replicated",
    "load": "replicated",
    "load_latest": "replicated",
    "flash_enabled": "replicated",
    "LATEST_MARKER": "replicated",
    "CheckpointError": "replicated",
    # Standard library and xxhash only: the agent calls them too.
    "CheckpointCorruptError": "digest",
    "digest_of": "digest",
    "verify_file": "digest",
}
__all__ = [
    "LATEST_MARKER",
    "CheckpointCorruptError",
    "CheckpointError",
    "digest_of",
    "flash_enabled",
    "load",
    "load_latest",
    "save",
    "verify_file",
]

if TYPE_CHECKING:
    from elastic.checkpoint.digest import CheckpointCorruptError, digest_of, verify_file
    from elastic.checkpoint.replicated import (
        LATEST_MARKER,
        CheckpointError,
        flash_enabled,
        load,
        load_latest,
        save,
    )


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_ATTRS, __all__)
