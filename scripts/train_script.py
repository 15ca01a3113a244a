"""Example DDP training job for elastic-run: a small MLP fit to synthetic regression data.

    elastic-run --standalone --nproc-per-node 2 scripts/train_script.py

It runs at any world size: an ``elastic.ElasticSampler`` deals each step the next ``--batch-size``
samples of the epoch's permutation, split over the ranks, and the loss is scaled so that every update
is the mean over that global batch. A restart, at the same or another world size, resumes from the
checkpoint every rank holds (``elastic.load``: the agent's memory first, then ``--ckpt-dir``) and
continues with the next global batch: no sample is skipped or repeated, and with a fixed world size
the final weights are bitwise those of an uninterrupted run.

Under elastic-run the state (weights, optimizer, sampler position, RNG) is flash-saved to the agent's
shared memory after every step, and the agent persists every ``--ckpt-every``-th save (and the last)
to ``--ckpt-dir`` in the background. Without an agent it is saved to ``--ckpt-dir`` every
``--ckpt-every`` steps and at the end.

Output (stdout, rank 0 only except the first line, which every rank prints)::

    start rank=R world=W restart=<TORCHELASTIC_RESTART_COUNT> resumed_step=S
    step=N loss=X.XXXX world=W
    done step=N
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic
from elastic.checkpoint.replicated import flash_enabled
from elastic.sampler import ElasticSampler, StepBatch

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
        help="checkpoint directory (default: $ELASTIC_CKPT_DIR, else ./checkpoints); '' under elastic-run: "
        "memory only (the agents' shared memory, replicated on every node)",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        help="persist (without elastic-run: save) every N steps, 0: only at the end (default: %(default)s)",
    )
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds to sleep per step (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=512, help="global batch size (default: %(default)s)"
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=NUM_SAMPLES,
        help="dataset size; an epoch is num-samples / batch-size steps (default: %(default)s)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="largest batch per rank and forward pass; more samples per rank are accumulated "
        "(default: the rank's whole share)",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of data, initial weights and order (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-always", action="store_true", help="raise an error after start (tests the failure path)"
    )
    parser.add_argument(
        "--dump-env",
        metavar="PATH",
        help="write each rank's environment as JSON to PATH ({rank} is substituted)",
    )
    parser.add_argument(
        "--final-hash", metavar="PATH", help="rank 0 writes the SHA-256 of the final weights to PATH"
    )
    parser.add_argument(
        "--final-weights", metavar="PATH", help="rank 0 writes the final weights to PATH (torch.save)"
    )
    parser.add_argument(
        "--sample-log",
        metavar="DIR",
        help="each rank appends the sample indices of every step to a file in DIR",
    )
    parser.add_argument(
        "--hold-at-step",
        type=int,
        metavar="N",
        help="test hook: after step N is saved and logged, every rank waits until it is killed",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "ckpt_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.num_samples < args.batch_size:
        parser.error("--num-samples must be at least --batch-size")
    if args.batch_size < 1 or args.step_time < 0:
        parser.error("--batch-size must be >= 1 and --step-time >= 0")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        parser.error("--micro-batch-size must be >= 1")
    return args


def log(message: str) -> None:
    print(message, flush=True)


def dump_env(path_template: str, rank: int) -> None:
    path = Path(path_template.replace("{rank}", str(rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(os.environ), indent=1, sort_keys=True))
    os.replace(tmp, path)  # readers never see a half-written file


def make_dataset(seed: int, num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic regression data: a fixed random teacher network plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=gen)
    w1 = torch.randn(IN_FEATURES, 32, generator=gen) / IN_FEATURES**0.5
    w2 = torch.randn(32, 1, generator=gen) / 32**0.5
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(num_samples, 1, generator=gen)
    return x, y


def make_model(seed: int) -> nn.Module:
    # tanh, not ReLU: runs at different world sizes sum gradients in another order, and a ReLU input that
    # rounding moves across zero made two such runs of this MLP end 30 % apart (4e-6 with tanh).
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


def step_batches(sampler: ElasticSampler) -> Iterator[StepBatch]:
    """This rank's share of every step from the sampler's position on, epoch after epoch."""
    while True:
        yield from sampler.steps()
        sampler.set_epoch(sampler.epoch + 1)


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def restore(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    if "rng" in state:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])


def weights_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class SampleLog:
    """``<dir>/round<R>-rank<N>-pid<P>.log``: one line per step, ``STEP EPOCH INDEX...``."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self._file = None
        if directory:
            attempt = os.environ.get("ELASTIC_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            Path(directory).mkdir(parents=True, exist_ok=True)
            name = f"round{attempt}-rank{rank}-pid{os.getpid()}.log"
            self._file = open(Path(directory) / name, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, step: int, epoch: int, batch: StepBatch) -> None:
        if self._file is not None:
            indices = [i for micro in batch.micro_batches for i in micro]
            self._file.write(f"{step} {epoch} {' '.join(map(str, indices))}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def train(args: argparse.Namespace) -> None:
    backend = elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    # NCCL (picked when CUDA is present) reduces GPU tensors only: the model and data live on this rank's GPU.
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the world size {world}")

    model = make_model(args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(
        args.num_samples,
        num_replicas=world,
        rank=rank,
        seed=args.seed,
        drop_last=True,
        global_batch_size=args.batch_size,
        batch_size=args.micro_batch_size,
    )
    step = 0
    resumed = elastic.load(args.ckpt_dir)  # the same step on every rank: memory first, then disk
    if resumed is not None:
        state, step = resumed
        restore(state, model, optimizer, sampler)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log(f"start rank={rank} world={world} restart={restart} resumed_step={step}")
    if args.fail_always:
        raise RuntimeError("injected failure")
    if step >= args.steps and rank == 0:
        log(
            f"resumed at step {step} of --steps {args.steps}: nothing left to train "
            f"(delete {args.ckpt_dir or 'the checkpoints'} to train again)"
        )

    flash = flash_enabled()  # under elastic-run: save to memory every step, persist every --ckpt-every
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Report compute time (step time minus the wait for slower ranks) so the master can name a straggler.
    elastic.track_ddp(ddp_model)
    x, y = (t.to(device) for t in make_dataset(args.seed, args.num_samples))
    loss_fn = nn.MSELoss(reduction="sum")
    samples = SampleLog(args.sample_log, rank)
    batches = step_batches(sampler)
    saved_step = step
    while step < args.steps:
        batch = next(batches)
        samples.write(step + 1, sampler.epoch, batch)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        last = len(batch.micro_batches) - 1
        for i, micro in enumerate(batch.micro_batches):
            rows = torch.tensor(micro, dtype=torch.long, device=device)
            # Gradients are all-reduced once per step, on the last micro-batch.
            with ddp_model.no_sync() if i < last else contextlib.nullcontext():
                loss = loss_fn(ddp_model(x[rows]), y[rows])
                # DDP averages over ranks: scaled so, the gradient is the mean over the global batch.
                (loss * (world / batch.global_size)).backward()
            loss_sum += loss.detach()
        optimizer.step()
        step += 1
        sampler.advance()  # the step's samples are consumed (also reports progress to the agent)

        # Log the mean over the global batch, so the curve does not depend on the world size.
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        persist = step == args.steps or (args.ckpt_every > 0 and step % args.ckpt_every == 0)
        if flash or persist:
            elastic.save(
                checkpoint_state(model, optimizer, sampler), step, args.ckpt_dir, rank=rank, persist=persist
            )
            saved_step = step
        if rank == 0:
            log(f"step={step} loss={loss_sum.item() / batch.global_size:.4f} world={world}")
        if step == args.hold_at_step:
            while True:
                signal.pause()  # until killed: the test's SIGKILL lands right after a save
        if args.step_time:
            time.sleep(args.step_time)
    samples.close()

    if saved_step != step:
        elastic.save(checkpoint_state(model, optimizer, sampler), step, args.ckpt_dir, rank=rank)
    # Nobody leaves before rank 0 has written the final checkpoint; rank 0 also hosts the TCPStore.
    dist.barrier()
    if rank == 0:
        write_final(args, model, step)


def write_final(args: argparse.Namespace, model: nn.Module, step: int) -> None:
    """Rank 0, at the end: ``--final-hash`` and ``--final-weights`` when asked, then the ``done`` line."""
    if args.final_hash:
        write_atomically(Path(args.final_hash), weights_hash(model) + "\n")
    if args.final_weights:
        Path(args.final_weights).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.final_weights)
    log(f"done step={step}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.ckpt_dir = args.ckpt_dir or None  # '': no disk folder
    if args.dump_env:
        dump_env(args.dump_env, int(os.environ.get("RANK", "0")))
    try:
        train(args)
    finally:
        elastic.destroy_process_group()


if __name__ == "__main__":
    main()
