"""Flash (shared-memory) checkpoints: their raw format, and the writer that copies a state into it.

**The format.** ``torch.save`` pickles the state and writes each storage through a zip writer; a flash save
instead copies each tensor storage's bytes straight into a pre-faulted shared-memory segment, so the file is
laid out for that copy::

    offset 0     header (80 bytes): magic, version, step, total size, JSON size, data offset, content id,
                 digest
    offset 80    JSON description: {"tree": ..., "storages": [...], "tensors": [...]}
    data offset  storage bytes, each at a 64-byte aligned offset (data offset is page aligned), the gaps
                 between them zero-filled
    size - 16    the content id again (a trailer: a file cut short or mixed from two saves is rejected)

**The digest** (version 2; :mod:`elastic.checkpoint.digest`): xxh3_128 of the header's first 48 bytes
(all but the content id and the digest) and of every byte from the header's end to the trailer. A save
computes it while it copies: each host storage's bytes right after their copy (still in cache), a device
state's in the background thread once the staging copies are in the segment; it is written into the
header before the commit. :func:`parse_flash` checks it before it builds a tensor
(:class:`~elastic.checkpoint.digest.CheckpointCorruptError` on a mismatch) and still reads version-1 files
(64-byte header, no digest: not verified).

The tree is the state with every container tagged, so that nothing is lost that torch.save keeps:
``{"D": [[k, v], ...]}`` dict (any primitive keys, e.g. an optimizer's int keys), ``{"O": ...}``
OrderedDict (with its ``_metadata``, as a model's state_dict has), ``{"L": [...]}`` list, ``{"T": [...]}``
tuple, ``{"S": [...]}`` torch.Size, ``{"t": i}`` the i-th tensor; None, bools, ints, floats and strings
stand for themselves. Tensors are views: ``[storage, dtype, shape, stride, storage offset,
requires_grad, is Parameter]``, and views of one storage share it after loading, as with torch.save.

Loading runs no pickle at all: only JSON and the tagged types above are rebuilt, which is the same
safety as ``torch.load(weights_only=True)``. A state with anything else (a sparse or quantized tensor, a
tensor subclass, a custom object) raises :class:`Unsupported` when planned; the caller then falls back
to torch.save. :func:`parse` also loads files written by torch.save (disk checkpoints of older runs),
recognising this format by its magic.

**The writer.** One :class:`FlashWriter` per shared-memory folder and process (local rank 0 of a node
writes). A save:

1. describes the state (:func:`plan`: tree, tensors, storages and their offsets);
2. takes a segment of the exact size from :class:`elastic.checkpoint.segments.SegmentPool` (recycled and
   already faulted in, except at the first save, which also pre-faults a second one: the double buffer);
3. writes header and description, and copies each host storage's bytes into the mapping with
   ``Tensor.copy_`` (torch's intra-op threads; no pickling of tensor data), hashing each after its copy;
4. writes the digest into the header, commits by rename and reports (the ``on_commit`` callback), and
   the pool retires the surplus file.

**Device storages** (GPU) are copied asynchronously: the save returns once the host storages are in the
segment and the device copies are queued; a background thread waits for them, copies them from the staging
buffer into the segment, commits and reports. The next save, a load, or :func:`wait_all` waits for that
thread first. A flash save of GPU state must not hold training up for a PCIe transfer: :class:`CudaCopier`
copies each device storage into a pinned host staging buffer on its own CUDA stream:

1. an event recorded on the current stream makes the copy stream wait for the work queued so far, so
   the copy sees the state as of the ``save`` call;
2. the copies are queued with ``non_blocking=True`` (a DMA from pinned memory: the CPU goes on);
3. the current stream waits (on the GPU, not the CPU) for the copies' end event, so that the next
   step's in-place updates of parameters and optimizer state cannot overwrite them while they are read,
   and ``record_stream`` keeps the allocator from reusing their memory meanwhile;
4. :meth:`PendingCopy.wait` (called by the writer's background thread) blocks on the end event and returns
   the staging views, which the thread copies into the shared-memory segment.

The staging buffer is allocated once (pinned memory is slow to allocate) and grows when the state does;
one save at a time uses it (a save waits for the previous one's background part). Other devices use
:class:`BlockingCopier` (a plain synchronous copy). The unit tests drive the same interface with a fake
device.
"""

from __future__ import annotations

