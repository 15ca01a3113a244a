"""torch's file format, written without torch: a flash checkpoint turned into a ``torch.save`` file.

A persisted checkpoint must load without this project: ``torch.load(path, weights_only=True)``. The
agent persists the worker's flash files (:mod:`elastic.checkpoint.flash`) and never imports torch, so this
module writes torch's zip serialization format with the standard library only, from a flash file's
description (JSON) and its storage bytes, streamed (a checkpoint may be larger than the agent's memory).

**torch's format** (``torch/serialization.py``, ``_save``; format version 1, storage alignment 64), as
``torch.save`` writes it and ``torch.load`` reads it::

    archive/data.pkl                  a protocol-2 pickle of the object tree; each storage is a
                                      persistent id ('storage', <storage class>, '<key>', '<location>', numel)
    archive/.format_version           "1"
    archive/.storage_alignment        "64"
    archive/byteorder                 "little"
    archive/data/<key>                each storage's raw bytes, at a 64-byte aligned file offset
    archive/version                   "3"
    archive/.data/serialization_id    40 digits

Every entry is stored (not compressed), its local header padded with an extra field (id ``FB``) so that
its data starts aligned, followed by a data descriptor (CRC-32 and sizes, so that nothing is written
twice); the archive ends with a zip64 end record, as torch's own writer ends it. Entries of 4 GiB or more,
or lying beyond 4 GiB, get zip64 fields.

**The pickle** holds only what ``weights_only=True`` rebuilds (``torch/_weights_only_unpickler.py``):
tensors as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`` with a
typed storage class for the dtypes that have one (``FloatStorage``...) and ``_rebuild_tensor_v3(...,
dtype)`` with ``UntypedStorage`` for the others (``uint16``, the float8s...) and for a storage that
tensors of two dtypes view; ``torch._utils._rebuild_parameter`` for parameters; ``collections.OrderedDict``
(with a state_dict's ``_metadata``), dicts, lists, tuples, ``torch.Size``, ``torch.device``, dtypes,
bytes (``_codecs.encode``), ints, floats, strings, bools and None. Views of one storage share it after
loading, as with ``torch.save``, even views of two dtypes (which ``torch.save`` refuses).

The payload is ``{"step": step, "state": state}``: what ``elastic.save``'s ``torch.save`` fallback has
always written, so :func:`elastic.load` reads both.

Standard library only (the agent never imports torch); the tests compare its output with ``torch.save``'s.
"""

from __future__ import annotations

import json
import re
import secrets
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from elastic import errors
from elastic.checkpoint import digest

# -- the flash file's frame (elastic.checkpoint.digest reads it; flash writes it) --------------------
FLASH_MAGIC = digest.MAGIC
FLASH_VERSION = digest.VERSION
#: magic, version, reserved, step, size, json size, data offset, content id, digest (version 2)
FLASH_HEADER = digest.HEADER
FLASH_TRAILER_SIZE = digest.TRAILER_SIZE

STORAGE_ALIGN = 64  # torch's default ``storage_alignment``
_ARCHIVE = "archive"
_ZIP64_LIMIT = 0xFFFFFFFF
#: The dtypes with a typed storage class, and their item sizes (torch.storage._dtype_to_storage_type_map).
_TYPED_STORAGES: dict[str, tuple[str, int]] = {
    "float64": ("DoubleStorage", 8),
    "float32": ("FloatStorage", 4),
    "float16": ("HalfStorage", 2),
    "int64": ("LongStorage", 8),
    "int32": ("IntStorage", 4),
    "int16": ("ShortStorage", 2),
    "int8": ("CharStorage", 1),
    "uint8": ("ByteStorage", 1),
    "bool": ("BoolStorage", 1),
    "bfloat16": ("BFloat16Storage", 2),
    "complex128": ("ComplexDoubleStorage", 16),
    "complex64": ("ComplexFloatStorage", 8),
}


class NotConvertible(errors.CheckpointError):
    """The flash file cannot be written in torch's format (damaged, a newer flash version, or a value
    torch's weights-only loader cannot hold); the caller keeps the flash bytes as they are."""


def is_flash(head: bytes) -> bool:
    """True when ``head`` (the file's first bytes) starts like a flash checkpoint."""
    return head[: len(FLASH_MAGIC)] == FLASH_MAGIC


# -- reading a flash file's frame -------------------------------------------------------------------
@dataclass(frozen=True)
class FlashFrame:
    """A flash file's step, description and where its storage bytes lie."""

    step: int
    description: dict[str, Any]
    data_offset: int
    size: int


