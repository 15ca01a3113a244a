"""The chaos harness's training script (bench/chaos.py): deterministic at any world size, bitwise.

A small MLP fit to synthetic data. Every step consumes the next ``--batch-size`` samples of the epoch's
permutation (:class:`elastic.ElasticSampler` with a constant global batch, split over the ranks however
many there are). Each sample's gradient is computed alone (a micro-batch of one: the same float
operations whatever the world size), scaled by 2^``--fixed-point-bits``, rounded to int64 and summed;
the ranks all-reduce those integers. Integer addition is exact in any order, so the summed gradient, and
so every update, is bitwise the same at any world size and after any recovery that resumes from a
committed step: the final weights can be compared with ``torch.equal`` against one fault-free run.

Two modes (``--mode``):

* ``restart``: a plain script; after a fault the agent restarts its processes and they resume with
  ``elastic.load`` (the newest step any rank holds: memory first, then peers, then disk);
* ``inprocess``: the loop runs inside ``elastic.run``: live workers keep their processes and re-form.

Both flash-save every step (``elastic.save(..., persist=False)``) and persist every ``--persist-every``
steps and the last. The job's end is decided by the harness: it writes a step number into
``--stop-file``; every rank reads the file before each step (the harness writes a step far enough ahead
that all ranks read the same number before reaching it) and training ends at that step.

Output: ``--step-log DIR`` gets one file per process (``pid<P>.log``): per step, the samples this rank
contributes, written just before the gradients' all-reduce (once that completed, every rank wrote its line),
and a line once the step is flash-saved; per world, a resume line::

    ROUND STEP EPOCH WORLD RANK T INDEX...
    saved ROUND STEP WORLD RANK T
    resume ROUND STEP WORLD RANK T
 Rank 0 prints ``step=N world=W`` and at the end ``done step=N``; ``--final-weights`` gets the
weights (``torch.save``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import elastic
from elastic.sampler import ElasticSampler

IN_FEATURES = 16
HIDDEN = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("restart", "inprocess"), default="restart")
    p.add_argument("--steps", type=int, default=10**9, help="stop at this step unless --stop-file says so")
    p.add_argument("--stop-file", default=None, help="a file the harness writes the last step into")
    p.add_argument("--batch-size", type=int, default=24, help="global batch (default %(default)s)")
    p.add_argument("--num-samples", type=int, default=480, help="dataset size (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--fixed-point-bits", type=int, default=32, help="gradient scale 2^k (default %(default)s)"
    )
    p.add_argument("--persist-every", type=int, default=10, help="persist every N steps and the last")
    p.add_argument("--step-log", default=None, metavar="DIR", help="per-process step logs here")
    p.add_argument("--final-weights", default=None, metavar="PATH", help="rank 0 writes the weights here")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.num_samples < args.batch_size or args.persist_every < 1:
        p.error("--batch-size >= 1, --num-samples >= --batch-size and --persist-every >= 1 are required")
    return args


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=gen)
    w = torch.randn(IN_FEATURES, 1, generator=gen)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(n, 1, generator=gen)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


class StepLog:
    """One file per process: what each completed step consumed, and each resume (see the module doc)."""

    def __init__(self, folder: str | None) -> None:
        self._fh = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._fh = open(Path(folder) / f"pid{os.getpid()}.log", "a", buffering=1)  # noqa: SIM115

    def step(self, round_: int, step: int, epoch: int, world: int, rank: int, rows: list[int]) -> None:
        if self._fh:
            ids = " ".join(map(str, rows))
            self._fh.write(f"{round_} {step} {epoch} {world} {rank} {time.time():.4f} {ids}\n")

    def saved(self, round_: int, step: int, world: int, rank: int) -> None:
        if self._fh:
            self._fh.write(f"saved {round_} {step} {world} {rank} {time.time():.4f}\n")

    def resume(self, round_: int, step: int, world: int, rank: int) -> None:
        if self._fh:
            self._fh.write(f"resume {round_} {step} {world} {rank} {time.time():.4f}\n")


class Trainer:
    """The model, optimizer, sampler and one step of exact training."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = make_model(args.seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.sampler = ElasticSampler(
            args.num_samples, num_replicas=1, rank=0, seed=args.seed, drop_last=True,
            global_batch_size=args.batch_size,
        )  # fmt: skip
        self.x, self.y = make_data(args.seed, args.num_samples)
        self.scale = float(2**args.fixed_point_bits)
        self.log = StepLog(args.step_log)
        self.stop_at = args.steps

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "sampler": self.sampler}

    def last_step(self) -> int:
        """The step to end at: ``--stop-file``'s number once the harness wrote it."""
        path = self.args.stop_file
        if path and self.stop_at == self.args.steps:
            # Not written yet: it is renamed into place, never seen half-written.
            with contextlib.suppress(OSError, ValueError):
                self.stop_at = min(self.args.steps, int(Path(path).read_text().strip()))
        return self.stop_at

    def train_step(self, rows: list[int], global_size: int, consumed: Callable[[], None]) -> None:
        """One update from this rank's ``rows``: per-sample gradients as fixed-point int64, all-reduced.
        ``consumed`` runs before the all-reduce: once it completed, every rank had run it."""
        params = list(self.model.parameters())
        total = [torch.zeros(p.shape, dtype=torch.int64) for p in params]
        loss_fn = nn.MSELoss(reduction="sum")
        for i in rows:
            self.model.zero_grad(set_to_none=True)
            loss_fn(self.model(self.x[i : i + 1]), self.y[i : i + 1]).backward()
            for acc, p in zip(total, params, strict=True):
                assert p.grad is not None
                acc += torch.round(p.grad.double() * self.scale).to(torch.int64)
        flat = torch.cat([t.flatten() for t in total])
        consumed()
        dist.all_reduce(flat)  # int64 sum: exact in any order, at any world size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = (flat[offset : offset + n].double() / self.scale / global_size).view(p.shape).float()
            offset += n
        self.optimizer.step()

    def save(self, step: int, rank: int) -> None:
        persist = step % self.args.persist_every == 0 or step >= self.last_step()
        states = {name: obj.state_dict() for name, obj in self.state().items()}
        elastic.save(states, step, None, rank=rank, persist=persist)

    def finish(self, step: int, rank: int) -> None:
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done
        if rank == 0:
            if self.args.final_weights:
                path = Path(self.args.final_weights)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self.model.state_dict(), path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            print(f"done step={step}", flush=True)