import base64
import ctypes
import io
import json
import logging
import math
import mmap
import os
import struct
import threading
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from elastic import errors
from elastic.checkpoint import digest, hostmem, layout
from elastic.checkpoint.segments import Acquired, Segment, SegmentPool

# -- the format -------------------------------------------------------------------------------------
MAGIC = digest.MAGIC
VERSION = digest.VERSION
#: magic, version, reserved, step, size, json size, data offset, content id, digest
HEADER = digest.HEADER
TRAILER_SIZE = digest.TRAILER_SIZE
_DIGEST_AT = digest.HEADER_V1.size  # the digest's offset in the header
STORAGE_ALIGN = 64  # a cache line: aligned copies in and out
DATA_ALIGN = 4096  # a page: the tensor bytes never share a page with the header

_DTYPES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _value = getattr(torch, _name)
    if isinstance(_value, torch.dtype):
        _canonical = str(_value).removeprefix("torch.")
        if _canonical.startswith(("qint", "quint")):
            continue  # quantized tensors need their scale and zero point: not described here
        _DTYPES[_canonical] = _value


#: The bytes of a file: read, received, or mapped (:func:`elastic.checkpoint.layout.map_shared`).
Buffer = bytes | bytearray | memoryview | mmap.mmap


class Unsupported(errors.CheckpointError):
    """The state holds something this format does not describe; save it with torch.save instead."""


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def is_flash(data: Buffer) -> bool:
    """True when ``data`` starts like a file of this format (it may still be damaged)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


# -- planning a save --------------------------------------------------------------------------------
@dataclass(slots=True)  # not frozen: made per storage at every save, and frozen init is slower
class StorageSlot:
    """One storage to copy: where in the file, how many bytes, and its bytes as a uint8 tensor."""

    offset: int
    nbytes: int
    source: torch.Tensor  # 1-D uint8 view of the whole storage, on the storage's device
    end: int = 0  # where the next storage (or the trailer) starts: the bytes between are zero-filled


@dataclass(frozen=True)
class Plan:
    """Everything a save writes, except the storage bytes themselves."""

    meta: bytes
    data_offset: int
    size: int
    storages: tuple[StorageSlot, ...]

    def header(self, step: int, content_id: bytes) -> bytes:
        """The header, with a zero digest (:func:`write_digest` fills it in once the bytes are in)."""
        meta, offset = len(self.meta), self.data_offset
        return HEADER.pack(MAGIC, VERSION, 0, step, self.size, meta, offset, content_id, bytes(16))


def new_content_id() -> bytes:
    """16 random bytes naming one save: two files of one step number are told apart by it."""
    return uuid.uuid4().bytes


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
#: A str as a JSON string literal, quoted and escaped (json's own C function).
_json_str = json.encoder.encode_basestring_ascii


def _float(value: float) -> str:
    if math.isfinite(value):
        return float.__repr__(value)
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")  # json's spellings


class _Describer:
    """Walks a state once, writing the JSON of its tagged tree and of its tensors, and collecting their
    storages (deduplicated).

    It runs at every save on every tensor of the state (hundreds for a real model), so it writes JSON
    text fragments rather than building a tree of dicts and lists for ``json.dumps``: strings are not
    tracked by the garbage collector, and the containers a big state needs made the collector run (and
    scan the whole heap) inside the save."""

    def __init__(self) -> None:
        self.out: list[str] = []  # the tree's JSON, in fragments
        self.tensors: list[str] = []  # each tensor's JSON record
        #: (storage, its bytes, its location), in order of first use.
        self.storages: list[tuple[torch.UntypedStorage, int, str]] = []
        self._storage_index: dict[tuple[str, int, int], int] = {}

    def encode(self, obj: Any) -> None:
        out, kind = self.out, type(obj)
        if kind is str:
            out.append(_json_str(obj))
        elif obj is None:
            out.append("null")
        elif kind is bool:
            out.append("true" if obj else "false")
        elif kind is int:
            out.append(int.__repr__(obj))
        elif kind is float:
            out.append(_float(obj))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            out.append(f'{{"t":{self._tensor(obj)}}}')
        elif kind is dict:
            self._pairs("D", obj)
            out.append("}")
        elif kind is OrderedDict:
            self._pairs("O", obj)
            metadata = getattr(obj, "_metadata", None)  # a module state_dict's versions
            if metadata is not None:
                out.append(',"m":')
                self.encode(metadata)
            out.append("}")
        elif kind is list or kind is tuple:
            out.append('{"L":[' if kind is list else '{"T":[')
            for i, value in enumerate(obj):
                if i:
                    out.append(",")
                self.encode(value)
            out.append("]}")
        elif kind is torch.Size:
            out.append(json.dumps({"S": list(obj)}))
        elif kind is bytes:
            out.append(json.dumps({"B": base64.b64encode(obj).decode()}))
        elif kind is torch.dtype:
            out.append(json.dumps({"dt": str(obj).removeprefix("torch.")}))
        elif kind is torch.device:
            out.append(json.dumps({"dv": str(obj)}))
        else:
            raise Unsupported(f"{kind.__module__}.{kind.__qualname__} values")

    def _pairs(self, tag: str, mapping: dict[Any, Any]) -> None:
        """``{"<tag>":[[k,v],...]`` (the caller closes the object)."""
        out = self.out
        out.append(f'{{"{tag}":[')
        for i, (key, value) in enumerate(mapping.items()):
            out.append(",[" if i else "[")
            self.encode(key)
            out.append(",")
            self.encode(value)
            out.append("]")
        out.append("]")

    def _tensor(self, t: torch.Tensor) -> int:
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            raise Unsupported(f"{t.layout} / quantized / nested / meta tensors")
        if t.is_conj() or t.is_neg():
            raise Unsupported("tensors with a lazy conjugate or negative bit")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise Unsupported(f"dtype {t.dtype}")
        storage = t.untyped_storage()
        location = "cpu" if t.is_cpu else str(t.device)
        nbytes = storage.nbytes()
        key = (location, storage.data_ptr(), nbytes)
        index = self._storage_index.get(key)
        if index is None:
            index = self._storage_index[key] = len(self.storages)
            self.storages.append((storage, nbytes, location))
        shape = ",".join(map(str, t.shape))
        stride = ",".join(map(str, t.stride()))
        param = type(t) is torch.nn.Parameter
        flags = f"{'true' if t.requires_grad else 'false'},{'true' if param else 'false'}"
        self.tensors.append(f'[{index},"{name}",[{shape}],[{stride}],{t.storage_offset()},{flags}]')
        return len(self.tensors) - 1


def plan(state: dict[str, Any]) -> Plan:
    """Describe ``state`` for a save; raises :class:`Unsupported` for what only torch.save can write."""
    describer = _Describer()
    try:
        describer.encode(state)
    except RecursionError:
        raise Unsupported("a state nested too deeply") from None
    except ValueError as exc:  # e.g. an int of more digits than Python converts to text
        raise Unsupported(f"a value JSON cannot hold: {exc}") from None
    records: list[tuple[int, int, str]] = []  # JSON arrays
    position = 0
    for _, nbytes, location in describer.storages:
        records.append((position, nbytes, location))
        position = _align(position + nbytes, STORAGE_ALIGN)
    meta = "".join(
        ['{"tree":', *describer.out, ',"storages":', json.dumps(records), ',"tensors":[']
        + [",".join(describer.tensors), "]}"]
    ).encode()
    data_offset = _align(HEADER.size + len(meta), DATA_ALIGN)
    slots: list[StorageSlot] = []
    devices: dict[str, torch.device] = {}
    for (offset, nbytes, _), (storage, _, location) in zip(records, describer.storages, strict=True):
        device = devices.get(location) or devices.setdefault(location, torch.device(location))
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        start = data_offset + offset
        slots.append(StorageSlot(start, nbytes, source, _align(start + nbytes, STORAGE_ALIGN)))
    return Plan(meta, data_offset, data_offset + position + TRAILER_SIZE, tuple(slots))


# -- loading ----------------------------------------------------------------------------------------
MapLocation = Any  # None, str, torch.device, dict of location strings, or callable(storage, location)


def _target_device(location: str, map_location: MapLocation) -> torch.device | None:
    """Where a storage saved on ``location`` goes (torch.load's rules); None: a callable decides."""
    if map_location is None:
        return torch.device(location)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(location, location))
    return None


def _load_storage(
    data: Buffer, offset: int, nbytes: int, location: str, map_location: MapLocation
) -> torch.UntypedStorage:
    # One copy, from the file's bytes (mapped, where they lie) into memory of the restored tensor's own:
    # never a view of a segment the next save recycles. Fresh memory, faulted in huge pages (hostmem).
    host = hostmem.empty(nbytes)
    if nbytes:
        with warnings.catch_warnings():
            # frombuffer warns that bytes are read-only: they are only read, into a fresh tensor.
            warnings.simplefilter("ignore", UserWarning)
            host.copy_(torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset))
    return _place(host, location, map_location)