def read_frame(src: BinaryIO) -> FlashFrame:
    """The frame of the flash file open as ``src`` (seekable); NotConvertible when it is not whole."""
    src.seek(0, 2)
    actual = src.tell()
    src.seek(0)
    head = src.read(FLASH_HEADER.size)
    if not is_flash(head):
        raise NotConvertible("not a flash checkpoint")
    try:
        header = digest.read_header(head, actual)  # version 1 or 2 (the digest is persist's to check)
    except ValueError as exc:
        text = str(exc)
        raise NotConvertible(text if "version" in text else f"a torn flash checkpoint ({text})") from None
    step, size, meta_size, data_offset = header.step, header.size, header.meta_size, header.data_offset
    src.seek(size - FLASH_TRAILER_SIZE)
    if src.read(FLASH_TRAILER_SIZE) != header.content_id:
        raise NotConvertible("a torn flash checkpoint (its trailer does not match its header)")
    src.seek(header.end)
    try:
        description = json.loads(src.read(meta_size))
    except ValueError as exc:
        raise NotConvertible(f"a flash checkpoint with a malformed description: {exc}") from None
    if not isinstance(description, dict):
        raise NotConvertible("a flash checkpoint with a malformed description")
    return FlashFrame(step, description, data_offset, size)


# -- the pickle -------------------------------------------------------------------------------------
_BINUNICODE, _GLOBAL, _REDUCE, _BUILD, _MARK = b"X", b"c", b"R", b"b", b"("
_EMPTY_DICT, _EMPTY_LIST, _EMPTY_TUPLE, _TUPLE = b"}", b"]", b")", b"t"
_SETITEMS, _APPENDS, _BINPERSID, _STOP = b"u", b"e", b"Q", b"."
_NONE, _TRUE, _FALSE, _BINFLOAT, _LONG1 = b"N", b"\x88", b"\x89", b"G", b"\x8a"


_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _global(module: str, name: str) -> bytes:
    return b"".join((_GLOBAL, module.encode(), b"\n", name.encode(), b"\n"))


def _dtype(name: object) -> bytes:
    """``torch.<name>``; a name that is not an identifier (a forged file's) could inject opcodes."""
    if not (isinstance(name, str) and _DTYPE_NAME.fullmatch(name)):
        raise NotConvertible(f"a bad dtype name {name!r}")
    return _global("torch", name)


