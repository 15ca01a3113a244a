"""Flash checkpoints for the Hugging Face ``Trainer``: ``ElasticTrainerCallback``.

The callback saves, every N optimizer steps, what a Trainer checkpoint folder holds for a resume (the
model's weights, the optimizer, the LR scheduler, the ``TrainerState``) plus every rank's RNG states, with
:func:`elastic.save`: a memory copy into the agent's shared memory, persisted in the background. No
Trainer checkpoint folder is written while training.

A callback cannot restore by itself: the Trainer decides how many batches to skip, and restores the
RNG states right before the first new batch, only for ``train(resume_from_checkpoint=<folder>)``, from a
folder in its own format. So :meth:`ElasticTrainerCallback.resume_checkpoint` turns the newest flash
checkpoint any rank holds (:func:`elastic.load`: memory first, then ``--ckpt-dir``) into such a folder,
in a temporary directory removed afterwards, and the Trainer's public resume does the rest, including the
data position (its own sampler, fast-forwarded)::

    from elastic.integrations.huggingface import ElasticTrainerCallback

    checkpoints = ElasticTrainerCallback(every_n_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[checkpoints])
    with checkpoints.resume_checkpoint(trainer) as folder:  # None on a fresh start
        trainer.train(resume_from_checkpoint=folder)

Importing this module imports ``transformers``; ``import elastic`` never does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import WEIGHTS_NAME

from elastic.checkpoint import replicated
from elastic.checkpoint.env import CheckpointError
from elastic.integrations import loop_checkpoint

log = logging.getLogger(__name__)

#: Written into every checkpoint of this callback, so that a checkpoint of another framework's loop is
#: refused with a clear message rather than half-loaded.
FRAMEWORK = "transformers"


class ElasticTrainerCallback(TrainerCallback):
    """Save a flash checkpoint every ``every_n_steps`` optimizer steps; resume with :meth:`resume_checkpoint`.

    Every rank calls :func:`elastic.save` with the same state (the agent's node keeps one copy and node
    rank 0's agent persists it in the background), at ``on_step_end`` when ``state.global_step`` is a
    multiple of ``every_n_steps``, and at ``on_train_end`` for the last step. The step number of a
    checkpoint is ``state.global_step``. The Trainer's own ``save_strategy`` is independent: ``"no"`` is
    fine, flash checkpoints need no Trainer checkpoint folder.

    Args:
        every_n_steps: save after every N-th optimizer step (1: a restart redoes at most one step).
        ckpt_dir: the disk folder of :func:`elastic.save`/:func:`elastic.load`; default ``--ckpt-dir``
            (``ELASTIC_CKPT_DIR``).

    Attributes:
        resumed_step: the step :meth:`resume_checkpoint` restored, or None on a fresh start.
    """

    def __init__(self, every_n_steps: int = 1, ckpt_dir: str | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.ckpt_dir = ckpt_dir
        self.resumed_step: int | None = None
        self._saved_step: int | None = None
        self._enabled = loop_checkpoint.checkpoints_enabled(ckpt_dir, type(self).__name__)

    # -- save -------------------------------------------------------------------------------------------
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save after every N-th optimizer step (the Trainer calls this once the step's update is done)."""
        step = state.global_step
        if self._enabled and step != self._saved_step and step % self.every_n_steps == 0:
            self._save(state, kwargs, step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save the last step when training ended between two saves."""
        if self._enabled and state.global_step != self._saved_step:
            self._save(state, kwargs, state.global_step)

    def _save(self, state: TrainerState, objects: dict[str, Any], step: int) -> None:
        model, optimizer, scheduler = (objects.get(k) for k in ("model", "optimizer", "lr_scheduler"))
        if model is None or optimizer is None or scheduler is None:
            raise CheckpointError(
                "ElasticTrainerCallback: the Trainer passed no model, optimizer or lr_scheduler to the "
                "callback; add it with Trainer(callbacks=[...]) rather than calling it yourself"
            )
        checkpoint = {
            loop_checkpoint.FRAMEWORK_KEY: FRAMEWORK,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            # As the Trainer writes trainer_state.json: the resume reads global_step and epoch from it.
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
            loop_checkpoint.RNG_KEY: loop_checkpoint.gather_rng(),  # a collective: every rank is here
        }
        replicated.save(checkpoint, step, self.ckpt_dir)
        self._saved_step = step

    # -- restore ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resume_checkpoint(self, trainer: Trainer) -> Iterator[str | None]:
        """The newest flash checkpoint as a Trainer checkpoint folder, for ``train(resume_from_checkpoint=)``.

        A collective (:func:`elastic.load`): call it on every rank, after the Trainer is built (its
        arguments set up the process group). Yields None when no rank holds a checkpoint (a fresh start),
        else the path of a temporary folder in the Trainer's format (the weights as ``pytorch_model.bin``,
        ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json`` and this rank's ``rng_state*.pth``),
        removed when the block ends: train inside the block.

        Raises:
            CheckpointError: the newest checkpoint was not written by this callback, or none loads.
        """
        _ = trainer.args.device  # sets up accelerate's state, and the process group, if not done yet
        resumed = replicated.load(self.ckpt_dir) if self._enabled else None
        if resumed is None:
            self._saved_step = 0
            yield None
            return
        state, step = resumed
        loop_checkpoint.check_written_by(state, step, FRAMEWORK, type(self).__name__)
        folder = Path(tempfile.mkdtemp(prefix="elastic-hf-resume-"))
        try:
            _write_trainer_folder(folder, state, trainer)
            self.resumed_step = self._saved_step = step
            log.info("ElasticTrainerCallback: resuming from step %d", step)
            yield str(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _write_trainer_folder(folder: Path, state: dict[str, Any], trainer: Trainer) -> None:
    """The files ``Trainer.train(resume_from_checkpoint=folder)`` reads, in the Trainer's names and layout."""
    torch.save(state["model"], folder / WEIGHTS_NAME)
    torch.save(state["optimizer"], folder / OPTIMIZER_NAME)
    torch.save(state["lr_scheduler"], folder / SCHEDULER_NAME)
    (folder / TRAINER_STATE_NAME).write_text(state["trainer_state"], encoding="utf-8")
    rank, world = trainer.args.process_index, trainer.args.world_size
    saved = loop_checkpoint.unpack_rng(state[loop_checkpoint.RNG_KEY], rank)
    if saved is None:
        log.warning("no RNG states saved for rank %d (the world grew): it keeps its own", rank)
        return
    rng: dict[str, Any] = {"python": saved["python"], "numpy": saved["numpy"], "cpu": saved["torch"]}
    if saved["cuda"]:
        # The Trainer restores every device's state in distributed runs, the current one's otherwise.
        rng["cuda"] = saved["cuda"] if world > 1 else saved["cuda"][torch.cuda.current_device()]
    torch.save(rng, folder / ("rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"))