def _place(host: torch.Tensor, location: str, map_location: MapLocation) -> torch.UntypedStorage:
    """The storage of the restored bytes ``host`` where ``map_location`` puts a storage of ``location``."""
    device = _target_device(location, map_location)
    if device is None:
        mapped = map_location(host.untyped_storage(), location)
        if mapped is None:
            return host.untyped_storage()
        # torch.load's callables may return a typed or an untyped storage.
        return mapped if isinstance(mapped, torch.UntypedStorage) else mapped.untyped_storage()
    return host.untyped_storage() if device.type == "cpu" else host.to(device).untyped_storage()


def _tensors(records: list[Any], loaded: list[Any]) -> list[torch.Tensor]:
    """The described tensors, each a view of its loaded storage (parameters as parameters)."""
    tensors = []
    for index, dtype, shape, stride, offset, requires_grad, is_param in records:
        storage = loaded[index]
        tensor = torch.empty(0, dtype=_DTYPES[dtype], device=storage.device)
        tensor.set_(storage, offset, shape, stride)
        if is_param:
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(requires_grad))
        elif requires_grad:
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


def _check_view(record: list[Any], storages: list[tuple[int, int, str]]) -> None:
    index, dtype, shape, stride, offset = record[:5]
    if not (isinstance(index, int) and 0 <= index < len(storages)) or dtype not in _DTYPES:
        raise ValueError(f"bad tensor record {record[:2]}")
    if len(shape) != len(stride) or not all(isinstance(v, int) and v >= 0 for v in [*shape, *stride, offset]):
        raise ValueError(f"bad tensor shape {shape} / stride {stride} / offset {offset}")
    itemsize = _DTYPES[dtype].itemsize
    if 0 not in shape:
        last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
        if (last + 1) * itemsize > storages[index][1]:
            raise ValueError(f"a tensor reaches past its storage ({storages[index][1]} bytes)")


