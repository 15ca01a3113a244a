"""The digest of checkpoint bytes, and the frame of a flash file as far as verifying it needs.

**The digest** is xxh3_128 (PyPI ``xxhash``): one fast, non-cryptographic hash of a checkpoint's saved
bytes, computed while they are copied (:mod:`elastic.checkpoint.flash`, :mod:`elastic.checkpoint.dcp_io`)
and checked before a restore builds a tensor from them. Measured on one core: xxh3 about 9.5 GB/s, zlib's
crc32 1.6 GB/s, sha256 1.2 GB/s, so checking costs a small part of a restore from memory. 128 bits rather
than xxh3_64 because it costs the same per byte on 64-bit CPUs, and the integrity checks compare one
step's digests across every replica of a long job: 2^-64 per pair is not negligible over millions of
comparisons, 2^-128 is. It guards against damage (a flipped bit in memory, a torn copy, a bad disk or
link), not against an attacker who can write the file (the digest sits in it). Its text form is
``xxh3_128:<32 hex digits>``; :func:`check_text` also accepts a bare sha256 hex digest, what replicas
received by agents of earlier versions recorded.

**The flash frame** (the format is :mod:`elastic.checkpoint.flash`'s; this module only reads it)::

    offset 0     header, version 2 (80 bytes): magic, version, reserved, step, total size, JSON size,
                 data offset, content id, digest (16 bytes)
                 version 1 (64 bytes): the same without the digest
    header end   JSON description
    data offset  storage bytes, each at a 64-byte aligned offset, the gaps zero-filled (version 2)
    size - 16    the content id again (the trailer)

The digest of a version-2 file covers its header's first 48 bytes (magic to data offset: everything but
the content id, which names one save, and the digest itself), then every byte from the header's end to
the trailer: the JSON description, the zero padding and the storages' bytes. Two nodes' saves of one
state thus have the same digest (their content ids differ), which is what the integrity checks compare
across replicas. Version-1 files carry no digest; they still load, unverified (logged once).

Standard library and ``xxhash`` only: the agent (which never imports torch) verifies a flash file before
it persists it (:func:`verify_file`), and :func:`digest_of` reads a file's digest from its header alone.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from elastic import errors

ALGORITHM = "xxh3_128"
DIGEST_SIZE = 16

MAGIC = b"\x89ELFLSH\n"
VERSION = 2
#: magic, version, reserved, step, size, json size, data offset, content id, digest
HEADER = struct.Struct("<8sIIQQQQ16s16s")
#: The version-1 header: the same without the digest.
HEADER_V1 = struct.Struct("<8sIIQQQQ16s")
#: The header's bytes the digest covers: magic to data offset.
DIGESTED_HEADER = 48
TRAILER_SIZE = 16

log = logging.getLogger(__name__)
_warned_v1 = False
_READ_CHUNK = 8 << 20
_MAP_SLICE = 64 << 20  # hashed per slice of a mapped file


class CheckpointCorruptError(errors.CheckpointError, ValueError):
    """A checkpoint's bytes do not match the digest recorded when it was saved.

    A ``ValueError`` too: like any damaged file, a restore skips it and tries the next copy."""

    def __init__(self, what: str, recorded: str, computed: str) -> None:
        super().__init__(
            f"{what}: its bytes do not match its digest (recorded {recorded}, computed {computed})"
        )
        self.what, self.recorded, self.computed = what, recorded, computed


def hasher() -> xxhash.xxh3_128:
    """A new streaming hasher of the digest (``update(bytes-like)``, ``digest()``, ``hexdigest()``)."""
    return xxhash.xxh3_128()


def text(raw: bytes) -> str:
    """The text form of a 16-byte digest: ``xxh3_128:<hex>``."""
    return f"{ALGORITHM}:{raw.hex()}"


class Verifier:
    """Checks bytes fed in file order (:meth:`update`) against a recorded digest: its text form, or a bare
    sha256 hex digest of an earlier version's replica (slower, still checked)."""

    def __init__(self, recorded: str) -> None:
        algorithm, _, value = recorded.rpartition(":")
        self.recorded = recorded
        self._unknown = False
        self._hash: Any
        if algorithm == ALGORITHM:
            self._hash = hasher()
        elif not algorithm and len(value) == 64:
            import hashlib

            self._hash = hashlib.sha256()
        else:
            self._unknown, self._hash = True, None

    def update(self, data: Any) -> None:
        if self._hash is not None:
            self._hash.update(data)

    def why(self, what: object) -> str:
        """'' when the bytes fed match the recorded digest, else one line naming ``what`` and why not."""
        if self._unknown:
            return f"{what}: unknown digest {self.recorded[:40]!r}"
        if isinstance(self._hash, xxhash.xxh3_128):
            actual, recorded = text(self._hash.digest()), self.recorded
        else:
            actual, recorded = self._hash.hexdigest(), self.recorded
        if actual == recorded:
            return ""
        return f"{what}: digest {actual} differs from the recorded {recorded}"


