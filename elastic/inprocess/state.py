"""The state of the last committed step, kept in this process's memory, and its agreement between ranks.

:class:`Committed` copies the ``state_dict()`` of every object it is given (model, optimizer, sampler,
anything with ``state_dict``/``load_state_dict``) at each commit, into CPU buffers it reuses from one
commit to the next, plus this process's RNG state. A step that broke half-way is undone by
:meth:`Committed.restore`.

After a new group formed, :func:`agree` finds the newest committed step among its ranks. A collective
completes on one rank only once every rank has sent its part, so ranks that trained in one group are at
most one step apart; a rank kept while it was cut off, or a restarted process that loaded a copy, may be
further off. The lowest rank holding the newest step sends its state to every rank that lacks it (a
replaced rank, or a rank behind), so no committed step is lost and none is redone. The RNG
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
    """A copy of ``value`` that reuses the tensors of ``buffer`` (an earlier copy, or an object's live state)
    where they fit (shape, dtype, plain strided layout): copied into them; elsewhere a new CPU copy."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if (
            isinstance(buffer, torch.Tensor)
            and buffer.shape == value.shape
            and buffer.dtype == value.dtype
            and buffer.layout == value.layout == torch.strided
        ):
            return buffer.detach().copy_(value)
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
        """Put the committed state back into the objects (undoing a step that broke half-way): copied into
        their own tensors where shapes match (no new memory: a clone of 1 GB of state into fresh pages took
        most of a large model's re-formation), cloned elsewhere; never the committed buffers themselves,
        which an object may keep (an optimizer does) and the next commit overwrites."""
        for name, obj in self.objects.items():
            obj.load_state_dict(_copy_into(obj.state_dict(), self._states[name]))
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

    The newest step any rank holds wins, whether it was committed in this process or loaded at its start
    (a fresh process's copy is of the job's lineage: elastic.load takes it up to the committed step, or
    from this node's own memory). A rank kept in its process may be far behind: one cut off from the others
    for a while, kept since, holds the step it last committed, and a process restarted beside it may have
    loaded a newer one; letting the kept one win threw the newer steps away.
    Of the ranks at the newest step, the lowest one that is not fresh sends it to every fresh rank and
    every rank behind; when only fresh ranks hold it, the lowest of them sends it to the ranks behind
    (fresh ranks at the same step loaded the same state). Every rank fresh at one step (a job's first
    start): nobody sends."""
    newest = max(step for step, _ in reports)
    kept = [rank for rank, (step, fresh) in enumerate(reports) if not fresh and step == newest]
    if kept:
        source = kept[0]
        receivers = tuple(r for r, (step, fresh) in enumerate(reports) if fresh or step != newest)
    else:
        source = min(rank for rank, (step, _) in enumerate(reports) if step == newest)
        receivers = tuple(r for r, (step, _) in enumerate(reports) if step != newest)
    return Agreement(newest, source if receivers else None, receivers)


def agree(committed: Committed) -> Agreement:
    """Bring every rank of the (new) default group to the newest committed step; see :func:`plan`."""
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (committed.step, committed.fresh))
    decided = plan([(int(step), bool(fresh)) for step, fresh in reports])
    if decided.source is not None:
        rank = dist.get_rank()
        if rank == decided.source:
            send_state(committed, decided.receivers)
        else:
            receive_state(committed, decided.source, rank in decided.receivers)
    committed.fresh = False
    return decided


# -- sending the committed state to the ranks that lack it ----------------------------------------------
# Over gloo the state's tensors go one by one, point to point, from the sender's committed copy straight
# into the receiver's live tensors where their shapes match (memory it has touched already), and only their
# layout (the state without its tensors) is pickled: 1 GB of state moves in about what loopback TCP takes
# for it. The whole state pickled into one object (torch.save into bytes, pickled again by
# broadcast_object_list, unpickled, torch.load, then load_state_dict) made five copies of it, each into
# fresh memory. Other backends (NCCL sends device tensors only) and tensors that are not plain strided ones
# (sparse, nested) take that one-object path.


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in the sent state: its position in the order the tensors are sent."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`_Slot`; the tensors appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, Mapping):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        parts = [_split(v, tensors) for v in value]
        return parts if isinstance(value, list) else tuple(parts)
    return value


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU ``tensor`` as a flat uint8 view of it (a view: receiving into it fills
    the tensor)."""
    return tensor.reshape(-1).view(torch.uint8)


def _by_tensors() -> bool:
    return dist.get_backend() == "gloo"


def send_state(committed: Committed, receivers: Sequence[int]) -> None:
    """The sender's side of :func:`agree`: its committed state to every rank of ``receivers``."""
    tensors: list[torch.Tensor] = []
    layout = _split({"step": committed.step, "states": committed._states}, tensors)
    raw: list[torch.Tensor] | None = None
    if _by_tensors() and all(t.layout == torch.strided and t.device.type == "cpu" for t in tensors):
        try:
            raw = [_raw(t.contiguous()) for t in tensors]
        except RuntimeError:  # a dtype whose bytes cannot be viewed (quantized): the one-object path
            raw = None
    if raw is None:
        dist.broadcast_object_list([("payload", committed.payload())], src=dist.get_rank())
        return
    dist.broadcast_object_list([("tensors", layout)], src=dist.get_rank())
    for rank in receivers:
        for part in raw:
            if part.numel():
                dist.send(part, rank)


def receive_state(committed: Committed, source: int, receiving: bool) -> None:
    """A non-sender's side of :func:`agree`: with ``receiving``, take the sender's committed state as this
    process's (into its objects, then its committed copy; its RNG state stays its own)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=source)
    if not receiving:
        return
    kind, data = box[0]
    if kind == "payload":
        committed.adopt(data)
        return
    live = {name: obj.state_dict() for name, obj in committed.objects.items()}
    # Everything is received before anything is loaded: a load that fails (a model built differently)
    # fails this rank alone, never the sender in the middle of its sends.
    filled = {name: _receive(wanted, live.get(name), source) for name, wanted in data["states"].items()}
    for name, obj in committed.objects.items():
        if name in filled:
            obj.load_state_dict(filled[name])
    committed.take(int(data["step"]))


def _receive(wanted: Any, live: Any, source: int) -> Any:
    """``wanted`` (a layout from :func:`_split`) with its tensors received from ``source`` in order, each
    into the tensor at the same place of ``live`` (this process's state) when it fits, else a new one."""
    if isinstance(wanted, _Slot):
        fits = (
            isinstance(live, torch.Tensor)
            and tuple(live.shape) == wanted.shape
            and live.dtype == wanted.dtype
            and live.device.type == "cpu"
            and live.layout == torch.strided
            and live.is_contiguous()
        )
        target = live.detach() if fits else torch.empty(wanted.shape, dtype=wanted.dtype)
        if target.numel():
            dist.recv(_raw(target), source)
        return target
    if isinstance(wanted, Mapping):
        mine = live if isinstance(live, Mapping) else {}
        return {k: _receive(v, mine.get(k), source) for k, v in wanted.items()}
    if isinstance(wanted, list | tuple):
        mine_seq = (
            live if isinstance(live, list | tuple) and len(live) == len(wanted) else [None] * len(wanted)
        )
        parts = [_receive(v, m, source) for v, m in zip(wanted, mine_seq, strict=True)]
        return parts if isinstance(wanted, list) else tuple(parts)
    return wanted
