"""Small agreements between ranks through tensor collectives.

The worker library agrees on checkpoint steps with plain int64 tensors rather than torch's object
collectives (``all_gather_object``, ``broadcast_object_list``): those pickle, need numpy, and with NCCL
move pickles through the GPU. Tensors go on the device the backend requires (the current CUDA device for
NCCL, the CPU otherwise), so the same code serves gloo and NCCL.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

#: Padding for step lists of different lengths; steps are never negative.
_PAD = -1


def collective_device(backend: str, current_cuda_device: int | None = None) -> torch.device:
    """The device a collective's tensors must live on for ``backend``.

    NCCL only moves CUDA tensors (on the rank's own device, set by :func:`elastic.init_process_group`);
    gloo and the others take CPU tensors.
    """
    if "nccl" in backend.lower():
        index = torch.cuda.current_device() if current_cuda_device is None else current_cuda_device
        return torch.device("cuda", index)
    return torch.device("cpu")


def _device() -> torch.device:
    return collective_device(str(dist.get_backend()))


def world_size() -> int:
    """Size of the default process group, or 0 when none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 0


def all_step_lists(local: Iterable[int], world: int) -> list[list[int]]:
    """Every rank's ``local`` steps, indexed by rank (a collective when ``world`` > 1)."""
    mine = sorted(set(local))
    if world <= 1:
        return [mine]
    device = _device()
    length = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    longest = int(length.item())
    if longest == 0:
        return [[] for _ in range(world)]
    padded = torch.full((longest,), _PAD, dtype=torch.int64, device=device)
    if mine:
        padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [[int(s) for s in steps.tolist() if s != _PAD] for steps in gathered]


def broadcast_int(value: int | None, src: int = 0) -> int | None:
    """Rank ``src``'s ``value`` on every rank (``None`` travels too); a collective in a process group."""
    if world_size() <= 1:
        return value
    # Two slots: a presence flag, then the value, so that None and every int64 can be told apart.
    payload = torch.tensor([0 if value is None else 1, value or 0], dtype=torch.int64, device=_device())
    dist.broadcast(payload, src=src)
    present, number = payload.tolist()
    return int(number) if present else None


def broadcast_bytes(data: bytes | None, src: int) -> bytes | None:
    """Rank ``src``'s ``data`` on every rank, or ``None`` on every rank when ``src`` has none.

    A collective in a process group of more than one rank: the length travels first (-1 for none), then
    the bytes as one uint8 tensor.
    """
    if world_size() <= 1:
        return data
    device = _device()
    length = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    size = int(length.item())
    if size < 0:
        return None
    if size == 0:
        return b""
    if data is not None:
        with warnings.catch_warnings():
            # frombuffer warns that bytes are read-only; a broadcast only reads the sender's tensor.
            warnings.simplefilter("ignore", UserWarning)
            payload = torch.frombuffer(data, dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    if data is not None:
        return data
    received = payload.cpu()
    # One memcpy; bytes(storage) would iterate the storage element by element.
    return ctypes.string_at(received.data_ptr(), size)


def rank() -> int:
    """This process's rank in the default process group, or 0 when none is initialized."""
    return dist.get_rank() if world_size() > 0 else 0


def barrier() -> None:
    """A barrier of the default process group; nothing without one."""
    if world_size() > 0:
        dist.barrier()


def gather_ints(flat: list[int], world: int) -> list[list[int]]:
    """Every rank's ``flat`` list of non-negative-or-coded int64 values, indexed by rank, each padded with
    ``-1`` to the longest (at least 3 long); a collective when ``world`` > 1."""
    if world <= 1:
        return [flat]
    device = _device()
    length = torch.tensor([len(flat)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    longest = int(length.item())
    padded = torch.full((max(longest, 3),), _PAD, dtype=torch.int64, device=device)
    if flat:
        padded[: len(flat)] = torch.tensor(flat, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g.tolist()[:longest] for g in gathered]


def any_rank(flag: bool, world: int) -> bool:
    """True on every rank when ``flag`` is true on any (a collective when ``world`` > 1)."""
    if world <= 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