class _Decoder:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise ValueError(f"bad tree node of type {type(node).__name__}")
        if "D" in node:
            return {self._key(k): self.decode(v) for k, v in node["D"]}
        if "O" in node:
            out = OrderedDict((self._key(k), self.decode(v)) for k, v in node["O"])
            if "m" in node:
                out._metadata = self.decode(node["m"])  # type: ignore[attr-defined]  # as torch's state_dict sets it
            return out
        if "L" in node:
            return [self.decode(v) for v in node["L"]]
        if "T" in node:
            return tuple(self.decode(v) for v in node["T"])
        if "S" in node:
            return torch.Size([int(v) for v in node["S"]])
        if "B" in node:
            return base64.b64decode(node["B"], validate=True)
        if "dt" in node:
            return _DTYPES[node["dt"]]
        if "dv" in node:
            return torch.device(node["dv"])
        if "t" in node:
            return self.tensors[node["t"]]
        raise ValueError(f"unknown tree tag {sorted(node)}")

    def _key(self, node: Any) -> Any:
        key = self.decode(node)
        hash(key)  # TypeError for an unhashable key
        return key


def parse_flash(data: Buffer, map_location: MapLocation = None) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from the bytes of a flash file; ValueError for anything torn or malformed, and
    :class:`~elastic.checkpoint.digest.CheckpointCorruptError` (a ValueError too) for bytes that do not
    match the file's digest, checked before any tensor is built (a version-1 file has none)."""
    header = digest.verify(data)
    step, size, meta_size, data_offset = header.step, header.size, header.meta_size, header.data_offset
    try:
        description = json.loads(bytes(data[header.end : header.end + meta_size]))
        storages = [(int(o), int(n), str(loc)) for o, n, loc in description["storages"]]
        for offset, nbytes, _ in storages:
            if offset < 0 or nbytes < 0 or data_offset + offset + nbytes > size - TRAILER_SIZE:
                raise ValueError("a storage lies outside the file")
        records = description["tensors"]
        for record in records:
            _check_view(record, storages)
        loaded = [_load_storage(data, data_offset + o, n, loc, map_location) for o, n, loc in storages]
        state = _Decoder(_tensors(records, loaded)).decode(description["tree"])
    except (KeyError, TypeError, IndexError, RecursionError, RuntimeError) as exc:
        raise ValueError(f"malformed flash checkpoint description: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError("malformed flash checkpoint: the state is not a dict")
    return state, step


def _read_exactly(f: BinaryIO, view: memoryview) -> None:
    while len(view):
        n = f.readinto(view)  # type: ignore[attr-defined]  # any binary file
        if not n:
            raise ValueError("torn flash checkpoint: it ended early")
        view = view[n:]


def read_flash_file(f: BinaryIO, map_location: MapLocation = None) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from an open file written by ``elastic.save``, each storage *read* straight into
    its restored tensor's memory (``readinto``: the kernel copies from the page cache, with no page tables
    to fill for a mapping of the source) and hashed right after its read, the digest checked before any
    tensor is returned (:class:`~elastic.checkpoint.digest.CheckpointCorruptError` otherwise): the bytes
    restored are the bytes verified. Files of another shape (version 1, torch.save, storages out of
    order) are read whole and parsed by :func:`parse`."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(HEADER.size)
    if not is_flash(head) or len(head) < HEADER.size or struct.unpack_from("<I", head, 8)[0] != VERSION:
        f.seek(0)
        return parse(f.read(), map_location)
    header = digest.read_header(head, size)
    frame = f.read(header.data_offset - header.end)  # the description and the zeros up to the data
    if len(frame) != header.data_offset - header.end:
        raise ValueError("torn flash checkpoint: it ended early")
    hasher = digest.hasher()
    hasher.update(head[: digest.DIGESTED_HEADER])
    hasher.update(frame)
    try:
        description = json.loads(frame[: header.meta_size])
        storages = [(int(o), int(n), str(loc)) for o, n, loc in description["storages"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed flash checkpoint description: {type(exc).__name__}: {exc}") from None
    end = size - TRAILER_SIZE
    position = header.data_offset
    for offset, nbytes, _ in storages:
        if offset < 0 or nbytes < 0 or header.data_offset + offset < position or position > end:
            f.seek(0)  # overlapping or out of order (no writer of ours does that): the general parse
            return parse(f.read(), map_location)
        position = header.data_offset + offset + nbytes
    if position > end:
        raise ValueError("a storage lies outside the file")
    hosts: list[torch.Tensor] = []
    position = header.data_offset
    for offset, nbytes, _ in storages:
        start = header.data_offset + offset
        if start > position:  # the zeros between two storages
            gap = f.read(start - position)
            hasher.update(gap)
            if len(gap) != start - position:
                raise ValueError("torn flash checkpoint: it ended early")
        host = hostmem.empty(nbytes)
        if nbytes:
            buffer = (ctypes.c_char * nbytes).from_address(host.data_ptr())
            with memoryview(buffer) as view, view.cast("B") as flat:
                _read_exactly(f, flat)
                hasher.update(flat)
        hosts.append(host)
        position = start + nbytes
    rest = f.read(end - position)
    trailer = f.read(TRAILER_SIZE)
    if len(rest) != end - position or trailer != header.content_id:
        raise ValueError("torn flash checkpoint: its trailer does not match its header")
    hasher.update(rest)
    computed = hasher.digest()
    if header.digest is not None and computed != header.digest:
        what = getattr(f, "name", "flash checkpoint")
        raise digest.CheckpointCorruptError(str(what), digest.text(header.digest), digest.text(computed))
    return _build(description, header.step, storages, hosts, map_location)


def _build(
    description: dict[str, Any],
    step: int,
    storages: list[tuple[int, int, str]],
    hosts: list[torch.Tensor],
    map_location: MapLocation,
) -> tuple[dict[str, Any], int]:
    """The state from a verified description and its storages' bytes (one host tensor per storage)."""
    try:
        records = description["tensors"]
        for record in records:
            _check_view(record, storages)
        loaded = [_place(host, loc, map_location) for host, (_, _, loc) in zip(hosts, storages, strict=True)]
        state = _Decoder(_tensors(records, loaded)).decode(description["tree"])
    except (KeyError, TypeError, IndexError, RecursionError, RuntimeError, ValueError) as exc:
        raise ValueError(f"malformed flash checkpoint description: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError("malformed flash checkpoint: the state is not a dict")
    return state, step


def parse(data: Buffer, map_location: MapLocation = None) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from a file written by ``elastic.save``: this format, or torch.save's."""
    if is_flash(data):
        return parse_flash(data, map_location)
    return parse_torch(data, map_location)


def parse_torch(data: Buffer, map_location: MapLocation) -> tuple[dict[str, Any], int]:
    """A torch.save file of ``{"step", "state"}``, loaded with ``weights_only=True``: unpickling may
    only rebuild tensors, primitives and containers, never run code."""
    payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    if not (
        isinstance(payload, dict)
        and isinstance(payload.get("step"), int)
        and isinstance(payload.get("state"), dict)
    ):
        raise ValueError("not a checkpoint written by elastic.save")
    return payload["state"], payload["step"]


def write_frame(buffer: Any, plan_: Plan, step: int, content_id: bytes) -> None:
    """Write the header (its digest zero), description, the zeros up to the data and the trailer of
    ``plan_`` into ``buffer`` (writable, ``plan_.size`` bytes); the storages' bytes are the caller's to
    copy (at once from host memory, later from a device), then :func:`seal` (or :func:`write_digest`)."""
    view = memoryview(buffer)
    try:
        header = plan_.header(step, content_id)
        view[: len(header)] = header
        meta_end = HEADER.size + len(plan_.meta)
        view[HEADER.size : meta_end] = plan_.meta
        view[meta_end : plan_.data_offset] = bytes(plan_.data_offset - meta_end)  # a recycled segment's
        view[plan_.size - TRAILER_SIZE : plan_.size] = content_id
    finally:
        view.release()


def frame_hasher(buffer: Any, plan_: Plan) -> Any:
    """A digest hasher fed with the frame :func:`write_frame` wrote (header, description, padding); the
    storages' bytes follow (:func:`hash_slot`, in file order)."""
    hasher = digest.hasher()
    with memoryview(buffer) as view:
        hasher.update(view[: digest.DIGESTED_HEADER])
        hasher.update(view[HEADER.size : plan_.data_offset])
    return hasher


def hash_slot(hasher: Any, buffer: Any, slot: StorageSlot) -> None:
    """Zero the gap after ``slot``'s bytes (copied into ``buffer``) and feed them and the gap to
    ``hasher``: right after the copy, while the bytes are still in the CPU's cache."""
    end = slot.offset + slot.nbytes
    with memoryview(buffer) as view:
        if slot.end > end:
            view[end : slot.end] = bytes(slot.end - end)
        hasher.update(view[slot.offset : slot.end])


def write_digest(buffer: Any, raw: bytes) -> None:
    """Write the 16-byte digest into the header of the flash file in ``buffer``."""
    with memoryview(buffer) as view:
        view[_DIGEST_AT : _DIGEST_AT + digest.DIGEST_SIZE] = raw


def seal(buffer: Any, plan_: Plan) -> bytes:
    """Zero every gap between the storages of ``plan_`` in ``buffer``, then compute the digest of the
    whole file and write it into the header (the device path, once every copy is in); returns it."""
    hasher = frame_hasher(buffer, plan_)
    for slot in plan_.storages:
        hash_slot(hasher, buffer, slot)
    raw: bytes = hasher.digest()
    write_digest(buffer, raw)
    return raw


# -- device-to-host copies --------------------------------------------------------------------------
_ALIGN = 64


class PendingCopy(Protocol):
    def wait(self) -> list[torch.Tensor]:
        """Block until the copies are done; the host copies (1-D uint8), in the order of the sources."""
        ...


class DeviceCopier(Protocol):
    def handles(self, device: torch.device) -> bool:
        """Whether storages on ``device`` go through this copier."""
        ...

    def start(self, sources: Sequence[torch.Tensor]) -> PendingCopy:
        """Start copying ``sources`` (1-D uint8 device tensors) to host memory; return at once."""
        ...


class _Done:
    def __init__(self, hosts: list[torch.Tensor]) -> None:
        self._hosts = hosts

    def wait(self) -> list[torch.Tensor]:
        return self._hosts


class BlockingCopier:
    """Any device torch can copy from: synchronous, for devices without a CUDA-style stream API."""

    def handles(self, device: torch.device) -> bool:
        return device.type != "cpu"

    def start(self, sources: Sequence[torch.Tensor]) -> PendingCopy:
        return _Done([source.to("cpu") for source in sources])


class _CudaPending:
    def __init__(self, done: torch.cuda.Event, hosts: list[torch.Tensor]) -> None:
        self._done, self._hosts = done, hosts

    def wait(self) -> list[torch.Tensor]:
        self._done.synchronize()
        return self._hosts


class CudaCopier:
    """Asynchronous copies from one CUDA device into a reused pinned staging buffer (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None

    def handles(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.device(device).index == self.device.index

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old buffer before pinning a bigger one
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging

    def start(self, sources: Sequence[torch.Tensor]) -> PendingCopy:
        offsets, total = [], 0
        for source in sources:
            offsets.append(total)
            total += (source.numel() + _ALIGN - 1) // _ALIGN * _ALIGN
        staging = self._staging_for(total)
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            current = torch.cuda.current_stream()
            ready = torch.cuda.Event()
            ready.record(current)
            self._stream.wait_event(ready)
            hosts = []
            with torch.cuda.stream(self._stream):
                for source, offset in zip(sources, offsets, strict=True):
                    host = staging[offset : offset + source.numel()]
                    host.copy_(source, non_blocking=True)
                    source.record_stream(self._stream)
                    hosts.append(host)
            done = torch.cuda.Event()
            done.record(self._stream)
            current.wait_event(done)
        return _CudaPending(done, hosts)


_cuda_copiers: dict[int, CudaCopier] = {}


def copier_for(device: torch.device) -> DeviceCopier:
    """The copier of a non-CPU device: asynchronous for CUDA, synchronous for others."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _cuda_copiers:
            _cuda_copiers[index] = CudaCopier(torch.device("cuda", index))
        return _cuda_copiers[index]
    return BlockingCopier()


# -- the writer -------------------------------------------------------------------------------------
log = logging.getLogger(__name__)


class AsyncSaveError(errors.CheckpointError):
    """The background part of an earlier save (device copies, commit) failed; that save is lost."""


@dataclass(frozen=True)
class SaveStats:
    """What one save cost; the first save pays for the segments' pages (``prefault_s``)."""

    step: int
    size: int
    fresh_bytes: int  # shared memory newly allocated (this save's segment and the spare)
    prefault_s: float  # seconds spent faulting that memory in
    asynchronous: bool  # device copies were still running when save returned


class FlashWriter:
    """Writes flash saves into one folder; see the module doc."""

    def __init__(
        self,
        directory: Path,
        keep: int,
        free_bytes: Callable[[Path], int],
        copier: DeviceCopier | None = None,
    ) -> None:
        self.directory = directory
        self.pool = SegmentPool(directory, keep, free_bytes)
        #: Claims the storages of the devices it handles (tests: a fake device); else per device type.
        self.copier = copier
        self.history: list[SaveStats] = []  # the first save and the last few
        self._lock = threading.Lock()
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None

    def save(self, state: dict[str, Any], step: int, on_commit: Callable[[], None]) -> Path:
        """Write ``state`` as ``step_<step>.pt``; ``on_commit()`` runs once it is visible.

        Raises:
            Unsupported: the state needs torch.save (nothing was written).
            segments.NoSpaceError: the folder cannot hold it (nothing was written).
            AsyncSaveError: the previous save's background part failed.
        """
        self.wait()
        frame = plan(state)
        final = self.directory / layout.step_file_name(step)
        with self._lock:
            acquired = self.pool.acquire(final, frame.size)
            segment = acquired.segment
            device_slots: dict[DeviceCopier, list[StorageSlot]] = {}
            try:
                assert segment.mm is not None
                buffer = segment.mm
                host_slots: list[StorageSlot] = []
                for slot in frame.storages:
                    if not slot.nbytes:
                        continue  # an empty storage: nothing to copy
                    copier = self._copier(slot.source.device)
                    (host_slots if copier is None else device_slots.setdefault(copier, [])).append(slot)
                write_frame(buffer, frame, step, new_content_id())
                # The digest as the bytes go in: host storages are hashed right after their copy, unless
                # device storages come later (their background thread then hashes the file in order).
                hasher = None if device_slots else frame_hasher(buffer, frame)
                for slot in host_slots:
                    _destination(buffer, slot).copy_(slot.source)
                    if hasher is not None:
                        hash_slot(hasher, buffer, slot)
                if hasher is not None:
                    write_digest(buffer, hasher.digest())
                pending = [
                    (copier.start([s.source for s in slots]), slots) for copier, slots in device_slots.items()
                ]
            except BaseException:
                self.pool.abort(segment)
                raise
            if not pending:
                spare = self._commit(segment, final, frame.size, on_commit)
            else:
                spare = None
                self._background = threading.Thread(
                    target=self._finish,
                    args=(segment, final, frame, pending, on_commit),
                    name=f"elastic-flash-save-{step}",
                )
                self._background.start()
        self._record(step, frame.size, acquired, spare, bool(pending))
        return final

    def wait(self) -> None:
        """Wait for the background part of the last save; raise AsyncSaveError if it failed."""
        thread = self._background
        if thread is not None:
            thread.join()
            self._background = None
        error, self._background_error = self._background_error, None
        if error is not None:
            raise AsyncSaveError(f"an earlier flash save failed in the background: {error}") from error

    def forget_removed(self) -> None:
        """Unmap segments whose files were removed meanwhile (e.g. pruned by a torch.save fallback)."""
        with self._lock:
            self.pool.forget_removed()

    def close(self) -> None:
        """Wait for the background part, then unmap every segment (their files stay)."""
        try:
            self.wait()
        finally:
            with self._lock:
                self.pool.close()

    # -- internals -------------------------------------------------------------------------------
    def _copier(self, device: torch.device) -> DeviceCopier | None:
        if self.copier is not None and self.copier.handles(device):
            return self.copier
        return None if device.type == "cpu" else copier_for(device)

    def _commit(
        self, segment: Segment, final: Path, size: int, on_commit: Callable[[], None]
    ) -> Acquired | None:
        held = self.pool.commit(segment, final)
        # The first save (or the first after the folder lost files): pre-fault the double buffer's
        # second segment now, so the next save recycles instead of faulting fresh pages in.
        spare = self.pool.ensure_double_buffer(size, held)
        on_commit()  # last: the agent's persist starts on this report and competes for the CPU
        return spare

    def _finish(
        self,
        segment: Segment,
        final: Path,
        frame: Plan,
        pending: list[tuple[PendingCopy, list[StorageSlot]]],
        on_commit: Callable[[], None],
    ) -> None:
        size = frame.size
        with self._lock:
            try:
                assert segment.mm is not None
                for copy, slots in pending:
                    for slot, host in zip(slots, copy.wait(), strict=True):
                        _destination(segment.mm, slot).copy_(host)
                seal(segment.mm, frame)  # every storage is in: the digest, in file order
            except BaseException as exc:  # noqa: BLE001 - reported to the next save or wait()
                log.error("flash save of %s failed in the background: %s", final.name, exc)
                self._background_error = exc
                self.pool.abort(segment)
                return
            try:
                self._commit(segment, final, size, on_commit)
            except BaseException as exc:  # noqa: BLE001 - the rename failed (nothing published) or later
                log.error("flash save of %s failed in the background: %s", final.name, exc)
                self._background_error = exc

    def _record(
        self, step: int, size: int, acquired: Acquired, spare: Acquired | None, pending: bool
    ) -> None:
        fresh = acquired.fresh_bytes + (spare.fresh_bytes if spare else 0)
        seconds = acquired.prefault_s + (spare.prefault_s if spare else 0.0)
        stats = SaveStats(step, size, fresh, seconds, pending)
        if fresh:
            log.info(
                "flash save of step %d: %.1f MiB of shared memory allocated and pre-faulted in %.2f s",
                step,
                fresh / (1 << 20),
                seconds,
            )
        self.history = [*self.history[:1], *self.history[1:][-7:], stats]


def _destination(buffer: Any, slot: StorageSlot) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)


_writers: dict[Path, FlashWriter] = {}
_writers_lock = threading.Lock()


def writer_for(directory: Path, keep: int, free_bytes: Callable[[Path], int]) -> FlashWriter:
    """This process's writer of ``directory`` (made on first use; its segments stay mapped)."""
    key = directory.resolve()
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = FlashWriter(directory, keep, free_bytes)
        return writer


def wait_all() -> None:
    """Wait for every writer's background part (before a load reads the folder)."""
    for writer in list(_writers.values()):
        writer.wait()


def close_all() -> None:
    """Close every writer: unmap the segments, so their memory goes once their files are removed."""
    with _writers_lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        writer.close()


def history(directory: Path) -> list[SaveStats]:
    """What this process's saves into ``directory`` cost: the first save and the last few ([]: none)."""
    writer = _writers.get(Path(directory).resolve())
    return list(writer.history) if writer is not None else []
