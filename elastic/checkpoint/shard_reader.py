"""Memory-speed DCP reads: ``torch.distributed.checkpoint``'s file-system reader, reading shared-memory
files through a mapping instead of ``read()``.

``FileSystemReader`` loads each tensor record of a ``__<rank>_<i>.distcp`` file with ``torch.load`` from a
file view: the record's bytes are read into a new tensor (one copy, into freshly allocated pages that
fault in one by one), which is then copied into the state's tensor (a second copy). For files in shared
memory (a node's own flash checkpoint, a replica, files received at restore) :class:`MappedReader` maps
the file (``MAP_POPULATE``: the page-table entries are filled in one call, no fault per page) and copies
each record's bytes straight from the mapping into the state's tensor: one copy, from memory that is
resident already. This is what makes a restore from memory faster than one from disk's page cache.

Only public formats and APIs: DCP's ``StorageReader``/``FileSystemReader`` (metadata, plans, ``planner.
resolve_tensor``/``commit_tensor``), ``torch.load(map_location="meta")`` for a record's dtype and layout
(it reads no tensor data), and the zip format (stdlib :mod:`zipfile`) for where the record's storage
bytes lie. A record that does not fit this shape (more than one storage, compressed, a stream
transform) is read by ``FileSystemReader``'s own path.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import struct
import warnings
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_STORAGE_RECORD = re.compile(r"^[^/]+/data/\d+$")  # torch.save's storage records: <archive>/data/<key>
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... name and extra lengths
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


class _ViewStream(io.RawIOBase):
    """A read-only, seekable stream over a memoryview (no copy of the bytes it is not asked for)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        chunk = self.view[self.pos : self.pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self.pos += n
        return n


def record_tensor(view: memoryview, base: int, mapped: mmap.mmap) -> torch.Tensor | None:
    """The tensor of a ``torch.save`` record (``view``, at offset ``base`` of ``mapped``) as a view of
    the mapping, without copying its data; None when the record is not one uncompressed storage."""
    with zipfile.ZipFile(_ViewStream(view)) as archive:
        records = [info for info in archive.infolist() if _STORAGE_RECORD.match(info.filename)]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = records[0]
    signature, name_length, extra_length = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if signature != _LOCAL_HEADER_SIGNATURE:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    meta = torch.load(_ViewStream(view), map_location="meta", weights_only=True)  # layout only
    if not isinstance(meta, torch.Tensor) or meta.untyped_storage().nbytes() != info.file_size:
        return None
    with warnings.catch_warnings():  # a read-only mapping: the tensor is only read (copied from)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=info.file_size, offset=base + start)
    typed = raw.view(meta.dtype) if info.file_size else torch.empty(0, dtype=meta.dtype)
    return typed.as_strided(meta.size(), meta.stride(), meta.storage_offset())


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class MappedReader(FileSystemReader):
    """``FileSystemReader`` that copies tensors straight from the mapped data files (see the module doc).

    For files in shared memory (tmpfs): mapping a file on disk would fault its pages in one by one.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if self.storage_data[item.storage_index].transform_descriptors:
                return super().read_data(plan, planner)  # a stream transform (e.g. compression)
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        fallback: list[ReadItem] = []
        for relative_path, items in per_file.items():
            fallback += self._read_file(Path(self.path) / relative_path, items, planner)
        if fallback:
            super().read_data(LoadPlan(fallback), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, path: Path, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Load ``items`` from the mapped ``path``; returns the items left to ``FileSystemReader``."""
        left: list[ReadItem] = []
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return items
            mapped = mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        view = memoryview(mapped)
        try:
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                info = self.storage_data[item.storage_index]
                record = view[info.offset : info.offset + info.length]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(bytes(record)))
                    continue
                source = record_tensor(record, info.offset, mapped)
                if source is None:
                    left.append(item)
                    continue
                source = _narrow(source, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise AssertionError(
                        f"req {item.storage_index} mismatch sizes {target.size()} vs {source.size()}"
                    )
                target.copy_(source)
                del source
                planner.commit_tensor(item, target)
        finally:
            record = None
            view.release()
            with contextlib.suppress(BufferError):  # a tensor still exports it: unmapped when freed
                mapped.close()
        return left
