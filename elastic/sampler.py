"""``ElasticSampler``: a ``DistributedSampler`` whose position survives restarts at any world size.

Its state is the *global* number of samples consumed in the epoch. Each epoch is one permutation of
the dataset, fixed by ``seed + epoch`` (as ``DistributedSampler``); every optimizer step takes the next
global batch of that permutation and splits it over the ranks of the moment. After a restart, at the
same or another world size, the next step takes the next global batch: no sample is skipped or
repeated.

Two ways to size a step:

* ``batch_size=B`` (per rank, as the DataLoader's): a step consumes ``world_size * B`` samples, each
  rank gets ``B``. The global batch changes with the world size.
* ``global_batch_size=G``: a step consumes ``G`` samples whatever the world size, split over the ranks
  as evenly as possible (sizes differ by at most one); ``batch_size`` then caps the per-rank
  micro-batch, and each rank runs :attr:`accumulation_steps` micro-batches per step (gradient
  accumulation). Scale each micro-batch's summed loss by ``world_size / step_global_size`` and the
  update is the mean over the global batch, the same at every world size.

The training loop tells the sampler when a step is done, since a DataLoader reads ahead::

    sampler = elastic.ElasticSampler(dataset, batch_size=32)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    sampler.load_state_dict(state["sampler"])           # when resuming
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                        # same epoch as restored: keeps the position
        for batch in loader:
            train_step(batch)
            sampler.advance()                           # one step consumed; reports progress
            elastic.save({..., "sampler": sampler.state_dict()}, sampler.step)

Iteration order: with ``batch_size`` steps, rank ``r`` reads positions ``r, r + W, r + 2W, ...`` of
the permutation, as ``DistributedSampler``. Unlike it, nothing is padded or repeated: the samples left
at the end of an epoch that cannot give every rank a sample (or, with ``drop_last``, that do not fill a
whole global batch) are left out of that epoch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from elastic.report import report


@dataclass(frozen=True)
class StepBatch:
    """This rank's share of one optimizer step, as :meth:`ElasticSampler.steps` yields it."""

    micro_batches: list[list[int]]
    """``accumulation_steps`` lists of dataset indices, one per forward pass (some may be empty)."""
    global_size: int
    """Samples the step consumes over all ranks: scale a summed loss by ``world_size / global_size``."""