def run_restart(t: Trainer) -> None:
    """Restart mode: one world per process; resume from the newest step any rank holds."""
    elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    t.sampler.reshard(world, rank)
    step = 0
    resumed = elastic.load(None)
    if resumed is not None:
        saved, step = resumed
        for name, obj in t.state().items():
            obj.load_state_dict(saved[name])
        t.sampler.reshard(world, rank)
    round_ = int(os.environ.get("ELASTIC_ROUND", "0"))
    t.log.resume(round_, step, world, rank)
    while step < t.last_step():
        batch = next(_batches(t.sampler))
        rows, epoch = batch.micro_batches[0], t.sampler.epoch
        t.train_step(rows, batch.global_size, lambda: t.log.step(round_, step + 1, epoch, world, rank, rows))  # noqa: B023
        step = t.sampler.advance()
        t.save(step, rank)
        t.log.saved(round_, step, world, rank)
        if rank == 0:
            print(f"step={step} world={world}", flush=True)
        if t.args.step_time:
            time.sleep(t.args.step_time)
    t.finish(step, rank)


def run_inprocess(t: Trainer) -> None:
    """In-process mode: the loop inside ``elastic.run``; live workers re-form after a fault."""
    step = 0
    resumed = elastic.load(None)
    if resumed is not None:
        saved, step = resumed
        for name, obj in t.state().items():
            obj.load_state_dict(saved[name])

    def train(world: elastic.World) -> int:
        done = world.step
        t.log.resume(world.round, done, world.world_size, world.rank)
        while done < t.last_step():
            batch = next(_batches(t.sampler))
            rows, epoch, nxt = batch.micro_batches[0], t.sampler.epoch, done + 1
            t.train_step(
                rows,
                batch.global_size,
                lambda: t.log.step(world.round, nxt, epoch, world.world_size, world.rank, rows),  # noqa: B023
            )
            done = t.sampler.advance()
            t.save(done, world.rank)
            t.log.saved(world.round, done, world.world_size, world.rank)
            world.commit(done)  # every rank completed the step: it is never redone
            if world.is_first:
                print(f"step={done} world={world.world_size}", flush=True)
            if t.args.step_time:
                time.sleep(t.args.step_time)
        t.finish(done, world.rank)
        return done

    elastic.run(train, t.state(), step=step)


def _batches(sampler: ElasticSampler):  # noqa: ANN202 - a generator of StepBatch
    """This rank's share of the next step (a new epoch when the last one is used up)."""
    for batch in sampler.steps():
        yield batch
        return
    sampler.set_epoch(sampler.epoch + 1)
    yield from sampler.steps()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    trainer = Trainer(args)
    try:
        (run_inprocess if args.mode == "inprocess" else run_restart)(trainer)
    finally:
        elastic.destroy_process_group()


if __name__ == "__main__":
    main()
