"""The state of the last committed step, kept in this process's memory, and its agreement between ranks.

:class:`Committed` copies the ``state_dict()`` of every object it is given (model, optimizer, sampler,
anything with ``state_dict``/``load_state_dict``) at each commit, into CPU buffers it reuses from one
commit to the next, plus this process's RNG state. A step that broke half-way is undone by
:meth:`Committed.restore`.

After a new group formed, :func:`agree` finds the newest committed step among its ranks. A collective
completes on one rank only once every rank has sent its part, so the live ranks are at most one step
apart: the lowest rank holding the newest step sends its state to every rank that lacks it (a replaced
rank, or a rank that was one step behind), so no committed step is lost and none is redone. The RNG
state is each rank's own and never sent.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def _copy_into(buffer: Any, value: Any) -> Any:
    """A CPU copy of ``value``, reusing the tensors of ``buffer`` (an earlier copy) where they fit."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if (
            isinstance(buffer, torch.Tensor)
            and buffer.shape == value.shape
            and buffer.dtype == value.dtype
            and not value.is_sparse
        ):
            return buffer.copy_(value)
        return value.to("cpu", copy=True)
    if isinstance(value, Mapping):
        old = buffer if isinstance(buffer, Mapping) else {}
        return {k: _copy_into(old.get(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        olds: Sequence[Any] = (
            buffer if isinstance(buffer, list | tuple) and len(buffer) == len(value) else [None] * len(value)
        )
        copied = [_copy_into(b, v) for b, v in zip(olds, value, strict=True)]
        return copied if isinstance(value, list) else tuple(copied)
    return copy.deepcopy(value)


def _clone(value: Any) -> Any:
    """A deep copy whose tensors share no storage with ``value`` (what ``load_state_dict`` may keep)."""
    return _copy_into(None, value)


@dataclass
class Committed:
    """The committed step of ``objects`` (by name) in CPU memory; ``fresh`` until the first agreement
    or commit (a process that holds only what the script built or loaded at start)."""

    objects: Mapping[str, Stateful]
    step: int
    fresh: bool = True

    def __post_init__(self) -> None:
        self._states: dict[str, Any] = {}
        self._rng: tuple[Any, Any] | None = None
        self.take(self.step, fresh=self.fresh)

    def take(self, step: int, fresh: bool = False) -> None:
        """Copy the objects' current state as that of ``step``."""
        self._states = {
            name: _copy_into(self._states.get(name), obj.state_dict()) for name, obj in self.objects.items()
        }
        self._rng = (torch.get_rng_state(), random.getstate())
        self.step, self.fresh = step, fresh

    def restore(self) -> None:
        """Put the committed state back into the objects (undoing a step that broke half-way)."""
        for name, obj in self.objects.items():
            obj.load_state_dict(_clone(self._states[name]))
        if self._rng is not None:
            torch.set_rng_state(self._rng[0])
            random.setstate(self._rng[1])

    def payload(self) -> bytes:
        """The committed states (not the RNG) as bytes for a peer."""
        buffer = io.BytesIO()
        torch.save({"step": self.step, "states": self._states}, buffer)
        return buffer.getvalue()

    def adopt(self, payload: bytes) -> None:
        """Take a peer's committed states as this process's (its RNG state stays its own)."""
        received = torch.load(io.BytesIO(payload), weights_only=False)
        for name, obj in self.objects.items():
            obj.load_state_dict(received["states"][name])
        self.take(int(received["step"]))


@dataclass(frozen=True)
class Agreement:
    """What :func:`agree` decided: the step every rank now holds, and which rank sent it (None: nobody)."""

    step: int
    source: int | None
    receivers: tuple[int, ...]


def plan(reports: list[tuple[int, bool]]) -> Agreement:
    """Pure: from each rank's (committed step, fresh), the step to continue from and who sends it.

    Every rank fresh (a job's first start): nobody sends. Otherwise the lowest non-fresh rank with the
    newest step sends it to every fresh rank and every rank behind it."""
    held = [(step, rank) for rank, (step, fresh) in enumerate(reports) if not fresh]
    if not held:
        return Agreement(max(step for step, _ in reports), None, ())
    newest = max(step for step, _ in held)
    source = min(rank for step, rank in held if step == newest)
    receivers = tuple(r for r, (step, fresh) in enumerate(reports) if fresh or step != newest)
    return Agreement(newest, source if receivers else None, receivers)


def agree(committed: Committed) -> Agreement:
    """Bring every rank of the (new) default group to the newest committed step; see :func:`plan`."""
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (committed.step, committed.fresh))
    decided = plan([(int(step), bool(fresh)) for step, fresh in reports])
    if decided.source is not None:
        rank = dist.get_rank()
        box: list[Any] = [committed.payload() if rank == decided.source else None]
        dist.broadcast_object_list(box, src=decided.source)
        if rank in decided.receivers:
            committed.adopt(box[0])
    committed.fresh = False
    return decided