def _world_from_env(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            world, me = dist.get_world_size(), dist.get_rank()
        else:
            world, me = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        num_replicas = world if num_replicas is None else num_replicas
        rank = me if rank is None else rank
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in a world of {num_replicas}")
    return num_replicas, rank


class ElasticSampler(Sampler[int]):
    """Drop-in for ``DistributedSampler`` with a resumable, world-size-independent position.

    Args:
        dataset: a sized dataset, or the number of samples.
        num_replicas, rank: default from the process group, else ``WORLD_SIZE``/``RANK``.
        shuffle: permute each epoch (seeded by ``seed + epoch``); else dataset order.
        seed: permutation seed; the same on every rank and every restart.
        drop_last: leave out the end of an epoch that does not fill a whole global batch (otherwise the
            last step is smaller and only a remainder smaller than the world size is left out).
        batch_size: samples per rank per step (without ``global_batch_size``), or the largest
            micro-batch per rank (with it). Needed by :meth:`advance` in the first mode.
        global_batch_size: samples per step at any world size (gradient accumulation).

    Raises:
        ValueError: a negative dataset size, ``rank`` outside ``num_replicas``, a ``batch_size`` or
            ``global_batch_size`` below 1, or a ``global_batch_size`` smaller than the world size.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if self.num_samples < 0:
            raise ValueError(f"the dataset size must be >= 0, got {self.num_samples}")
        self.num_replicas, self.rank = _world_from_env(num_replicas, rank)
        for name, value in (("batch_size", batch_size), ("global_batch_size", global_batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if global_batch_size is not None and global_batch_size < self.num_replicas:
            raise ValueError(
                f"global_batch_size {global_batch_size} is smaller than the world size {self.num_replicas}: "
                "some rank would get no sample"
            )
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.epoch = 0
        """The current epoch: its permutation is seeded by ``seed + epoch`` (see :meth:`set_epoch`)."""
        self.consumed = 0
        """Samples of this epoch consumed by completed steps, over all ranks: the position."""
        self.step = 0
        """Optimizer steps completed, over all epochs (what :meth:`advance` returns)."""

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def step_size(self) -> int:
        """Samples a full step consumes over all ranks."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.num_replicas * (self.batch_size or 1)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per step (1 unless ``global_batch_size`` exceeds the ranks' capacity)."""
        if self.global_batch_size is None or self.batch_size is None:
            return 1
        per_rank = math.ceil(self.global_batch_size / self.num_replicas)
        return math.ceil(per_rank / self.batch_size)

    def _end(self) -> int:
        """End of the usable part of the epoch, counted from the current position."""
        left = self.num_samples - self.consumed
        if left <= 0:
            return self.consumed
        tail = left % self.step_size
        if tail and (self.drop_last or tail < self.num_replicas):
            return self.num_samples - tail
        return self.num_samples

    def _step_bounds(self) -> Iterator[tuple[int, int]]:
        position, end = self.consumed, self._end()
        while position < end:
            size = min(self.step_size, end - position)
            yield position, position + size
            position += size

    # -- iteration --------------------------------------------------------------------------------
    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def steps(self) -> Iterator[StepBatch]:
        """This rank's share of each remaining step of the epoch, from the current position."""
        order = self._permutation()
        parts = self.accumulation_steps
        for start, stop in self._step_bounds():
            mine = order[start + self.rank : stop : self.num_replicas]
            cuts = [len(mine) * i // parts for i in range(parts + 1)]
            yield StepBatch([mine[cuts[i] : cuts[i + 1]] for i in range(parts)], stop - start)

    def __iter__(self) -> Iterator[int]:
        for step in self.steps():
            for micro in step.micro_batches:
                yield from micro

    def __len__(self) -> int:
        """Indices this rank will yield for the rest of the epoch."""
        return sum(
            len(range(start + self.rank, stop, self.num_replicas)) for start, stop in self._step_bounds()
        )

    def batch_sampler(self) -> _BatchSampler:
        """This sampler as a DataLoader ``batch_sampler`` yielding its (non-empty) micro-batches.

        Needed with ``global_batch_size`` whenever the micro-batches are not all of one size.
        """
        return _BatchSampler(self)

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Deal the following steps to a world of ``num_replicas`` ranks, this one being ``rank``.

        Called after an in-process recovery re-formed the group (:func:`elastic.run` does it for the
        samplers in its state). The position is kept: no sample is skipped or repeated.

        Raises:
            ValueError: ``rank`` is not in a world of ``num_replicas``, or ``global_batch_size`` is
                smaller than ``num_replicas``.
        """
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in a world of {num_replicas}")
        if self.global_batch_size is not None and self.global_batch_size < num_replicas:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is smaller than the world size {num_replicas}"
            )
        self.num_replicas, self.rank = num_replicas, rank

    # -- position ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, or keep the position if it is the current (restored) epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def advance(self, steps: int = 1) -> int:
        """Mark ``steps`` optimizer steps as done and report progress to the agent.

        Call it once the step's update is applied: a DataLoader reads ahead, so the sampler cannot tell
        by itself which samples were trained on. The step report feeds the agent's hang and straggler
        checks (see :func:`elastic.report`).

        Returns:
            The optimizer steps completed so far, over all epochs (:attr:`step`).

        Raises:
            ValueError: neither ``batch_size`` nor ``global_batch_size`` was given (the sampler cannot
                tell how many samples a step took), or the epoch has no step left.
        """
        if self.global_batch_size is None and self.batch_size is None:
            raise ValueError(
                "ElasticSampler.advance needs batch_size= (the DataLoader's batch size per rank) or "
                "global_batch_size= to know how many samples a step consumed"
            )
        for _ in range(steps):
            bounds = next(self._step_bounds(), None)
            if bounds is None:
                raise ValueError(f"epoch {self.epoch} has no samples left to consume")
            self.consumed = bounds[1]
            self.step += 1
        report(self.step)
        return self.step

    def last_step_indices(self) -> list[int]:
        """The global sample indices (every rank's) of the step :meth:`advance` completed last in this
        epoch; empty at an epoch's start. Names the samples of a step the integrity guard stopped at."""
        if self.consumed <= 0:
            return []
        start = (self.consumed - 1) // self.step_size * self.step_size
        return self._permutation()[start : self.consumed]

    @property
    def epoch_done(self) -> bool:
        """True when no step is left in this epoch."""
        return next(self._step_bounds(), None) is None

    def state_dict(self) -> dict[str, Any]:
        """The position to save with the checkpoint: epoch, samples consumed in it and steps completed.

        Also the dataset size, seed and shuffle flag, which :meth:`load_state_dict` checks. The state
        does not depend on the world size: it resumes at any other.
        """
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "step": self.step,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a :meth:`state_dict` saved at this or any other world size.

        Raises:
            ValueError: ``state`` was saved with another dataset size, seed or shuffle flag (resuming
                would skip or repeat samples), or its position lies outside the dataset.
        """
        for name in ("num_samples", "seed", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"the sampler state was saved with {name}={state[name]!r}, this sampler has "
                    f"{getattr(self, name)!r}: resuming would skip or repeat samples"
                )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed={consumed} is outside the dataset of {self.num_samples} samples")
        self.epoch, self.consumed, self.step = int(state["epoch"]), consumed, int(state.get("step", 0))


class _BatchSampler:
    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.sampler.steps():
            yield from (micro for micro in step.micro_batches if micro)

    def __len__(self) -> int:
        return sum(sum(1 for m in step.micro_batches if m) for step in self.sampler.steps())
