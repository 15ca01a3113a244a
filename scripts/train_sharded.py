"""Example sharded (FSDP2) training job for elastic-run: the small MLP of train_script.py, its weights and
optimizer state sharded over the ranks, checkpointed with ``elastic.save_sharded`` (DCP format).

    elastic-run --standalone --nproc-per-node 2 scripts/train_sharded.py

Each rank holds only its shard of every parameter and momentum buffer (``fully_shard``; gloo on CPU,
nccl on GPUs). Under elastic-run the state is flash-saved after every step into the agent's shared
memory, each rank writing its own shards; the agent streams the node's newest save to a peer node's
agent (``--replicas``) and persists it to ``--ckpt-dir`` in the background. A restart, also at another
world size, resumes with ``elastic.load_sharded`` from the newest step the job holds anywhere: a lost
node's shards come from the replica a peer keeps, DCP re-shards them for the new world. Without an agent
it saves to ``--ckpt-dir`` every ``--ckpt-every`` steps and at the end.

Data: an ``elastic.ElasticSampler`` deals each step the next ``--batch-size`` samples over the ranks
(its position is part of the checkpoint), so no sample is skipped or repeated across restarts.

Output (stdout, rank 0 only except the first line, which every rank prints)::

    start rank=R world=W restart=<TORCHELASTIC_RESTART_COUNT> resumed_step=S
    step=N loss=X.XXXX world=W
    done step=N
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import elastic
from elastic.checkpoint.replicated import flash_enabled
from elastic.sampler import ElasticSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_script import IN_FEATURES, log, make_dataset, step_batches  # noqa: E402 - the sibling example

HIDDEN = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="total training steps (default: %(default)s)")
    parser.add_argument(
        "--ckpt-dir",
        default=os.environ.get("ELASTIC_CKPT_DIR") or "",
        help="checkpoint folder all ranks share (default: $ELASTIC_CKPT_DIR); required without elastic-run, "
        "'' under elastic-run: memory and peers' replicas only",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        help="without elastic-run: save every N steps, 0: only at the end (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default: %(default)s)")
    parser.add_argument("--num-samples", type=int, default=4096, help="dataset size (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.005, help="SGD learning rate (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of data, weights, order (default: %(default)s)"
    )
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds to sleep per step (default: %(default)s)"
    )
    parser.add_argument(
        "--final-weights", metavar="PATH", help="rank 0 writes the full final weights to PATH (torch.save)"
    )
    args = parser.parse_args(argv)
    if args.steps < 0 or args.ckpt_every < 0 or args.step_time < 0:
        parser.error("--steps, --ckpt-every and --step-time must be >= 0")
    if args.batch_size < 1 or args.num_samples < args.batch_size:
        parser.error("--batch-size must be >= 1 and --num-samples at least --batch-size")
    return args


def make_model(seed: int) -> nn.Module:
    """The MLP, each Linear sharded on its own (FSDP2), then the whole."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler) -> dict:
    """The DCP state dict: sharded weights and momentum (DTensors), the sampler position (plain values)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "sampler": sampler.state_dict()}


def restore(
    state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler
) -> None:
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sampler.load_state_dict(state["sampler"])


def train(args: argparse.Namespace) -> None:
    elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the world size {world}")
    flash = flash_enabled()
    if not flash and not args.ckpt_dir:
        raise SystemExit("train_sharded.py: --ckpt-dir is required without elastic-run")
    ckpt_dir = args.ckpt_dir or None

    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(
        args.num_samples,
        num_replicas=world,
        rank=rank,
        seed=args.seed,
        drop_last=True,
        global_batch_size=args.batch_size,
    )
    state = checkpoint_state(model, optimizer, sampler)
    step = elastic.load_sharded(state, ckpt_dir=ckpt_dir) or 0  # every rank: the same step
    if step:
        restore(state, model, optimizer, sampler)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log(f"start rank={rank} world={world} restart={restart} resumed_step={step}")

    x, y = make_dataset(args.seed, args.num_samples)
    loss_fn = nn.MSELoss(reduction="sum")
    batches = step_batches(sampler)
    saved_step = step
    while step < args.steps:
        batch = next(batches)
        rows = torch.tensor([i for micro in batch.micro_batches for i in micro], dtype=torch.long)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[rows]), y[rows])
        # FSDP averages gradients over ranks: scaled so, the gradient is the mean over the global batch.
        (loss * (world / batch.global_size)).backward()
        optimizer.step()
        step += 1
        sampler.advance()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum)
        if flash or step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0):
            elastic.save_sharded(checkpoint_state(model, optimizer, sampler), step, ckpt_dir)
            saved_step = step
        if rank == 0:
            log(f"step={step} loss={loss_sum.item() / batch.global_size:.4f} world={world}")
        if args.step_time:
            time.sleep(args.step_time)
    if saved_step != step:
        elastic.save_sharded(checkpoint_state(model, optimizer, sampler), step, ckpt_dir)
    # Every rank takes part in gathering the full weights; rank 0 writes them.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        if args.final_weights:
            Path(args.final_weights).parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, args.final_weights)
        log(f"done step={step}")
    dist.barrier()  # rank 0 hosts the TCPStore: nobody tears the group down while others still use it


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    finally:
        elastic.destroy_process_group()


if __name__ == "__main__":
    main()