def check_text(recorded: str, path: Path, data: mmap.mmap | None = None) -> str:
    """'' when the file at ``path`` (its bytes mapped already: ``data``) has the digest ``recorded`` (text
    form, or a bare sha256 hex digest of an earlier version's replica), else one line saying why not."""
    verifier = Verifier(recorded)
    if data is None:
        _stream(path, verifier.update)
    else:
        with memoryview(data) as view:
            for start in range(0, len(view), _MAP_SLICE):
                verifier.update(view[start : start + _MAP_SLICE])
    return verifier.why(path)


def file_digest_raw(path: Path) -> bytes:
    """The digest of a whole file's bytes (streamed)."""
    digest = hasher()
    _stream(path, digest.update)
    return digest.digest()


def _stream(path: Path, update: Callable[[memoryview], object]) -> None:
    """Feed a file's bytes to ``update``: from a read-only mapping of it (the pages where they lie, no
    copy through a read buffer: a restore's check of a 1 GB replica in shared memory costs the hash
    alone), in slices; read in chunks where the file cannot be mapped."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):  # not mappable (a pipe, some network file systems)
            mapped = None
        if mapped is not None:
            with mapped, memoryview(mapped) as view:
                for start in range(0, size, _MAP_SLICE):
                    update(view[start : start + _MAP_SLICE])
            return
        chunk = bytearray(_READ_CHUNK)
        chunk_view = memoryview(chunk)
        while n := f.readinto(chunk):
            update(chunk_view[:n])


# -- the flash frame --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """A flash file's header (either version)."""

    version: int
    step: int
    size: int
    meta_size: int
    data_offset: int
    content_id: bytes
    digest: bytes | None  # None: version 1

    @property
    def end(self) -> int:
        """Where the JSON description starts."""
        return HEADER.size if self.version >= 2 else HEADER_V1.size


def read_header(head: bytes | bytearray | memoryview, actual_size: int) -> Header:
    """The header at the start of ``head`` (at least :data:`HEADER`'s size, or the whole file) of a flash
    file of ``actual_size`` bytes; ``ValueError`` for a file that is not one, of another version, or whose
    sizes are inconsistent (torn)."""
    if len(head) < HEADER_V1.size or actual_size < HEADER_V1.size + TRAILER_SIZE:
        raise ValueError(f"a flash checkpoint of {actual_size} bytes is cut short")
    magic, version = bytes(head[:8]), struct.unpack_from("<I", head, 8)[0]
    if magic != MAGIC:
        raise ValueError("not a flash checkpoint (bad magic)")
    if version == 1:
        _, _, _, step, size, meta_size, data_offset, content_id = HEADER_V1.unpack_from(head, 0)
        digest = None
    elif version == VERSION:
        if len(head) < HEADER.size or actual_size < HEADER.size + TRAILER_SIZE:
            raise ValueError(f"a flash checkpoint of {actual_size} bytes is cut short")
        _, _, _, step, size, meta_size, data_offset, content_id, digest = HEADER.unpack_from(head, 0)
    else:
        raise ValueError(
            f"flash checkpoint version {version} is not supported (this reader: 1 and {VERSION})"
        )
    header = Header(version, step, size, meta_size, data_offset, content_id, digest)
    if size != actual_size:
        raise ValueError(f"torn flash checkpoint: {actual_size} bytes, the header says {size}")
    if not header.end + meta_size <= data_offset <= size - TRAILER_SIZE:
        raise ValueError("bad flash checkpoint header (sizes out of range)")
    return header


