"""Example of in-process recovery: the MLP of train_script.py, trained under ``elastic.run``.

    elastic-run --standalone --nproc-per-node 2 scripts/train_inprocess.py

When a worker or a node is lost, or a node joins, the live workers keep their processes: they leave the
step, the group re-forms around them at the new world size, the replaced ranks receive the state of the
newest committed step from a live peer, and training goes on from there (docs/inprocess.md). Every
``--ckpt-every`` steps the state is also flash-saved to the agent's memory (and persisted to
``--ckpt-dir`` when given): what a fallback to a process restart resumes from.

Output (stdout): every rank prints a line each time its world forms, rank 0 one line per step::

    world rank=R world=W round=N restart=C step=S pid=P state=<SHA-256 of the weights and optimizer state>
    step=N loss=X.XXXX world=W
    done step=N
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic
from elastic.checkpoint.replicated import flash_enabled
from elastic.sampler import ElasticSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_script import (  # noqa: E402 - the sibling example
    NUM_SAMPLES,
    SampleLog,
    log,
    make_dataset,
    make_model,
    step_batches,
    weights_hash,
    write_final,
)


def state_hash(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the weights and the optimizer's tensors: equal on every rank of a world."""
    digest = hashlib.sha256(weights_hash(model).encode())
    for _, per_param in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(per_param.items()):
            if isinstance(value, torch.Tensor):
                digest.update(name.encode())
                digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=700, help="total training steps (default: %(default)s)")
    parser.add_argument(
        "--batch-size", type=int, default=512, help="global batch size (default: %(default)s)"
    )
    parser.add_argument(
        "--num-samples", type=int, default=NUM_SAMPLES, help="dataset size (default: %(default)s)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, weights and order (default: 0)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds to sleep per step")
    parser.add_argument(
        "--ckpt-dir",
        default=os.environ.get("ELASTIC_CKPT_DIR", ""),
        help="persist the checkpoints here too (default: $ELASTIC_CKPT_DIR, else memory only)",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        help="checkpoint every N steps for a fallback to process restart (default: %(default)s)",
    )
    parser.add_argument(
        "--reform-timeout",
        type=float,
        default=60.0,
        help="seconds a re-formed group may take before the agent falls back to restarting processes "
        "(default: %(default)s)",
    )
    parser.add_argument("--final-hash", metavar="PATH", help="rank 0 writes the final weights' SHA-256 here")
    parser.add_argument("--final-weights", metavar="PATH", help="rank 0 writes the final weights here")
    parser.add_argument("--sample-log", metavar="DIR", help="each rank logs the samples of its steps in DIR")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.ckpt_every < 1 or args.step_time < 0 or args.reform_timeout <= 0:
        parser.error("--steps and --step-time must be >= 0, --ckpt-every >= 1, --reform-timeout > 0")
    if args.batch_size < 1 or args.num_samples < args.batch_size:
        parser.error("--batch-size must be >= 1 and --num-samples at least --batch-size")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(
        args.num_samples,
        num_replicas=1,
        rank=0,
        seed=args.seed,
        drop_last=True,
        global_batch_size=args.batch_size,
    )
    state = {"model": model, "optimizer": optimizer, "sampler": sampler}
    step = 0
    saving = flash_enabled() or bool(args.ckpt_dir)
    if saving and (resumed := elastic.load(args.ckpt_dir or None)) is not None:
        saved, step = resumed
        for name, obj in state.items():
            obj.load_state_dict(saved[name])
    x, y = make_dataset(args.seed, args.num_samples)
    loss_fn = nn.MSELoss(reduction="sum")

    def train(world: elastic.World) -> int:
        ddp_model = DistributedDataParallel(model)  # on this world's group
        pid = os.getpid()
        log(
            f"world rank={world.rank} world={world.world_size} round={world.round} "
            f"restart={world.restart_count} step={world.step} pid={pid} state={state_hash(model, optimizer)}"
        )
        samples = SampleLog(args.sample_log, world.rank)
        batches = step_batches(sampler)
        done = world.step
        try:
            while done < args.steps:
                batch = next(batches)
                optimizer.zero_grad(set_to_none=True)
                rows = torch.tensor(batch.micro_batches[0], dtype=torch.long)
                loss = loss_fn(ddp_model(x[rows]), y[rows])
                (loss * (world.world_size / batch.global_size)).backward()
                optimizer.step()
                done = sampler.advance()
                samples.write(done, sampler.epoch, batch)
                world.commit(done)  # every rank completed the step: it is never redone
                loss_sum = loss.detach().clone()
                dist.all_reduce(loss_sum)
                if world.is_first:
                    log(
                        f"step={done} loss={loss_sum.item() / batch.global_size:.4f} world={world.world_size}"
                    )
                if saving and (done % args.ckpt_every == 0 or done == args.steps):
                    states = {n: o.state_dict() for n, o in state.items()}
                    persist = bool(args.ckpt_dir)  # memory only without a folder
                    elastic.save(states, done, args.ckpt_dir or None, rank=world.rank, persist=persist)
                if args.step_time:
                    time.sleep(args.step_time)
        finally:
            samples.close()
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done
        if world.is_first:
            write_final(args, model, done)
        return done

    try:
        elastic.run(train, state, step=step, reform_timeout_s=args.reform_timeout)
    finally:
        elastic.destroy_process_group()


if __name__ == "__main__":
    main()
