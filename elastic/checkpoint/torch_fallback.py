"""The torch.save fallback of flash saves, for states the flash format does not describe.

:mod:`elastic.checkpoint.flash_format` covers tensors, primitives and containers, which is what
``weights_only`` loading accepts anyway; a state with something else (a sparse tensor, a tensor subclass) is
written the way every flash save was before: ``torch.save`` into a fresh file of the shared-memory folder
(pages faulted in by the write), committed by rename, the older copies pruned to ``keep``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from elastic.checkpoint import layout

# torch.save's headers, pickled metadata and per-record alignment on top of the tensor bytes.
_SIZE_SLACK_BYTES = 1 << 20
_PER_TENSOR_SLACK_BYTES = 4096


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    # torch.save's per-record CRC32 costs more than the copy itself (about 2x on a 1 GB state). The file
    # is committed by rename only when whole, so a checksum adds no protection against torn files.
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    previous = get()
    set_(False)
    try:
        yield
    finally:
        set_(previous)


def estimated_size(state: Any) -> int:
    """Bytes a torch.save of ``state`` takes, about: its tensors' storages plus headers."""
    seen: set[tuple[str, int]] = set()
    total = _SIZE_SLACK_BYTES

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor) and obj.is_sparse:
            walk(obj._indices())  # no storage of its own: its index and value tensors have them
            walk(obj._values())
        elif isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
            total += obj.numel() * obj.element_size() + _PER_TENSOR_SLACK_BYTES  # at most this, about
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes() + _PER_TENSOR_SLACK_BYTES
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    return total


def write(state: dict[str, Any], step: int, directory: Path, keep: int) -> Path:
    """torch.save ``{"step", "state"}`` as ``step_<step>.pt`` (temp file, rename), keep ``keep``."""
    final = directory / layout.step_file_name(step)
    with without_crc32():
        # No fsync: the folder is in memory. Only the rename makes the checkpoint visible.
        layout.atomic_write(final, lambda f: torch.save({"step": step, "state": state}, f), durable=False)
    layout.prune(directory, final, keep)
    return final
