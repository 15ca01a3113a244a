"""A Hugging Face Trainer script with flash checkpoints: ``ElasticTrainerCallback`` saves every step.

Run it under elastic-run (the Trainer reads torchrun's environment, which elastic-run sets)::

    elastic-run --standalone --nproc-per-node 2 --ckpt-dir ckpt scripts/examples/hf_trainer_train.py

The lines that differ from a plain Trainer script are marked ``# elastic``: the callback, and the
``with`` block that hands the newest flash checkpoint to ``train(resume_from_checkpoint=...)``. The model
is a one-layer GPT-2 built from its configuration (nothing is downloaded), with dropout, so that the RNG
states matter. A worker killed at any moment costs at most the step it was in; the final weights are those
of a run without the kill (``tests/e2e/test_frameworks_huggingface.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from elastic.integrations.huggingface import ElasticTrainerCallback

VOCAB, LENGTH = 64, 12


class Tokens(Dataset):
    """Fixed random token sequences: the same on every rank and in every run."""

    def __init__(self, samples: int) -> None:
        self.ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Progress(TrainerCallback):
    """Prints a start line and one line per step (after the elastic callback, listed before it, saved)."""

    def __init__(self, hold_at_step: int) -> None:
        self.hold_at_step = hold_at_step

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(
            f"start rank={args.process_index} world={args.world_size} restart={restart} "
            f"resumed_step={state.global_step}",
            flush=True,
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if args.process_index == 0:
            print(f"step={state.global_step}", flush=True)
        if state.global_step == self.hold_at_step and args.process_index == 0:
            # Test hook: rank 0 stops here, right after a save, until the test has killed a worker; the
            # agent's stop then ends it (SIGTERM, default action).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                signal.pause()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    parser.add_argument("--every-n-steps", type=int, default=1, help="flash checkpoint interval")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--final-weights", default="", help="rank 0 writes the final state_dict here")
    parser.add_argument("--hold-at-step", type=int, default=-1, help="test hook: rank 0 waits here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    training = TrainingArguments(
        output_dir="hf-output",  # the Trainer writes nothing there (save_strategy="no")
        use_cpu=True,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-2,
        warmup_steps=2,
        seed=0,
        save_strategy="no",  # flash checkpoints replace the Trainer's folders
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    checkpoints = ElasticTrainerCallback(every_n_steps=args.every_n_steps)  # elastic
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(args.samples),
        callbacks=[checkpoints, Progress(args.hold_at_step)],  # elastic: the callback
    )
    with checkpoints.resume_checkpoint(trainer) as folder:  # elastic: None on a fresh start
        trainer.train(resume_from_checkpoint=folder)
    if training.process_index == 0:
        if args.final_weights:
            Path(args.final_weights).parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), args.final_weights)  # trained in place (the Trainer wraps it)
        print(f"done step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
