"""The raw format of flash (shared-memory) checkpoints: a small header, a JSON tree, then tensor bytes.

``torch.save`` pickles the state and writes each storage through a zip writer; a flash save instead
copies each tensor storage's bytes straight into a pre-faulted shared-memory segment (see
:mod:`elastic.checkpoint.flash_save`), so the file is laid out for that copy::

    offset 0     header (64 bytes): magic, version, step, total size, JSON size, data offset, content id
    offset 64    JSON description: {"tree": ..., "storages": [...], "tensors": [...]}
    data offset  storage bytes, each at a 64-byte aligned offset (data offset is page aligned)
    size - 16    the content id again (a trailer: a file cut short or mixed from two saves is rejected)

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
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from elastic import errors

MAGIC = b"\x89ELFLSH\n"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQ16s")  # magic, version, reserved, step, size, json size, data offset, id
TRAILER_SIZE = 16
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


class Unsupported(errors.CheckpointError):
    """The state holds something this format does not describe; save it with torch.save instead."""


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def is_flash(data: bytes | memoryview) -> bool:
    """True when ``data`` starts like a file of this format (it may still be damaged)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


# -- planning a save ---------------------------------------------------------------------------------
@dataclass(slots=True)  # not frozen: made per storage at every save, and frozen init is slower
class StorageSlot:
    """One storage to copy: where in the file, how many bytes, and its bytes as a uint8 tensor."""

    offset: int
    nbytes: int
    source: torch.Tensor  # 1-D uint8 view of the whole storage, on the storage's device


@dataclass(frozen=True)
class Plan:
    """Everything a save writes, except the storage bytes themselves."""

    meta: bytes
    data_offset: int
    size: int
    storages: tuple[StorageSlot, ...]

    def header(self, step: int, content_id: bytes) -> bytes:
        return HEADER.pack(MAGIC, VERSION, 0, step, self.size, len(self.meta), self.data_offset, content_id)


def new_content_id() -> bytes:
    """16 random bytes naming one save: two files of one step number are told apart by it."""
    return uuid.uuid4().bytes


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
#: A str as a JSON string literal, quoted and escaped (json's own C function).
_json_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


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
    records, position = [], 0
    for _, nbytes, location in describer.storages:
        records.append([position, nbytes, location])
        position = _align(position + nbytes, STORAGE_ALIGN)
    meta = "".join(
        ['{"tree":', *describer.out, ',"storages":', json.dumps(records), ',"tensors":[']
        + [",".join(describer.tensors), "]}"]
    ).encode()
    data_offset = _align(HEADER.size + len(meta), DATA_ALIGN)
    slots, devices = [], {}
    for (offset, nbytes, _), (storage, _, location) in zip(records, describer.storages, strict=True):
        device = devices.get(location) or devices.setdefault(location, torch.device(location))
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        slots.append(StorageSlot(data_offset + offset, nbytes, source))
    return Plan(meta, data_offset, data_offset + position + TRAILER_SIZE, tuple(slots))


# -- loading -----------------------------------------------------------------------------------------
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
    data: bytes | memoryview, offset: int, nbytes: int, location: str, map_location: MapLocation
) -> torch.UntypedStorage:
    host = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        with warnings.catch_warnings():
            # frombuffer warns that bytes are read-only: they are only read, into a fresh tensor.
            warnings.simplefilter("ignore", UserWarning)
            host.copy_(torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset))
    device = _target_device(location, map_location)
    if device is None:
        mapped = map_location(host.untyped_storage(), location)
        if mapped is None:
            return host.untyped_storage()
        # torch.load's callables may return a typed or an untyped storage.
        return mapped if isinstance(mapped, torch.UntypedStorage) else mapped.untyped_storage()
    return host.untyped_storage() if device.type == "cpu" else host.to(device).untyped_storage()


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
                out._metadata = self.decode(node["m"])  # type: ignore[attr-defined]
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


def parse_flash(data: bytes | memoryview, map_location: MapLocation = None) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from the bytes of a flash file; ValueError for anything torn or malformed."""
    if len(data) < HEADER.size + TRAILER_SIZE:
        raise ValueError(f"a flash checkpoint of {len(data)} bytes is cut short")
    magic, version, _, step, size, meta_size, data_offset, content_id = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a flash checkpoint (bad magic)")
    if version != VERSION:
        raise ValueError(f"flash checkpoint version {version} is not supported (this reader: {VERSION})")
    if size != len(data):
        raise ValueError(f"torn flash checkpoint: {len(data)} bytes, the header says {size}")
    if bytes(data[size - TRAILER_SIZE :]) != content_id:
        raise ValueError("torn flash checkpoint: its trailer does not match its header")
    if not HEADER.size + meta_size <= data_offset <= size - TRAILER_SIZE:
        raise ValueError("bad flash checkpoint header (sizes out of range)")
    try:
        description = json.loads(bytes(data[HEADER.size : HEADER.size + meta_size]))
        storages = [(int(o), int(n), str(loc)) for o, n, loc in description["storages"]]
        for offset, nbytes, _ in storages:
            if offset < 0 or nbytes < 0 or data_offset + offset + nbytes > size - TRAILER_SIZE:
                raise ValueError("a storage lies outside the file")
        records = description["tensors"]
        for record in records:
            _check_view(record, storages)
        loaded = [_load_storage(data, data_offset + o, n, loc, map_location) for o, n, loc in storages]
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
        state = _Decoder(tensors).decode(description["tree"])
    except (KeyError, TypeError, IndexError, RecursionError, RuntimeError) as exc:
        raise ValueError(f"malformed flash checkpoint description: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError("malformed flash checkpoint: the state is not a dict")
    return state, step


def parse(data: bytes | memoryview, map_location: MapLocation = None) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from a file written by ``elastic.save``: this format, or torch.save's."""
    if is_flash(data):
        return parse_flash(data, map_location)
    return parse_torch(data, map_location)


def parse_torch(data: bytes | memoryview, map_location: MapLocation) -> tuple[dict[str, Any], int]:
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
    """Write the header, description and trailer of ``plan_`` into ``buffer`` (writable, ``plan_.size``
    bytes); the storages' bytes are the caller's to copy (at once from host memory, later from a device)."""
    view = memoryview(buffer)
    try:
        header = plan_.header(step, content_id)
        view[: len(header)] = header
        view[HEADER.size : HEADER.size + len(plan_.meta)] = plan_.meta
        view[plan_.size - TRAILER_SIZE : plan_.size] = content_id
    finally:
        view.release()
