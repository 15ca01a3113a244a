"""Persisting a node's part of a sharded memory checkpoint to ``--ckpt-dir`` in DCP's file-system format,
without the workers' process group.

A sharded save leaves in the node's shared memory (``<shm>/sharded``, :mod:`elastic.checkpoint.shard_layout`)
the node's ranks' data files (``__<rank>_<i>.distcp``, as ``FileSystemWriter`` writes them), the global
``.metadata`` and ``manifest.json`` (the same on every node). The keeper of each node copies its files to
``<ckpt_dir>/sharded/.step_<N>.<save id>/`` — into temp files named for their writer (host, pid: a dead
writer's are swept), fsynced — and then, under the folder's fence lock (:mod:`agent.checkpoints.fence`):

* a persist of an older job incarnation, or of an older round of the same incarnation, than the fence's
  publishes nothing (a resubmitted job's writers supersede the earlier submission's, whatever their round
  numbers; within a submission a restart abandons the older round's run):
  :func:`agent.checkpoints.fence.decide`;
* it renames its files in, and records its round and incarnation in the fence;
* when the data folder now holds every file of the manifest (the last node to finish sees it), it links
  ``step_<N>`` to it and moves ``latest`` (never backwards): the step is committed, loadable by
  ``elastic.load_sharded`` at any world size (DCP re-shards), with or without an agent;
* it prunes: of the steps up to this one, the newest ``keep`` and the newest committed one stay (their
  parts too); older data folders and links go. Newer steps are never touched (another writer's).

With a folder per node (no shared file system) no step is complete in any one folder: each holds its
node's parts (pruned the same way), and ``elastic.load_sharded`` gathers them over the nodes. The
keeper reports a step as persisted (``persisted_step``) only once it is committed, complete in one folder.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.checkpoints import fence as ckpt_fence
from elastic.checkpoint import layout
from elastic.checkpoint import shard_layout as sl


@dataclass(frozen=True)
class Outcome:
    """What became of one node's part of a step on disk."""

    published: bool  # its files were renamed in
    committed: bool  # the step is complete in the folder and linked (by this persist)
    why: str


def node_files(data: Path) -> list[str]:
    """The files of a node's memory save to persist: its data files, ``.metadata``, the manifest."""
    return sorted(
        entry.name
        for entry in os.scandir(data)
        if entry.is_file(follow_symlinks=False)
        and (sl.file_id(entry.name) is not None or entry.name in (sl.METADATA, sl.MANIFEST))
    )


def persist(
    data: Path,
    root: Path,
    *,
    step: int,
    save_id: str,
    round_: int | None,
    keep: int,
    copy: Callable[[BinaryIO, BinaryIO], None],
    incarnation: str = "",
    lock_timeout_s: float = ckpt_fence.DEFAULT_LOCK_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> Outcome:
    """Persist the node's memory save ``data`` (step ``step``, ``save_id``, written in round ``round_`` of
    job ``incarnation``) into ``root`` (``<ckpt_dir>/sharded``); ``copy(src, dst)`` copies one file. See
    the module doc.

    Raises:
        FileNotFoundError: the save was replaced in memory before it could be opened (skip it).
        OSError: the disk failed (full, EIO), or the fence lock was held too long.
    """
    cancel = cancel or threading.Event()
    target = root / sl.data_dir_name(step, save_id)
    temps: dict[str, Path] = {}
    try:
        with contextlib.ExitStack() as stack:
            # Shared locks first: the workers do not recycle these segments while they are copied.
            sources = [
                (name, stack.enter_context(layout.open_shared(data / name))) for name in node_files(data)
            ]
            if not any(sl.file_id(name) is not None for name, _ in sources):
                raise FileNotFoundError(f"{data} holds no data file")
            target.mkdir(parents=True, exist_ok=True)
            for name, src in sources:
                temps[name] = layout.write_temp(target / name, functools.partial(copy, src))
        if cancel.is_set():
            return Outcome(False, False, "given up at stop")
        with ckpt_fence.fence_lock(root, lock_timeout_s, cancel) as fd:
            if cancel.is_set():
                raise ckpt_fence.FenceLockTimeoutError("the keeper gave this persist up (stopping)")
            fenced = ckpt_fence.read_fence(fd)
            decision = ckpt_fence.decide(
                round_, step, fenced.round, sl.latest_step(root), incarnation, fenced.incarnation
            )
            if not decision.publish:
                return Outcome(False, False, decision.why)
            ckpt_fence.check_still_holds(fd, root)
            try:
                for name, tmp in temps.items():
                    os.replace(tmp, target / name)
            except FileNotFoundError:
                # Pruned by another node's commit while this one copied: a newer step is on disk.
                return Outcome(False, False, f"step {step} was pruned from {root} meanwhile (a newer one)")
            layout.fsync_dir(target)
            new_fence = ckpt_fence.advanced(fenced, round_, incarnation)
            if new_fence is not None:
                ckpt_fence.write_fence(fd, new_fence)
            committed = sl.read_manifest(target) is not None and sl.complete_on_disk(target)
            if committed:
                sl.link_step(root, step, save_id, durable=True)
                if decision.move_latest:
                    sl.write_latest(root, step)
            prune(root, step, keep)
            return Outcome(True, committed, decision.why)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)  # not published (or renamed: then a no-op)


def prune(root: Path, step: int, keep: int) -> None:
    """Of the steps up to ``step``, keep the newest ``keep`` and the newest committed one (all their
    saves and parts); remove older data folders and their links, and dead writers' temp files. Steps
    after ``step`` are another writer's: never touched."""
    folders = [f for f in sl.data_folders(root) if f[0] <= step]
    kept_steps = sorted({s for s, _, _ in folders}, reverse=True)[:keep]
    complete = [(s, d) for s, _, d in sl.committed(root) if s <= step and sl.complete_on_disk(d)]
    kept_dirs = {complete[0][1].name} if complete else set()
    for s, _, folder in folders:
        if s in kept_steps or folder.name in kept_dirs:
            layout.remove_temp_files(folder)  # only those whose writer is provably dead
        else:
            shutil.rmtree(folder, ignore_errors=True)
    for entry in os.scandir(root):
        linked = sl.step_of_link(entry.name)
        if linked is None or linked > step or not entry.is_symlink():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry.path) not in kept_dirs and (
                linked not in kept_steps or not os.path.isdir(entry.path)
            ):
                os.unlink(entry.path)  # a pruned step's link (or one left dangling)
