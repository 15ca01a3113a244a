"""Example DDP training job for elastic-run: a small MLP fit to synthetic regression data.

    elastic-run --standalone --nproc-per-node 2 scripts/train_script.py

It runs at any world size: each step takes one global batch, fixed by the seed and the step number,
and every rank trains on its own shard of it (rows ``rank::world_size``), so a restart with another
world size continues the same sequence of batches. It resumes from the newest checkpoint in
``--ckpt-dir`` and saves one every ``--ckpt-every`` steps and at the end.

Output (stdout, rank 0 only except the first line, which every rank prints)::

    start rank=R world=W restart=<TORCHELASTIC_RESTART_COUNT> resumed_step=S
    step=N loss=X.XXXX world=W
    done step=N
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic

IN_FEATURES = 64
HIDDEN = 1024
NUM_SAMPLES = 16384


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=700, help="total training steps (default: %(default)s)")
    parser.add_argument(
        "--ckpt-dir",
        default=os.environ.get("ELASTIC_CKPT_DIR") or "./checkpoints",
        help="checkpoint directory (default: $ELASTIC_CKPT_DIR, else ./checkpoints)",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        help="save every N steps, 0: only at the end (default: %(default)s)",
    )
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds to sleep per step (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=512, help="global batch size (default: %(default)s)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of data and initial weights (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-always", action="store_true", help="raise an error after start (tests the failure path)"
    )
    parser.add_argument(
        "--dump-env",
        metavar="PATH",
        help="write each rank's environment as JSON to PATH ({rank} is substituted)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "ckpt_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.batch_size < 1 or args.step_time < 0:
        parser.error("--batch-size must be >= 1 and --step-time >= 0")
    return args


def log(message: str) -> None:
    print(message, flush=True)


def dump_env(path_template: str, rank: int) -> None:
    path = Path(path_template.replace("{rank}", str(rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(os.environ), indent=1, sort_keys=True))
    os.replace(tmp, path)  # readers never see a half-written file


def make_dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic regression data: a fixed random teacher network plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    w1 = torch.randn(IN_FEATURES, 32, generator=gen) / IN_FEATURES**0.5
    w2 = torch.randn(32, 1, generator=gen) / 32**0.5
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(NUM_SAMPLES, 1, generator=gen)
    return x, y


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )


def global_batch_indices(step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Sample indices of the global batch of ``step``: a function of (seed, step) only, not of the world."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, NUM_SAMPLES, (batch_size,), generator=gen)


def train(args: argparse.Namespace) -> None:
    elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the world size {world}")

    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    resumed = elastic.load_latest(args.ckpt_dir)
    if resumed is not None:
        state, step = resumed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log(f"start rank={rank} world={world} restart={restart} resumed_step={step}")
    if args.fail_always:
        raise RuntimeError("injected failure")

    ddp_model = DistributedDataParallel(model)
    x, y = make_dataset(args.seed)
    loss_fn = nn.MSELoss()
    saved_step = step
    while step < args.steps:
        shard = global_batch_indices(step, args.batch_size, args.seed)[rank::world]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp_model(x[shard]), y[shard])
        loss.backward()  # DDP averages the gradients over ranks: the step sees the whole global batch
        optimizer.step()
        step += 1

        # Log the mean over ranks, so the curve does not depend on the world size.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
        if rank == 0:
            log(f"step={step} loss={mean_loss.item() / world:.4f} world={world}")
        if args.ckpt_every and step % args.ckpt_every == 0:
            elastic.save(checkpoint_state(model, optimizer), step, args.ckpt_dir, rank=rank)
            saved_step = step
        if args.step_time:
            time.sleep(args.step_time)

    if saved_step != step:
        elastic.save(checkpoint_state(model, optimizer), step, args.ckpt_dir, rank=rank)
    # Nobody leaves before rank 0 has written the final checkpoint; rank 0 also hosts the TCPStore.
    dist.barrier()
    if rank == 0:
        log(f"done step={step}")


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dump_env:
        dump_env(args.dump_env, int(os.environ.get("RANK", "0")))
    try:
        train(args)
    finally:
        elastic.destroy_process_group()


if __name__ == "__main__":
    main()
