"""File layout of sharded (DCP) checkpoints, shared by the worker library and the agent (stdlib only).

A sharded checkpoint of one step is a folder in ``torch.distributed.checkpoint``'s file-system format
(``__<rank>_<i>.distcp`` data files, the ``.metadata`` pickle), plus a JSON ``manifest.json`` that global
rank 0 writes beside ``.metadata`` (the data files and their sizes, so that the agent, which never imports
torch, can tell a complete step). The same layout serves the agent's shared memory (each node's folder
holds its own ranks' files), replicas held for peers, and disk::

    <root>/step_0000000010 -> .step_0000000010.<save id>     the committed step: a symlink
    <root>/.step_0000000010.<save id>/                       DCP files (+ manifest.json, hashes.json)
    <root>/.step_0000000011.<save id>.tmp/                   a save in progress (never read)
    <root>/latest                                            "step_0000000010" (disk only)

A commit renames the temp folder to its data folder, then replaces the ``step_<N>`` symlink atomically
(``rename`` of a new symlink over it): a step saved again (after a rollback) is replaced in one atomic
step, and a crash at any point leaves the old or the new checkpoint visible, never none. The *save id*
(16 hex digits, the same on every rank of one save) tells two saves of one step number apart.

``hashes.json`` (replicas): each file's digest as its receiving agent computed it (and its sender sent
it). ``<file>.xxh3`` (a node's own memory saves): a data file's digest, computed by the rank that wrote it
while writing it (:mod:`elastic.checkpoint.dcp_io`). Both are checked at restore (:func:`check_file`).
The digest is :mod:`elastic.checkpoint.digest`'s xxh3_128, as 32 hex digits (:func:`digest_hasher`,
:func:`file_digest`); 64 hex digits are the sha256 that agents of earlier versions recorded, still checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from elastic.checkpoint import digest

SHARDED_SUBDIR = "sharded"
REPLICAS_SUBDIR = "replicas"
MANIFEST = "manifest.json"
HASHES = "hashes.json"
#: The suffix of a data file's digest file in a node's own memory save (``__0_0.distcp.xxh3``).
DIGEST_SUFFIX = ".xxh3"
METADATA = ".metadata"
LATEST_MARKER = "latest"
#: A worker's spare segment (elastic.checkpoint.dcp_io), ``.shard-segment.<pid>.<hex>``: never a
#: checkpoint.
SPARE_PREFIX = ".shard-segment."
STEP_LINK = re.compile(r"^step_(\d{10,})$")
DATA_DIR = re.compile(r"^\.step_(\d{10,})\.([0-9a-f]{16})$")
TMP_DIR = re.compile(r"^\.step_(\d{10,})\.([0-9a-f]{16})\.tmp$")
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def new_save_id() -> str:
    """16 hex digits naming one save (the same on every rank of it)."""
    return secrets.token_hex(8)


def save_id_int(save_id: str) -> int:
    """The save id as a non-negative int64 (for collectives)."""
    return int(save_id, 16) & ((1 << 63) - 1)


def save_id_str(value: int) -> str:
    return f"{value:016x}"


def step_link_name(step: int) -> str:
    return f"step_{step:010d}"


def data_dir_name(step: int, save_id: str) -> str:
    return f".step_{step:010d}.{save_id}"


def tmp_dir_name(step: int, save_id: str) -> str:
    return f"{data_dir_name(step, save_id)}.tmp"


def step_of_link(name: str) -> int | None:
    match = STEP_LINK.match(name)
    return int(match.group(1)) if match else None


def file_id(name: str) -> int | None:
    """A DCP data file's number (``__R_I.distcp`` -> ``R * 1024 + I``); None for other names."""
    match = DATA_FILE.match(name)
    return int(match.group(1)) * 1024 + int(match.group(2)) if match else None