def _str(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")  # as pickle writes str (JSON allows lone surrogates)
    return _BINUNICODE + struct.pack("<I", len(data)) + data


def _int(value: int) -> bytes:
    if 0 <= value < 0x100:
        return b"K" + bytes((value,))
    if 0 <= value < 0x10000:
        return b"M" + struct.pack("<H", value)
    if -0x80000000 <= value < 0x80000000:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    if len(data) > 0xFF:  # LONG4, the only longer form, is not among weights_only's opcodes
        raise NotConvertible("an int of more than 255 bytes")
    return _LONG1 + bytes((len(data),)) + data


_HOOKS = _global("collections", "OrderedDict") + _EMPTY_TUPLE + _REDUCE  # backward hooks: OrderedDict()


class _Pickler:
    """Writes the pickle of a flash description's tree (see the module doc)."""

    def __init__(self, description: dict[str, Any]) -> None:
        self.out: list[bytes] = []
        self.storages: list[tuple[int, int, str]] = [
            (int(o), int(n), str(loc)) for o, n, loc in description["storages"]
        ]
        self.tensors: list[list[Any]] = description["tensors"]
        # A storage gets a typed class only when every tensor on it has that one dtype (torch.load
        # types a storage by its first reference, so two dtypes on one typed storage would load wrong).
        dtypes: dict[int, set[str]] = {}
        for record in self.tensors:
            dtypes.setdefault(int(record[0]), set()).add(str(record[1]))
        self.typed: dict[int, tuple[str, int]] = {}
        for index, names in dtypes.items():
            typed = _TYPED_STORAGES.get(next(iter(names))) if len(names) == 1 else None
            if typed is not None and self.storages[index][1] % typed[1] == 0:
                self.typed[index] = typed

    def dumps(self, payload_step: int, tree: Any) -> bytes:
        self.out = [b"\x80\x02", _EMPTY_DICT, _MARK, _str("step"), _int(payload_step), _str("state")]
        self.encode(tree)
        self.out += [_SETITEMS, _STOP]
        return b"".join(self.out)

    def encode(self, node: Any) -> None:
        out = self.out
        if node is None:
            out.append(_NONE)
        elif node is True or node is False:
            out.append(_TRUE if node else _FALSE)
        elif type(node) is int:
            out.append(_int(node))
        elif type(node) is float:
            out.append(_BINFLOAT + struct.pack(">d", node))
        elif type(node) is str:
            out.append(_str(node))
        elif type(node) is dict and len(node) in (1, 2):
            self._tagged(node)
        else:
            raise NotConvertible(f"a malformed tree node of type {type(node).__name__}")

    def _tagged(self, node: dict[str, Any]) -> None:
        out = self.out
        if "D" in node or "O" in node:
            ordered = "O" in node
            out.append(
                _global("collections", "OrderedDict") + _EMPTY_TUPLE + _REDUCE if ordered else _EMPTY_DICT
            )
            pairs = node["O" if ordered else "D"]
            if pairs:
                out.append(_MARK)
                for key, value in pairs:
                    self.encode(key)
                    self.encode(value)
                out.append(_SETITEMS)
            if ordered and "m" in node:  # a module state_dict's versions, as an attribute (BUILD)
                out += [_EMPTY_DICT, _MARK, _str("_metadata")]
                self.encode(node["m"])
                out += [_SETITEMS, _BUILD]
        elif "L" in node:
            out.append(_EMPTY_LIST)
            if node["L"]:
                out.append(_MARK)
                for value in node["L"]:
                    self.encode(value)
                out.append(_APPENDS)
        elif "T" in node:
            self._tuple(node["T"])
        elif "S" in node:
            out += [_global("torch", "Size"), _MARK]
            self._tuple([int(v) for v in node["S"]])
            out += [_TUPLE, _REDUCE]
        elif "B" in node:
            import base64  # rare: bytes in a state

            text = base64.b64decode(node["B"], validate=True).decode("latin1")
            out += [_global("_codecs", "encode"), _MARK, _str(text), _str("latin1"), _TUPLE, _REDUCE]
        elif "dt" in node:
            out.append(_dtype(node["dt"]))
        elif "dv" in node:
            out += [_global("torch", "device"), _MARK, _str(str(node["dv"])), _TUPLE, _REDUCE]
        elif "t" in node:
            self._tensor(int(node["t"]))
        else:
            raise NotConvertible(f"an unknown tree tag {sorted(node)}")

    def _tuple(self, values: list[Any]) -> None:
        self.out.append(_MARK)
        for value in values:
            self.encode(value)
        self.out.append(_TUPLE)

    def _tensor(self, index: int) -> None:
        out = self.out
        storage, dtype, shape, stride, offset, requires_grad, is_param = self.tensors[index]
        storage = int(storage)
        _, nbytes, location = self.storages[storage]
        typed = self.typed.get(storage)
        if is_param:
            out.append(_global("torch._utils", "_rebuild_parameter") + _MARK)
        out.append(_global("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3") + _MARK)
        # The storage: ('storage', class, key, location, numel), numel in the class's items.
        storage_class = _global("torch", typed[0]) if typed else _global("torch.storage", "UntypedStorage")
        numel = nbytes // typed[1] if typed else nbytes
        out += [_MARK, _str("storage"), storage_class, _str(str(storage)), _str(location), _int(numel)]
        out += [_TUPLE, _BINPERSID, _int(int(offset))]
        self._tuple([int(v) for v in shape])
        self._tuple([int(v) for v in stride])
        # A parameter's data carries no grad flag of its own: _rebuild_parameter sets it.
        out += [_FALSE if is_param or not requires_grad else _TRUE, _HOOKS]
        if not typed:
            out.append(_dtype(dtype))
        out += [_TUPLE, _REDUCE]
        if is_param:
            out += [_TRUE if requires_grad else _FALSE, _HOOKS, _TUPLE, _REDUCE]


def pickle_of(frame: FlashFrame) -> bytes:
    """``archive/data.pkl`` for ``frame``: ``{"step": step, "state": state}``."""
    try:
        return _Pickler(frame.description).dumps(frame.step, frame.description["tree"])
    except NotConvertible:
        raise
    except (KeyError, TypeError, IndexError, ValueError, RecursionError) as exc:
        raise NotConvertible(f"a malformed flash description: {type(exc).__name__}: {exc}") from None


# -- the zip ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Range:
    """``nbytes`` bytes of the source file from ``offset``."""

    offset: int
    nbytes: int


_CHUNK = 8 << 20


class _Zip:
    """A stored (uncompressed) zip written front to back, each entry's data aligned (see the module doc)."""

    def __init__(self, src: BinaryIO, force_zip64: bool) -> None:
        self.src = src
        self.force_zip64 = force_zip64
        self.offset = 0
        self.central: list[bytes] = []

    def entry(self, name: str, data: bytes | _Range) -> Iterator[bytes]:
        encoded = f"{_ARCHIVE}/{name}".encode()
        size = len(data) if isinstance(data, bytes) else data.nbytes
        start = self.offset
        zip64 = self.force_zip64 or size >= _ZIP64_LIMIT or start >= _ZIP64_LIMIT
        zip64_extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        fixed = 30 + len(encoded) + len(zip64_extra) + 4
        pad = -(start + fixed) % STORAGE_ALIGN
        extra = zip64_extra + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        version = 45 if zip64 else 20
        flags = 0x0808  # sizes and CRC in a data descriptor after the data; UTF-8 names
        header = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, version, flags, 0, 0, 0, 0, 0, 0, len(encoded), len(extra)
        )
        yield header + encoded + extra
        crc = 0
        if isinstance(data, bytes):
            crc = zlib.crc32(data)
            yield data
        else:
            self.src.seek(data.offset)
            left = data.nbytes
            while left:
                chunk = self.src.read(min(left, _CHUNK))
                if not chunk:
                    raise NotConvertible("the flash checkpoint ended inside a storage")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
                yield chunk
        if zip64:
            yield struct.pack("<IIQQ", 0x08074B50, crc, size, size)
        else:
            yield struct.pack("<IIII", 0x08074B50, crc, size, size)
        self.offset = start + len(header) + len(encoded) + len(extra) + size + (24 if zip64 else 16)
        central_extra = b""
        sizes, local = size, start
        if zip64:
            central_extra = struct.pack("<HHQQQ", 1, 24, size, size, start)
            sizes = local = _ZIP64_LIMIT
        self.central.append(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                version,
                version,
                flags,
                0,
                0,
                0,
                crc,
                sizes,
                sizes,
                len(encoded),
                len(central_extra),
                0,
                0,
                0,
                0,
                local,
            )
            + encoded
            + central_extra
        )

    def end(self) -> Iterator[bytes]:
        directory = b"".join(self.central)
        count, at = len(self.central), self.offset
        end64_at = at + len(directory)
        yield directory
        yield struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(directory), at)
        yield struct.pack("<IIQI", 0x07064B50, 0, end64_at, 1)
        yield struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(count, 0xFFFF),
            min(count, 0xFFFF),
            min(len(directory), _ZIP64_LIMIT),
            min(at, _ZIP64_LIMIT),
            0,
        )


