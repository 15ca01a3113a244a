"""Small agreements between ranks through tensor collectives.

The worker library agrees on checkpoint steps with plain int64 tensors rather than torch's object
collectives (``all_gather_object``, ``broadcast_object_list``): those pickle, need numpy, and with NCCL
move pickles through the GPU. Tensors go on the device the backend requires (the current CUDA device for
NCCL, the CPU otherwise), so the same code serves gloo and NCCL.
"""

from __future__ import annotations

import atexit
import ctypes
import time
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

#: Padding for step lists of different lengths; steps are never negative.
_PAD = -1

#: Tensors this module handed to the backend, kept referenced until the backend lets go of them. Gloo
#: runs collectives on its own threads and drops a finished work (and a barrier's record of earlier
#: works) after the caller has moved on; if that drop frees a tensor Python created, it needs the GIL,
#: and during interpreter shutdown that kills the thread inside a destructor: ``terminate called
#: without an active exception`` and SIGABRT after a clean exit. Holding them here keeps the last
#: release on the Python side.
_lent: list[torch.Tensor] = []

#: How long :func:`settle` waits for the backend to release the lent tensors: the race it closes lasts
#: microseconds; a backend stuck on a dead peer must not hold the exit up for long.
SETTLE_TIMEOUT_S = 2.0


def lend(*tensors: torch.Tensor) -> None:
    """Keep ``tensors``, handed to a collective, referenced until the backend no longer holds them.

    See ``_lent`` for why; :func:`settle` waits for the backend before the group is torn down.
    """
    _lent[:] = [t for t in _lent if t._use_count() > 1]  # type: ignore[attr-defined]  # torch's, unstubbed
    _lent.extend(tensors)


def settle(timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until the backend holds none of this module's tensors, then let them go.

    Called before the process group is torn down and at interpreter exit; returns False when the backend
    still held some after ``timeout_s`` (they are let go anyway: a stuck backend must not block exit).
    """
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in _lent):  # type: ignore[attr-defined]  # torch's, unstubbed
        if time.monotonic() >= deadline:
            _lent.clear()
            return False
        time.sleep(0.001)  # the backend's threads drop their references without needing us
    _lent.clear()
    return True


atexit.register(settle)


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
    lend(length)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    longest = int(length.item())
    if longest == 0:
        return [[] for _ in range(world)]
    padded = torch.full((longest,), _PAD, dtype=torch.int64, device=device)
    if mine:
        padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    lend(padded, *gathered)
    dist.all_gather(gathered, padded)
    return [[int(s) for s in steps.tolist() if s != _PAD] for steps in gathered]


def broadcast_int(value: int | None, src: int = 0) -> int | None:
    """Rank ``src``'s ``value`` on every rank (``None`` travels too); a collective in a process group."""
    if world_size() <= 1:
        return value
    # Two slots: a presence flag, then the value, so that None and every int64 can be told apart.
    payload = torch.tensor([0 if value is None else 1, value or 0], dtype=torch.int64, device=_device())
    lend(payload)
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
    lend(length)
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
    lend(payload)
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
    lend(length)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    longest = int(length.item())
    padded = torch.full((max(longest, 3),), _PAD, dtype=torch.int64, device=device)
    if flat:
        padded[: len(flat)] = torch.tensor(flat, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    lend(padded, *gathered)
    dist.all_gather(gathered, padded)
    return [g.tolist()[:longest] for g in gathered]


def any_rank(flag: bool, world: int) -> bool:
    """True on every rank when ``flag`` is true on any (a collective when ``world`` > 1)."""
    if world <= 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=_device())
    lend(value)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
