"""Device-to-host copies of a flash save: started at once, waited for in the background.

A flash save of GPU state must not hold training up for a PCIe transfer. :class:`CudaCopier` copies
each device storage into a pinned host staging buffer on its own CUDA stream:

1. an event recorded on the current stream makes the copy stream wait for the work queued so far, so
   the copy sees the state as of the ``save`` call;
2. the copies are queued with ``non_blocking=True`` (a DMA from pinned memory: the CPU goes on);
3. the current stream waits (on the GPU, not the CPU) for the copies' end event, so that the next
   step's in-place updates of parameters and optimizer state cannot overwrite them while they are read,
   and ``record_stream`` keeps the allocator from reusing their memory meanwhile;
4. :meth:`PendingCopy.wait` (called by a background thread, see :mod:`elastic.checkpoint.flash_save`) blocks
on the
   end event and returns the staging views, which the thread copies into the shared-memory segment.

The staging buffer is allocated once (pinned memory is slow to allocate) and grows when the state does;
one save at a time uses it (a save waits for the previous one's background part). Other devices use
:class:`BlockingCopier` (a plain synchronous copy). Not measured here: this machine has no GPU; the unit
tests drive the same interface with a fake device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

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
