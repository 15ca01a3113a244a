"""Flash checkpoints for Lightning: ``ElasticCheckpoint``, a callback, and ``ElasticDataLoader``.

``ElasticCheckpoint(every_n_steps=1)`` saves, every N optimizer steps, what Lightning's own checkpoint
holds for a resume (the module's weights, the optimizers, the LR schedulers, the precision plugin, the
datamodule's state, the fit loop's progress) plus every rank's RNG states, with :func:`elastic.save`: a
memory copy into the agent's shared memory, persisted in the background. At fit start it restores the
newest step any rank holds (:func:`elastic.load`: memory first, then ``--ckpt-dir``), before Lightning
builds its data iterator, so the loop goes on with the next batch and a restart redoes at most the step
it interrupted. The data position is exact when the training DataLoader is an :class:`ElasticDataLoader`
(an :class:`elastic.ElasticSampler` under it), which the callback advances after each batch and which
Lightning saves and restores with its loop state (a resumable loader, in Lightning's words)::

    from elastic.integrations.lightning import ElasticCheckpoint, ElasticDataLoader

    sampler = elastic.ElasticSampler(dataset, batch_size=32, seed=0)
    loader = ElasticDataLoader(dataset, sampler=sampler)
    trainer = L.Trainer(callbacks=[ElasticCheckpoint(every_n_steps=1)], use_distributed_sampler=False)
    trainer.fit(model, loader)

Importing this module imports Lightning (``lightning.pytorch``); ``import elastic`` never does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from elastic.checkpoint import replicated
from elastic.checkpoint.env import CheckpointError
from elastic.integrations import loop_checkpoint
from elastic.sampler import ElasticSampler

log = logging.getLogger(__name__)

#: Written into every checkpoint of this callback, so that a checkpoint of another framework's loop is
#: refused with a clear message rather than half-loaded.
FRAMEWORK = "lightning"


class ElasticDataLoader(DataLoader):
    """A DataLoader over an :class:`elastic.ElasticSampler` whose position Lightning saves and restores.

    It yields the sampler's batches (``batch_size`` is the sampler's) and is *resumable* for Lightning:
    ``state_dict``/``load_state_dict`` are the sampler's, so the position travels in the fit loop's state
    (which :class:`ElasticCheckpoint` saves) and is restored before the first batch is drawn. The sampler
    must count per-rank batches (``ElasticSampler(..., batch_size=B)``); accumulate with the Trainer's
    ``accumulate_grad_batches``. Pass ``use_distributed_sampler=False`` to the Trainer so that Lightning
    keeps this sampler.

    Args:
        dataset: the map-style dataset the sampler indexes.
        sampler: the :class:`elastic.ElasticSampler` (``batch_size`` set, ``global_batch_size`` not).
        **kwargs: other DataLoader arguments (``num_workers``, ``collate_fn``...), not ``shuffle``,
            ``batch_sampler`` or ``drop_last`` (the sampler's), nor another ``batch_size``.

    Raises:
        TypeError: ``sampler`` is not an ElasticSampler (Lightning replaced it: see above).
        ValueError: the sampler has no ``batch_size`` or has a ``global_batch_size``, or ``kwargs`` sets
            what the sampler decides.
    """

    def __init__(self, dataset: Dataset[Any], sampler: ElasticSampler, **kwargs: Any) -> None:
        if not isinstance(sampler, ElasticSampler):
            raise TypeError(
                f"ElasticDataLoader needs an elastic.ElasticSampler, got {type(sampler).__name__}: with "
                "Lightning, pass Trainer(use_distributed_sampler=False) so that it keeps the sampler"
            )
        if sampler.batch_size is None or sampler.global_batch_size is not None:
            raise ValueError(
                "ElasticDataLoader needs ElasticSampler(..., batch_size=B) without global_batch_size: one "
                "DataLoader batch per rank is one sampler step (accumulate with accumulate_grad_batches)"
            )
        if kwargs.pop("batch_size", sampler.batch_size) != sampler.batch_size:
            raise ValueError(f"ElasticDataLoader: the batch size is the sampler's ({sampler.batch_size})")
        for name in ("shuffle", "batch_sampler", "drop_last"):
            if name in kwargs:
                raise ValueError(f"ElasticDataLoader: {name} is the sampler's to decide; leave it out")
        # Without a generator of its own, each new iterator draws its workers' base seed from torch's global
        # RNG: a restarted run (which creates one more iterator) would then see other dropout masks.
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, batch_size=sampler.batch_size, sampler=sampler, **kwargs)
        self.elastic_sampler = sampler

    def __len__(self) -> int:
        """Batches of a whole epoch, wherever the position is.

        Lightning sizes every epoch by this length when the loop starts; the sampler's own length is what
        is left of the current epoch, which after a restore mid-epoch would shorten all later epochs.
        """
        sampler = self.elastic_sampler
        whole = ElasticSampler(
            sampler.num_samples,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            batch_size=sampler.batch_size,
        )
        return math.ceil(len(whole) / (sampler.batch_size or 1))

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position (Lightning keeps it in the fit loop's state)."""
        return self.elastic_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (called by Lightning before it draws the first batch)."""
        self.elastic_sampler.load_state_dict(state)


def _loaders(train_dataloader: Any) -> Iterator[Any]:
    """The DataLoaders of ``trainer.train_dataloader``: one, or a list/tuple/dict of them (nested)."""
    if isinstance(train_dataloader, dict):
        for value in train_dataloader.values():
            yield from _loaders(value)
    elif isinstance(train_dataloader, (list, tuple)):
        for value in train_dataloader:
            yield from _loaders(value)
    elif train_dataloader is not None:
        yield train_dataloader


class ElasticCheckpoint(pl.Callback):
    """Save a flash checkpoint every ``every_n_steps`` optimizer steps; resume from the newest at fit start.

    Every rank calls :func:`elastic.save` with the same state (the agent's node keeps one copy and node
    rank 0's agent persists it in the background), at ``on_train_batch_end`` after an optimizer step whose
    ``trainer.global_step`` is a multiple of ``every_n_steps``, and at ``on_train_end`` for the last step.
    The step number of a checkpoint is ``trainer.global_step``. ``on_fit_start`` calls
    :func:`elastic.load` (every rank the same step) and, when a checkpoint exists, restores it into the
    module, optimizers, schedulers and fit loop, and each rank's RNG states: Lightning then continues with
    the batch after the restored step. Do not also pass ``ckpt_path`` to ``fit``: it would be restored
    after this callback's state.

    Args:
        every_n_steps: save after every N-th optimizer step (1: a restart redoes at most one step).
        ckpt_dir: the disk folder of :func:`elastic.save`/:func:`elastic.load`; default ``--ckpt-dir``
            (``ELASTIC_CKPT_DIR``).

    Attributes:
        resumed_step: the step restored at fit start, or None on a fresh start.
    """

    def __init__(self, every_n_steps: int = 1, ckpt_dir: str | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.ckpt_dir = ckpt_dir
        self.resumed_step: int | None = None
        self._saved_step: int | None = None
        self._enabled = True

    # -- restore ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restore the newest checkpoint any rank holds (a collective: every rank calls it)."""
        self._enabled = loop_checkpoint.checkpoints_enabled(self.ckpt_dir, type(self).__name__)
        resumed = replicated.load(self.ckpt_dir) if self._enabled else None
        if resumed is None:
            self._saved_step = trainer.global_step
            return
        state, step = resumed
        loop_checkpoint.check_written_by(state, step, FRAMEWORK, type(self).__name__)
        _load_each(step, "optimizers", trainer.optimizers, state["optimizers"])
        _load_each(
            step, "LR schedulers", [c.scheduler for c in trainer.lr_scheduler_configs], state["lr_schedulers"]
        )
        pl_module.load_state_dict(state["model"])
        trainer.precision_plugin.load_state_dict(state["precision"])
        datamodule = getattr(trainer, "datamodule", None)  # set by fit(), not declared on the class
        if datamodule is not None and "datamodule" in state:
            datamodule.load_state_dict(state["datamodule"])
        # Lightning reads the progress (epoch, batch, global step, and a resumable loader's position) when
        # it starts the loop: the next batch is the one after the restored step.
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        if not loop_checkpoint.restore_rng(state[loop_checkpoint.RNG_KEY], trainer.global_rank):
            log.warning(
                "no RNG states saved for rank %d (the world grew): it keeps its own",
                trainer.global_rank,
            )
        self.resumed_step = self._saved_step = step
        log.info("ElasticCheckpoint: resumed from step %d", step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Warn once when the data position cannot be restored exactly (the loaders exist from here on)."""
        for loader in _loaders(trainer.train_dataloader):
            if not all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict")):
                log.warning(
                    "ElasticCheckpoint: the training DataLoader (%s) cannot save its position: a restart in "
                    "the middle of an epoch starts that epoch over; use "
                    "elastic.integrations.lightning.ElasticDataLoader for an exact position",
                    type(loader).__name__,
                )
                return

    # -- save -------------------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Advance the ElasticSamplers (this batch is consumed); save when an N-th optimizer step ended."""
        for loader in _loaders(trainer.train_dataloader):
            if isinstance(loader, ElasticDataLoader):
                loader.elastic_sampler.advance()
        step = trainer.global_step
        if not self._enabled:
            return
        # The step does not move while gradients accumulate: the saves land on optimizer-step boundaries.
        if step != self._saved_step and step % self.every_n_steps == 0:
            self._save(trainer, pl_module, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save the last step when the loop ended between two saves."""
        if self._enabled and trainer.global_step != self._saved_step:
            self._save(trainer, pl_module, trainer.global_step)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        state: dict[str, Any] = {
            loop_checkpoint.FRAMEWORK_KEY: FRAMEWORK,
            "model": pl_module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": trainer.precision_plugin.state_dict(),
            "fit_loop": trainer.fit_loop.state_dict(),
            loop_checkpoint.RNG_KEY: loop_checkpoint.gather_rng(),  # a collective: every rank is here
        }
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            state["datamodule"] = datamodule.state_dict()
        replicated.save(state, step, self.ckpt_dir)
        self._saved_step = step


def _load_each(step: int, what: str, targets: list[Any], states: list[Any]) -> None:
    if len(targets) != len(states):
        raise CheckpointError(
            f"the checkpoint of step {step} holds {len(states)} {what}, this trainer has {len(targets)}: "
            "configure_optimizers must return what it returned when the checkpoint was written"
        )
    for target, saved in zip(targets, states, strict=True):
        target.load_state_dict(saved)
