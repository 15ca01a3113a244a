"""Steady-state sharded flash saves without DCP's collectives: the previous save's bytes, replayed.

A ``torch.distributed.checkpoint`` save exchanges plans and write results between all ranks (about nine
small collectives, 10-20 ms on gloo) around copying the shards, which alone takes as long as a memcpy. While
the state keeps its structure, every save writes the same file, byte for byte, but for the tensors' bytes
and the pickled small objects (a step counter, a learning rate): torch.save's headers and pickles do not
change (CRC32 is off for flash saves), and DCP's metadata (which item lies where) is the same too.

So a full DCP save is *recorded* (:class:`Recorder`: every write of this rank's data file, and which item
it came from), and later saves *replay* it (:class:`Replay`): the constant chunks as they were, each item's
current bytes in its place, and the recorded metadata. Flash saves replay only when every rank can (one
all-reduce, elastic/checkpoint/shard_save.py); otherwise they make a full DCP save again, recorded anew. A
rank can replay when DCP would plan the same items for it now (same keys, shapes, dtypes, shard offsets) and
every item is as long as it was.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem

#: A write at least this long that came from no item makes a save unreplayable: constant chunks (zip
#: headers, pickles of a tensor's shape) are far shorter.
MAX_CONSTANT_BYTES = 1 << 16

#: One chunk of a recorded file: constant bytes, or (the item whose bytes go there, their length).
Step = bytes | tuple[WriteItem, int]
#: One chunk of a file to write now: bytes, or a tensor's storage as uint8.
Chunk = bytes | torch.Tensor


def _address(view: memoryview) -> int:
    if not len(view):
        return 0
    with warnings.catch_warnings():  # a read-only buffer: only its address is read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def _tensor_bytes(data: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CPU tensor's bytes as uint8, in order: what torch.save writes for it, whether DCP
    wrote the tensor itself or a clone (it clones a view of a larger storage). None for other tensors."""
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    return data.reshape(-1).view(torch.uint8)


def _replayable(data: Any) -> bool:
    """Whether a resolved item's bytes can be put in place again: a contiguous CPU tensor, a pickle."""
    if isinstance(data, torch.Tensor):
        return data.device.type == "cpu" and data.is_contiguous()
    return isinstance(data, io.BytesIO)


def _chunk(data: Any) -> Chunk | None:
    """What goes into the file for a resolved item now."""
    if isinstance(data, torch.Tensor):
        return _tensor_bytes(data)
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    return None


def local_plan(state: dict[str, Any], is_coordinator: bool) -> tuple[DefaultSavePlanner, list[tuple]]:
    """A fresh planner set up on ``state``, and what DCP plans for this rank (no collective)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=is_coordinator)
    plan = planner.create_local_plan()
    return planner, [(item.index, item.type, item.tensor_data) for item in plan.items]


class Recorder:
    """Watches one full DCP save of this rank: each item as DCP resolves it, then the writes of its bytes.

    DCP resolves an item, then writes it (torch.save: headers, a pickle, the data). The write of the item's
    data is told from the headers by its address (the tensor's own memory, the pickle's buffer) or, for a
    clone DCP made, by its length and content. Every item's data must be found, once, and no long write may
    be left unexplained; otherwise the save is not replayed."""

    def __init__(self) -> None:
        self._items: list[tuple[WriteItem, Any, bool]] = []  # (item, resolved data, its data was written)
        self._files: dict[str, list[Step]] = {}
        self._broken = False

    def resolved(self, item: WriteItem, data: Any) -> None:
        """DCP's planner resolved ``item`` to ``data``, which it writes next."""
        if not _replayable(data):
            self._broken = True  # a device tensor, a non-contiguous one: never replayed
        self._items.append((item, data, False))

    def wrote(self, file_name: str, view: memoryview) -> None:
        """``view`` was written to the end of ``file_name``."""
        steps = self._files.setdefault(file_name, [])
        if self._items and not self._items[-1][2] and self._is_data(self._items[-1][1], view):
            item, data, _ = self._items[-1]
            self._items[-1] = (item, None, True)  # its data is not kept past the match
            steps.append((item, len(view)))
        elif len(view) < MAX_CONSTANT_BYTES:
            steps.append(bytes(view))
        else:
            self._broken = True

    @staticmethod
    def _is_data(data: Any, view: memoryview) -> bool:
        if isinstance(data, io.BytesIO):  # DCP writes the pickle's own buffer
            with data.getbuffer() as own:
                return _address(own) == _address(view) and len(own) == len(view)
        chunk = _tensor_bytes(data) if isinstance(data, torch.Tensor) else None
        if chunk is None or chunk.numel() != len(view):
            return False
        if chunk.data_ptr() == _address(view):
            return True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.equal(torch.frombuffer(view, dtype=torch.uint8), chunk)

    def replay(self, metadata: Metadata, local_keys: list[tuple], is_coordinator: bool) -> Replay | None:
        """What later saves replay, or None when this save cannot be replayed."""
        if self._broken or not all(written for _, _, written in self._items):
            return None
        return Replay(self._files, metadata, local_keys, is_coordinator)


@dataclasses.dataclass
class Replay:
    """One rank's recorded save: each data file's chunks in order, DCP's metadata of that save, and the
    local plan it came from."""

    files: dict[str, list[Step]]
    metadata: Metadata
    local_keys: list[tuple]
    is_coordinator: bool

    def prepare(self, state: dict[str, Any]) -> dict[str, list[Chunk]] | None:
        """Each file's chunks for ``state``, or None when ``state`` would not be written the same way (its
        structure changed, or an item's length: a step counter that grew a byte)."""
        planner, keys = local_plan(state, self.is_coordinator)
        if keys != self.local_keys:
            return None
        out: dict[str, list[Chunk]] = {}
        for name, steps in self.files.items():
            chunks: list[Chunk] = []
            for step in steps:
                if isinstance(step, bytes):
                    chunks.append(step)
                    continue
                item, length = step
                chunk = _chunk(planner.resolve_data(item))
                if chunk is None or (len(chunk) if isinstance(chunk, bytes) else chunk.numel()) != length:
                    return None
                chunks.append(chunk)
            out[name] = chunks
        return out
