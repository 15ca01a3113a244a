"""Fresh host memory for restored tensors, faulted in 2 MiB pages instead of 4 KiB ones.

A restore copies a checkpoint's bytes into tensors of its own (never views of a shared-memory segment that
the next save recycles). Those tensors are new allocations, and a copy into fresh memory pays a page
fault per 4 KiB page: on the 2-core development VM about 0.3-1 s per GB, 4-15x the copy itself
(docs/benchmarks.md, "Checkpoint"). :func:`empty` allocates with torch's own allocator (so the storage is
an ordinary, resizable one, freed like any other) and advises the kernel to back the allocation with
transparent huge pages (``madvise(MADV_HUGEPAGE)``) before anything touches it: the copy then faults one
2 MiB page per 512 small ones, and runs within about 1.5x of a copy into memory faulted in beforehand.

:func:`anonymous` is the same for a buffer that is not a tensor (bytes received from another rank).

It only advises: where transparent huge pages are off (``/sys/kernel/mm/transparent_hugepage/enabled``
set to ``never``), on another OS, or for allocations below 2 MiB it is a plain ``torch.empty``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
#: Below this, an allocation holds no whole huge page worth advising.
MIN_ADVISED = 2 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h); Python's mmap has it, but not for ctypes

log = logging.getLogger(__name__)
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc to call: plain allocations
        _madvise = None


def advise_huge(tensor: torch.Tensor) -> bool:
    """Advise huge pages for the 2 MiB-aligned interior of ``tensor``'s memory (a CPU tensor whose pages
    nothing has touched yet); False where the advice was not taken (it is only ever an optimisation)."""
    if _madvise is None or tensor.device.type != "cpu":
        return False
    start_ptr = tensor.data_ptr()
    nbytes = tensor.numel() * tensor.element_size()
    start = (start_ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (start_ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    # EINVAL where the kernel has no transparent huge pages: the allocation simply stays as it is.
    return bool(_madvise(start, end - start, _MADV_HUGEPAGE) == 0)


def empty(nbytes: int) -> torch.Tensor:
    """A new 1-D uint8 CPU tensor of ``nbytes`` (uninitialised, owning its storage), whose pages will be
    faulted in as huge pages where the kernel allows it: the destination of a restore's single copy."""
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= MIN_ADVISED:
        advise_huge(tensor)
    return tensor


def anonymous(nbytes: int, huge: bool = True) -> mmap.mmap:
    """A new private anonymous map of ``nbytes`` (> 0), advised for huge pages (``huge``): where a
    restore receives bytes from another rank before it parses them (a buffer, for ``torch.frombuffer``
    and ``parse``). Its memory goes when the map is closed, or freed with no buffer exporting it.
    ``huge=False`` where only scattered parts of it will be written: each huge page touched is 2 MiB
    the kernel zeroes."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        with contextlib.suppress(OSError, AttributeError):  # only advice: no THP, or no MADV_HUGEPAGE
            mapped.madvise(mmap.MADV_HUGEPAGE)
    return mapped