def committed(root: Path) -> list[tuple[int, str, Path]]:
    """The committed steps of ``root``: ``(step, save id, data folder)``, newest first."""
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        step = step_of_link(entry.name)
        if step is None or not entry.is_symlink():
            continue
        target = os.readlink(entry.path)
        match = DATA_DIR.match(target)
        if match and (root / target).is_dir():
            found.append((step, match.group(2), root / target))
    return sorted(found, reverse=True)


def read_manifest(folder: Path) -> dict[str, int] | None:
    """The data files of a step and their sizes, from its manifest; None without one (or a bad one)."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        return {str(name): int(size) for name, size in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_json(path: Path, value: object) -> None:
    """Write ``path`` whole or not at all (temp name, then rename)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(value, sort_keys=True))
    os.replace(tmp, path)


def complete_on_disk(folder: Path) -> bool:
    """True when ``folder`` holds ``.metadata`` and every data file its manifest names, at its size
    (a folder without a manifest: ``.metadata`` alone decides, as for DCP folders written elsewhere)."""
    if not (folder / METADATA).is_file():
        return False
    files = read_manifest(folder)
    if files is None:
        return True
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
    return True


def commit(root: Path, tmp: Path, step: int, save_id: str, *, durable: bool = False) -> Path:
    """Publish the finished temp folder ``tmp`` as the checkpoint of ``step`` (see the module doc);
    returns the data folder. ``durable``: fsync the folders (disk)."""
    data = root / data_dir_name(step, save_id)
    if data.exists():
        shutil.rmtree(tmp, ignore_errors=True)  # the same save committed already (e.g. by a peer's agent)
    else:
        os.rename(tmp, data)
    link_step(root, step, save_id, durable=durable)
    return data


def link_step(root: Path, step: int, save_id: str, *, durable: bool = False) -> None:
    """Point ``step_<N>`` at the data folder of ``save_id`` (atomic, also over an older save's link)."""
    data = root / data_dir_name(step, save_id)
    link_tmp = root / f".{step_link_name(step)}.{secrets.token_hex(4)}.link"
    os.symlink(data.name, link_tmp)
    os.replace(link_tmp, root / step_link_name(step))  # the commit
    if durable:
        _fsync_dir(data)
        _fsync_dir(root)


