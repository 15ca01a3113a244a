"""A Lightning script with flash checkpoints: ``ElasticCheckpoint`` saves every step, a restart resumes.

Run it under elastic-run (Lightning reads torchrun's environment, which elastic-run sets)::

    elastic-run --standalone --nproc-per-node 2 --ckpt-dir ckpt scripts/examples/lightning_train.py

The lines that differ from a plain Lightning script are marked ``# elastic``: the callback, and the
DataLoader whose position the callback restores (with ``use_distributed_sampler=False``, so that
Lightning keeps its sampler). A worker killed at any moment costs at most the step it was in; the final
weights are those of a run without the kill (``tests/e2e/test_frameworks_lightning.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities.types import STEP_OUTPUT, OptimizerLRSchedulerConfig
from torch import nn
from torch.utils.data import TensorDataset

import elastic
from elastic.integrations.lightning import ElasticCheckpoint, ElasticDataLoader


class Regression(L.LightningModule):
    """A small MLP with dropout (so that the RNG states matter) and a step-wise LR schedule."""

    def __init__(self, lr: float, hold_at_step: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.lr = lr
        self.hold_at_step = hold_at_step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(
            f"start rank={self.global_rank} world={self.trainer.world_size} restart={restart} "
            f"resumed_step={self.trainer.global_step}",
            flush=True,
        )

    def on_train_batch_end(self, outputs: STEP_OUTPUT, batch: list[torch.Tensor], batch_idx: int) -> None:
        # Callbacks' hooks run before the module's: the checkpoint of this step is saved by now.
        step = self.trainer.global_step
        if self.global_rank == 0:
            loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
            shown = f" loss={loss.item():.6f}" if isinstance(loss, torch.Tensor) else ""
            print(f"step={step}{shown}", flush=True)
        if step == self.hold_at_step and self.global_rank == 0:
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
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--final-weights", default="", help="rank 0 writes the final state_dict here")
    parser.add_argument("--hold-at-step", type=int, default=-1, help="test hook: rank 0 waits here")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    data = torch.Generator().manual_seed(1234)  # the same data on every rank and in every run
    x = torch.randn(args.samples, 8, generator=data)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = elastic.ElasticSampler(dataset, batch_size=args.batch_size, seed=0)  # elastic
    loader = ElasticDataLoader(dataset, sampler=sampler)  # elastic

    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_steps=args.steps,
        callbacks=[ElasticCheckpoint(every_n_steps=args.every_n_steps)],  # elastic
        use_distributed_sampler=False,  # elastic: keep the ElasticSampler
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(args.lr, args.hold_at_step)
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        if args.final_weights:
            Path(args.final_weights).parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), args.final_weights)
        print(f"done step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