def _note_unverified(what: str) -> None:
    global _warned_v1
    if not _warned_v1:
        _warned_v1 = True
        log.info("%s is a version-1 flash checkpoint: it has no digest, its bytes are not verified", what)


def frame_digest(data: bytes | bytearray | memoryview | mmap.mmap, header: Header) -> bytes:
    """The digest of the version-2 flash file ``data`` (whole), computed over its bytes (module doc)."""
    digest = hasher()
    with memoryview(data) as view:
        digest.update(view[:DIGESTED_HEADER])
        digest.update(view[header.end : header.size - TRAILER_SIZE])
    return digest.digest()


def verify(data: bytes | bytearray | memoryview | mmap.mmap, what: str = "flash checkpoint") -> Header:
    """Check the flash file ``data`` (whole): its frame (``ValueError``) and, for version 2, its bytes
    against its digest (:class:`CheckpointCorruptError`, naming ``what``). Returns its header."""
    header = read_header(data[: HEADER.size], len(data))
    if bytes(data[header.size - TRAILER_SIZE : header.size]) != header.content_id:
        raise ValueError("torn flash checkpoint: its trailer does not match its header")
    if header.digest is None:
        _note_unverified(what)
        return header
    computed = frame_digest(data, header)
    if computed != header.digest:
        raise CheckpointCorruptError(what, text(header.digest), text(computed))
    return header


def digest_of(path: str | os.PathLike[str]) -> str | None:
    """The digest a flash checkpoint file recorded when it was saved (``xxh3_128:<hex>``), read from its
    header alone (no tensor is parsed, no byte checked); None for a file without one (version 1, or a
    ``torch.save`` file). ``ValueError`` for a flash file whose header is damaged."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if head[: len(MAGIC)] != MAGIC:
            return None
        header = read_header(head, os.fstat(f.fileno()).st_size)
    return None if header.digest is None else text(header.digest)


def verify_file(src: BinaryIO | str | os.PathLike[str], what: str = "") -> str | None:
    """Check a flash checkpoint file's bytes against its recorded digest, streaming them (the agent's
    check before it persists one). ``src``: a path, or a seekable binary file open for reading (read
    from its start, left at its end).

    Returns:
        The digest (text form) when it matches; None for a file that has none to check (version 1, or
        not a flash file: a ``torch.save`` file).

    Raises:
        CheckpointCorruptError: the bytes differ from the digest (the message names the file).
        ValueError: a flash file whose frame is torn or damaged.
    """
    if not isinstance(src, (str, os.PathLike)):
        return _verify_open(src, what or getattr(src, "name", "flash checkpoint"))
    with open(src, "rb") as f:
        return _verify_open(f, what or str(src))


def _verify_open(f: BinaryIO, what: str) -> str | None:
    actual = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(HEADER.size)
    if head[: len(MAGIC)] != MAGIC:
        return None
    header = read_header(head, actual)
    f.seek(header.size - TRAILER_SIZE)
    if f.read(TRAILER_SIZE) != header.content_id:
        raise ValueError(f"{what}: torn flash checkpoint: its trailer does not match its header")
    if header.digest is None:
        _note_unverified(what)
        return None
    digest = hasher()
    digest.update(head[:DIGESTED_HEADER])
    f.seek(header.end)
    left = header.size - TRAILER_SIZE - header.end
    chunk = bytearray(_READ_CHUNK)
    view = memoryview(chunk)
    while left > 0:
        n = f.readinto(view[: min(left, _READ_CHUNK)])  # type: ignore[attr-defined]  # any binary file
        if not n:
            raise ValueError(f"{what}: torn flash checkpoint: it ended early")
        digest.update(view[:n])
        left -= n
    computed = digest.digest()
    if computed != header.digest:
        raise CheckpointCorruptError(what, text(header.digest), text(computed))
    return text(computed)