def data_folders(root: Path) -> list[tuple[int, str, Path]]:
    """Every data folder of ``root``, linked or not (a node's part of a step persisted to a folder of
    its own): ``(step, save id, folder)``, newest first. Their files are whole (each renamed in)."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = DATA_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append((int(match.group(1)), match.group(2), Path(entry.path)))
    return sorted(found, reverse=True)


def latest_step(root: Path) -> int | None:
    """The step ``latest`` names, or None."""
    try:
        return step_of_link((root / LATEST_MARKER).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(root: Path, step: int, *, durable: bool = True) -> None:
    """Move ``latest`` to ``step`` (never backwards: an older step leaves it)."""
    marker = root / LATEST_MARKER
    with contextlib.suppress(OSError, ValueError):
        current = step_of_link(marker.read_text().strip())
        if current is not None and current > step:
            return
    write_json_text(marker, step_link_name(step))
    if durable:
        _fsync_dir(root)


def write_json_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prune(root: Path, keep: int, *, newest: int | None = None) -> None:
    """Keep the newest ``keep`` committed steps of ``root`` (at or before ``newest`` when given: later
    steps belong to a rolled-back run and go too); remove data folders no step links to (older saves of
    a step, abandoned commits). Temp folders are left to :func:`remove_temp_dirs`."""
    steps = committed(root)
    kept, linked = 0, set()
    for step, _, data in steps:
        if (newest is None or step <= newest) and kept < keep:
            kept += 1
            linked.add(data.name)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / step_link_name(step))
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for entry in entries:
        if DATA_DIR.match(entry.name) and entry.name not in linked:
            shutil.rmtree(entry.path, ignore_errors=True)


def remove_temp_dirs(root: Path, *, older_than: int | None = None) -> int:
    """Remove temp folders (saves that never committed) of steps before ``older_than`` (all when None:
    no writer is running, and then the writers' spare segments too); returns the bytes freed."""
    freed = 0
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if older_than is None and entry.name.startswith(SPARE_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                freed += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
            continue
        match = TMP_DIR.match(entry.name)
        if not match or (older_than is not None and int(match.group(1)) >= older_than):
            continue
        freed += tree_size(Path(entry.path))
        shutil.rmtree(entry.path, ignore_errors=True)
    return freed


def tree_size(folder: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def digest_hasher() -> Any:
    """A new streaming hasher of the checkpoint digest (xxh3_128: ``update``, ``hexdigest``), as the
    replication's sender and receiver compute it while the bytes stream (what ``hashes.json`` records)."""
    return digest.hasher()


def file_digest(path: Path) -> str:
    """The digest of a file's bytes, as ``hashes.json`` records it (32 hex digits)."""
    return digest.file_digest_raw(path).hex()


def digest_path(path: Path) -> Path:
    """Where the digest of a node's own data file ``path`` is kept (written at the save)."""
    return path.with_name(path.name + DIGEST_SUFFIX)


def recorded_digest(path: Path) -> str | None:
    """The digest recorded for the file ``path`` of a sharded save: its folder's ``hashes.json`` entry (a
    replica), else its ``.xxh3`` file (a node's own save); None when none is (disk, an older save).
    ``""`` when ``hashes.json`` exists but lacks the file (a damaged record)."""
    hashes = path.parent / HASHES
    if hashes.exists():
        try:
            return str(json.loads(hashes.read_text())[path.name])
        except (OSError, ValueError, KeyError, TypeError):
            return ""
    try:
        return digest_path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def recorded_text(path: Path) -> str | None:
    """:func:`recorded_digest` in the text form :class:`elastic.checkpoint.digest.Verifier` checks."""
    recorded = recorded_digest(path)
    if recorded and len(recorded) == 32:  # xxh3_128 as hex (hashes.json, .xxh3 files)
        return f"{digest.ALGORITHM}:{recorded}"
    return recorded


def check_file(path: Path) -> str:
    """'' when the file ``path`` of a sharded save matches its recorded digest (or none is recorded), else
    one line naming the file and the mismatch."""
    return check_mapped(path, keep=False)[0]


def check_mapped(path: Path, keep: bool = True) -> tuple[str, mmap.mmap | None]:
    """:func:`check_file`, and the file mapped read-only with its page tables filled in one call
    (``MAP_POPULATE``) when a digest is recorded and the file is not empty (else None; ``keep=False``:
    never): a restore that checks a file and then reads or sends it maps it once (on tmpfs, filling the
    page tables of 1 GB costs about as much as hashing it). The caller closes the map."""
    recorded = recorded_text(path)
    if recorded is None:
        return "", None
    if not recorded:
        return f"{path}: no recorded digest in {HASHES}", None
    mapped = None
    if keep:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    why = digest.check_text(recorded, path, mapped)
    if why and mapped is not None:
        mapped.close()
        mapped = None
    return why, mapped


def sha256_file(path: Path) -> str:
    """The sha256 of a file (hashlib releases the GIL on large chunks)."""
    digest = hashlib.sha256()
    chunk = bytearray(1 << 20)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:  # hashlib.file_digest's loop, which Python 3.10 lacks
        while n := f.readinto(chunk):
            digest.update(view[:n])
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ring_targets(members: list[str], node_id: str, replicas: int) -> list[str]:
    """The nodes ``node_id`` replicates to: its next ``replicas`` members in rank order (a ring), so that
    any single node's loss leaves a copy of its shards on a survivor."""
    if node_id not in members or replicas <= 0:
        return []
    index = members.index(node_id)
    count = min(replicas, len(members) - 1)
    return [members[(index + i) % len(members)] for i in range(1, count + 1)]
