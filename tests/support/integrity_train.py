"""A training script for the integrity tests: the example MLP under ``elastic.run`` with an
``elastic.Guard`` after every step and a flash save (memory only) of every step that passed.

A fault is injected once, in this process's memory, by the test hook ``ELASTIC_TEST_INTEGRITY_FAULT``:
``flip:STEP:RANK:BIT`` flips bit BIT of one weight of rank RANK after the optimizer step of STEP;
``nan:STEP:RANK`` puts a NaN into one gradient of rank RANK after its all-reduce, before the update;
``spike:STEP`` multiplies the loss of STEP by 100 on every rank (the update follows it); ``spikeall:STEP``
does so at every replay of STEP too (a recurring fault: data, not hardware).

Output (stdout): ``integrity step=S kind=K ranks=R rollback_to=T`` on rank 0 for each detection,
``done step=N`` at the end; ``--final-weights PATH``: rank 0 writes the final weights; ``--sample-log
DIR``: each rank logs ``step epoch idx...`` per step (the newest line of a step wins).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic
from elastic.inprocess.state import Stateful
from elastic.integrity.guard import IntegrityFault
from elastic.sampler import ElasticSampler

FAULT_ENV = "ELASTIC_TEST_INTEGRITY_FAULT"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--num-samples", type=int, default=480)
    parser.add_argument("--final-weights")
    parser.add_argument("--sample-log")
    args = parser.parse_args()
    fault = os.environ.get(FAULT_ENV, "").split(":") if os.environ.get(FAULT_ENV) else []
    fired = False

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(
        args.num_samples, num_replicas=1, rank=0, seed=0, drop_last=True, global_batch_size=args.batch_size
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.num_samples, 16, generator=gen)
    y = torch.tanh(x.sum(dim=1, keepdim=True) / 4)
    state: dict[str, Stateful] = {"model": model, "optimizer": optimizer, "sampler": sampler}
    guard = elastic.Guard(parts=1)  # the whole state every step: detection within 1 step

    wrapped: dict[int, DistributedDataParallel] = {}

    def train(world: elastic.World) -> int:
        nonlocal fired
        # A rollback keeps the group (same round): keep the DDP wrapper too, so its gradient buckets, and
        # with them the order gloo sums each gradient in, stay those of a run without the fault.
        ddp = wrapped.get(world.round) or DistributedDataParallel(model)
        wrapped.clear()
        wrapped[world.round] = ddp
        done = world.step
        batches = iter(sampler.steps())
        samples = Path(args.sample_log) / f"rank{world.rank}.log" if args.sample_log else None
        while done < args.steps:
            try:
                batch = next(batches)
            except StopIteration:
                sampler.set_epoch(sampler.epoch + 1)
                batches = iter(sampler.steps())
                continue
            step = done + 1
            optimizer.zero_grad(set_to_none=True)
            rows = torch.tensor(batch.micro_batches[0], dtype=torch.long)
            loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
            due = bool(fault) and not fired and int(fault[1]) == step
            if (due and fault[0] == "spike") or (fault and fault[0] == "spikeall" and int(fault[1]) == step):
                loss = loss * 100
                fired = fault[0] == "spike"
            loss.backward()
            if due and fault[0] == "nan" and world.rank == int(fault[2]):
                with torch.no_grad():
                    grad = next(model.parameters()).grad
                    assert grad is not None
                    grad[0, 0] = float("nan")
                fired = True
            optimizer.step()
            if due and fault[0] == "flip" and world.rank == int(fault[2]):
                with torch.no_grad():
                    next(model.parameters()).view(-1).view(torch.int32)[5] ^= 1 << int(fault[3])
                fired = True
            fired = fired or due
            done = sampler.advance()
            if samples is not None:
                with samples.open("a") as f:
                    f.write(f"{done} {sampler.epoch} {' '.join(map(str, batch.micro_batches[0]))}\n")
            try:
                guard.after_step(done, loss, ddp, optimizer)
            except IntegrityFault as caught:
                v = caught.verdict
                if world.is_first:
                    print(
                        f"integrity step={v.step} kind={v.kind} ranks={','.join(map(str, v.ranks))} "
                        f"rollback_to={v.rollback_to}",
                        flush=True,
                    )
                raise
            elastic.save({name: obj.state_dict() for name, obj in state.items()}, done, persist=False)
            guard.saved(done)
            world.commit(done)
        return done

    done = elastic.run(train, state, guard=guard)
    if dist.get_rank() == 0:
        if args.final_weights:
            torch.save(model.state_dict(), args.final_weights)
        print(f"done step={done}", flush=True)
    elastic.destroy_process_group()


if __name__ == "__main__":
    main()
