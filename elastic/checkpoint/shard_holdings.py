"""What each node holds of sharded saves, and the step the ranks agree to load
(:func:`elastic.sharded.load_sharded`).

Each node lists the files it holds (its own memory, the replicas it keeps for peers, the disk folder)
as int64 triples ``(step, save id, file)``; the ranks exchange the lists and pick the newest step
whose files they hold together.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elastic.checkpoint import shard_layout as sl


def held(shm: Path | None, disk: Path | None) -> dict[tuple[int, str], dict[str, Path]]:
    """The files of sharded saves this node holds: ``(step, save id) -> {file name: path}``."""
    roots: list[tuple[Path, bool]] = []  # (root, parts: uncommitted data folders count too)
    if shm is not None:
        roots.append((shm / sl.SHARDED_SUBDIR, False))
        roots += [(p / sl.SHARDED_SUBDIR, False) for p in sorted((shm / sl.REPLICAS_SUBDIR).glob("*"))]
    if disk is not None:
        # A node's part persisted to a folder of its own (no shared file system) is never committed
        # there; its files are whole (each renamed in), and the union over the nodes may be complete.
        roots.append((disk / sl.SHARDED_SUBDIR, True))
    held: dict[tuple[int, str], dict[str, Path]] = {}
    for root, parts in roots:
        for step, save_id, data in sl.data_folders(root) if parts else sl.committed(root):
            files = held.setdefault((step, save_id), {})
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(data):
                    if sl.file_id(entry.name) is not None or entry.name in (sl.METADATA, sl.MANIFEST):
                        files.setdefault(entry.name, Path(entry.path))
    return held


def encode(held: dict[tuple[int, str], dict[str, Path]]) -> list[int]:
    """Triples (step, save id, file): a data file's id, or ``-1 - n`` for metadata + manifest of n files."""
    flat: list[int] = []
    for (step, save_id), files in held.items():
        sid = sl.save_id_int(save_id)
        manifest = sl.read_manifest(files[sl.MANIFEST].parent) if sl.MANIFEST in files else None
        if manifest is not None and sl.METADATA in files:
            flat += [step, sid, -1 - len(manifest)]
        for name in files:
            fid = sl.file_id(name)
            if fid is not None:
                flat += [step, sid, fid]
    return flat


def choose(lists: list[list[int]], wanted: int | None) -> tuple[int, int] | None:
    """The newest (step, save id int) whose files the ranks hold together (``wanted``: that step)."""
    expected: dict[tuple[int, int], int] = {}
    files: dict[tuple[int, int], set[int]] = {}
    for flat in lists:
        for i in range(0, len(flat) - 2, 3):
            step, sid, fid = flat[i : i + 3]
            if step < 0:
                continue
            if fid < 0:
                expected[(step, sid)] = -1 - fid
            else:
                files.setdefault((step, sid), set()).add(fid)
    complete = [key for key, n in expected.items() if len(files.get(key, ())) == n]
    if wanted is not None:
        complete = [key for key in complete if key[0] == wanted]
    return max(complete) if complete else None
