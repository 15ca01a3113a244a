"""Sharded checkpoints (FSDP, DTensor, tensor parallel) through ``torch.distributed.checkpoint`` (DCP).

DCP writes each rank's shards plus one metadata file describing the global tensors, and re-shards on
load: a checkpoint written at one world size loads at another, into state whose tensors are sharded
for the new world. Every rank writes its own shards, so ``ckpt_dir`` must be one folder that all ranks
reach (a shared file system across nodes).

Layout, next to the replicated checkpoints of :mod:`elastic.checkpoint`::

    <ckpt_dir>/sharded/step_0000000010/     DCP files (__0_0.distcp, ..., .metadata)
    <ckpt_dir>/sharded/.step_0000000020.tmp/ a save in progress (never read)
    <ckpt_dir>/sharded/latest               "step_0000000010"

A save is atomic: DCP writes into the temp folder (fsyncing its files); once every rank has written
and the metadata is complete, global rank 0 renames the folder to its final name, fsyncs the parent
and moves the ``latest`` marker. These saves go straight to disk (they are not flash saves): the
shards of one step are spread over the nodes, and only a shared folder can hold them together.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic import ckpt_layout as layout
from elastic import collectives
from elastic.checkpoint import CheckpointError, _check_args, _resolve_dir
from elastic.report import report, report_checkpoint

SHARDED_SUBDIR = "sharded"
_STEP_DIR = re.compile(r"^step_(\d{10,})$")
_METADATA = ".metadata"
#: Rank 0's answer when the asked-for step has no complete checkpoint (steps are never negative).
_MISSING = -1


def _step_dir_name(step: int) -> str:
    return f"step_{step:010d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def complete_steps(ckpt_dir: str | os.PathLike[str] | None = None) -> list[int]:
    """Steps of the complete sharded checkpoints in ``ckpt_dir``, newest first."""
    directory = _resolve_dir(ckpt_dir) / SHARDED_SUBDIR
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and (entry / _METADATA).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def _prune(directory: Path, keep: int) -> None:
    names = sorted((e.name for e in directory.iterdir() if _STEP_DIR.match(e.name)), reverse=True)
    for name in names[keep:]:
        shutil.rmtree(directory / name, ignore_errors=True)


def save_sharded(
    state: dict[str, Any], step: int, ckpt_dir: str | os.PathLike[str] | None = None, *, keep: int = 3
) -> Path:
    """Save sharded ``state`` (a DCP state dict) as the checkpoint of ``step``; call it on every rank.

    Args:
        state: e.g. ``{"model": get_model_state_dict(model), "step": step}`` with DTensor/sharded
            tensors; plain tensors are saved once (they are assumed replicated).
        step: training steps completed.
        ckpt_dir: a folder all ranks share; default ``ELASTIC_CKPT_DIR``.
        keep: sharded checkpoints to keep, this one included (>= 1).

    Returns:
        The folder of the checkpoint.
    """
    import torch.distributed.checkpoint as dcp  # heavy (about 1.5 s); only for sharded checkpoints

    _check_args(state, step)
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = _resolve_dir(ckpt_dir) / SHARDED_SUBDIR
    final = directory / _step_dir_name(step)
    tmp = directory / f".{final.name}{layout.TMP_SUFFIX}"  # the same name on every rank
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the leftover of a killed save of this step
    _barrier()
    dcp.save(state, checkpoint_id=tmp)  # every rank writes its shards; rank 0 writes the metadata last
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)  # the same step saved again (e.g. after a restart)
        os.replace(tmp, final)
        layout.fsync_dir(directory)
        layout.atomic_write(directory / layout.LATEST_MARKER, lambda f: f.write(final.name.encode()))
        _prune(directory, keep)
    _barrier()  # nobody goes on (and possibly loads) before the rename
    report_checkpoint(step)
    return final


def load_sharded(
    state: dict[str, Any], step: int | None = None, ckpt_dir: str | os.PathLike[str] | None = None
) -> int | None:
    """Load a sharded checkpoint into ``state`` in place (resharded to this world); call it on every rank.

    Global rank 0 picks the step (``step``, else the newest complete one) and every rank loads it, so
    all ranks restore the same step.

    Returns:
        The step loaded, or ``None`` when there is no sharded checkpoint (``state`` is untouched).

    Raises:
        CheckpointError: ``step`` was given and there is no complete checkpoint of it.
    """
    import torch.distributed.checkpoint as dcp

    chosen: int | None = None
    if _rank() == 0:
        available = complete_steps(ckpt_dir)
        if step is not None:
            chosen = step if step in available else _MISSING
        else:
            chosen = available[0] if available else None
    chosen = collectives.broadcast_int(chosen, src=0)
    if chosen == _MISSING:
        raise CheckpointError(f"no complete sharded checkpoint of step {step} in {_resolve_dir(ckpt_dir)}")
    if chosen is None:
        return None
    path = _resolve_dir(ckpt_dir) / SHARDED_SUBDIR / _step_dir_name(chosen)
    dcp.load(state, checkpoint_id=path)
    report(chosen)
    report_checkpoint(chosen)
    return chosen
