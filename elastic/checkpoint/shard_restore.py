"""Which files of a sharded checkpoint each node needs at restore, and moving them between ranks.

A node assembles the files its ranks' DCP load plans read (not every file of the step): at an unchanged
world size with every node holding its own shards nothing moves; at another world size (re-sharding) a
node receives only the files whose chunks overlap its ranks' new shards. Each missing file travels once
per node that needs it, point to point (``dist.send``/``dist.recv``) from one rank that holds it to the
node's writer (the lowest rank of the node), straight into the file's pages.

The planning functions are pure (tested without a process group); :func:`run_transfers` performs a
list that every rank computed identically, in that order, which cannot deadlock: the first unfinished
transfer's two ranks have finished everything before it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Transfer:
    """One file sent from rank ``src`` to rank ``dst`` (a node's writer)."""

    file: int
    src: int
    dst: int


def node_key(shm: Path | None) -> int:
    """A number that ranks of one node share: its host and shared-memory folder (where it assembles).

    Without shared memory each process assembles in a private folder: the process is its own node.
    """
    where = str(shm.resolve()) if shm is not None else f"pid {os.getpid()}"
    digest = hashlib.blake2b(f"{socket.gethostname()}:{where}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)  # an int64 collective carries it


def writers(keys: list[int]) -> list[int]:
    """For each rank, its node's writer: the lowest rank with the same node key."""
    first: dict[int, int] = {}
    for rank, key in enumerate(keys):
        first.setdefault(key, rank)
    return [first[key] for key in keys]


def node_needs(reads: list[Iterable[int]], writer_of: list[int]) -> dict[int, set[int]]:
    """The files each node's ranks read, by the node's writer rank."""
    needs: dict[int, set[int]] = {}
    for rank, files in enumerate(reads):
        needs.setdefault(writer_of[rank], set()).update(files)
    return needs


def plan_transfers(needs: Mapping[int, set[int]], holders: Mapping[int, list[int]]) -> list[Transfer]:
    """The sends that give every node the files it needs and lacks.

    Args:
        needs: writer rank -> files its node reads.
        holders: file -> the ranks holding it (all ranks of a node hold the same files).

    Each file goes from the holder with the fewest sends so far (ties: the lowest rank), to spread the
    load over the nodes that hold replicas of one file.

    Raises:
        ValueError: a needed file is held by no rank (the step chosen was not complete).
    """
    transfers: list[Transfer] = []
    sent: dict[int, int] = {}
    for writer in sorted(needs):
        for fid in sorted(needs[writer]):
            owners = holders.get(fid, [])
            if writer in owners:
                continue
            if not owners:
                raise ValueError(f"no rank holds file {fid} of the checkpoint")
            src = min(owners, key=lambda r: (sent.get(r, 0), r))
            sent[src] = sent.get(src, 0) + 1
            transfers.append(Transfer(fid, src, writer))
    return transfers


def files_read(state: dict[str, Any], folder: Path) -> set[str] | None:
    """Names of the data files that ``dcp.load(state, checkpoint_id=folder)`` reads on this rank.

    Computed with DCP's public planner and reader API the way ``dcp.load`` does it (Stateful values by
    their ``state_dict()``). ``None`` when it cannot be told (the caller then assembles every file and
    ``dcp.load`` reports the real error, on every rank, after the collectives all ranks go through).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.stateful import Stateful

    try:
        metadata = FileSystemReader(folder).read_metadata()
        plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in sorted(state.items())}
        planner = DefaultLoadPlanner()
        planner.set_up_planner(plain, metadata, is_coordinator=False)
        plan = planner.create_local_plan()
        storage = metadata.storage_data or {}
        return {storage[item.storage_index].relative_path for item in plan.items}
    except Exception:  # noqa: BLE001 - any failure here is dcp.load's to report, after the collectives
        return None


def _device() -> torch.device:
    from elastic import collectives

    return collectives.collective_device(str(dist.get_backend()))


def send_file(path: Path, dst: int) -> None:
    """Send ``path``'s bytes to rank ``dst`` (its size first); the pages are mapped, not copied."""
    device = _device()
    size = path.stat().st_size
    dist.send(torch.tensor([size], dtype=torch.int64, device=device), dst)
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: a send only reads it
            payload = torch.frombuffer(mapped, dtype=torch.uint8)
        dist.send(payload.to(device), dst)
        del payload  # the map closes only when no tensor exports it


def recv_file(path: Path, src: int) -> None:
    """Receive a file sent by :func:`send_file` on rank ``src`` into ``path`` (straight into its pages)."""
    device = _device()
    size_t = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size_t, src)
    size = int(size_t.item())
    with open(path, "w+b") as f:
        if size == 0:
            return
        f.truncate(size)
        with mmap.mmap(f.fileno(), size) as mapped:
            target = torch.frombuffer(mapped, dtype=torch.uint8)
            if device.type == "cpu":
                dist.recv(target, src)
            else:
                staged = torch.empty(size, dtype=torch.uint8, device=device)
                dist.recv(staged, src)
                target.copy_(staged)
            del target


def run_transfers(
    transfers: list[Transfer], rank: int, names: Mapping[int, str], source: Mapping[str, Path], target: Path
) -> int:
    """Perform this rank's part of ``transfers`` in order; returns the bytes received.

    Args:
        names: file id -> file name.
        source: file name -> this rank's copy (for the files it sends).
        target: the folder received files are written to (this rank's node's assembly folder).
    """
    received = 0
    for t in transfers:
        if t.src == rank:
            send_file(source[names[t.file]], t.dst)
        elif t.dst == rank:
            path = target / names[t.file]
            recv_file(path, t.src)
            received += path.stat().st_size
    return received