def torch_file(
    src: BinaryIO,
    frame: FlashFrame | None = None,
    data_pkl: bytes | None = None,
    *,
    force_zip64: bool = False,
) -> Iterator[bytes]:
    """The bytes of a ``torch.save`` file of the flash checkpoint open as ``src``, in pieces of at most
    8 MiB; NotConvertible before the first piece when it cannot be written (see :class:`NotConvertible`).
    ``frame`` and ``data_pkl``: :func:`read_frame`'s and :func:`pickle_of`'s results, when the caller has
    them. ``force_zip64``: zip64 fields on every entry (tests; torch needs them only past 4 GiB)."""
    frame = frame or read_frame(src)
    data_pkl = data_pkl if data_pkl is not None else pickle_of(frame)
    storages = [(int(o), int(n)) for o, n, _ in frame.description["storages"]]
    for offset, nbytes in storages:
        if offset < 0 or nbytes < 0 or frame.data_offset + offset + nbytes > frame.size - FLASH_TRAILER_SIZE:
            raise NotConvertible("a storage lies outside the flash checkpoint")
    return _pieces(src, frame.data_offset, data_pkl, storages, force_zip64)


def _pieces(
    src: BinaryIO, data_offset: int, data_pkl: bytes, storages: list[tuple[int, int]], force_zip64: bool
) -> Iterator[bytes]:
    archive = _Zip(src, force_zip64)
    yield from archive.entry("data.pkl", data_pkl)
    yield from archive.entry(".format_version", b"1")
    yield from archive.entry(".storage_alignment", str(STORAGE_ALIGN).encode())
    yield from archive.entry("byteorder", b"little")  # the flash bytes are the saving host's: x86/arm LE
    for key, (offset, nbytes) in enumerate(storages):
        yield from archive.entry(f"data/{key}", _Range(data_offset + offset, nbytes))
    yield from archive.entry("version", b"3")
    serialization_id = "".join(str(secrets.randbelow(10)) for _ in range(40))
    yield from archive.entry(".data/serialization_id", serialization_id.encode())
    yield from archive.end()


class Reader:
    """A read-only file object over :func:`torch_file`'s pieces, for a copy loop that reads a source.

    ``read(n)`` may return fewer than ``n`` bytes (b"" only at the end), as a raw file may: each piece is
    handed out as it is, without joining or copying it (the pieces are at most 8 MiB)."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self._left = memoryview(b"")  # the rest of a piece larger than a read asked for

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that are left for a negative size); b"" at the end."""
        if size < 0:
            out = bytes(self._left) + b"".join(self._pieces)
            self._left = memoryview(b"")
            return out
        while not self._left:
            piece = next(self._pieces, None)
            if piece is None:
                return b""
            if len(piece) <= size:
                return piece
            self._left = memoryview(piece)
        out, self._left = bytes(self._left[:size]), self._left[size:]
        return out
