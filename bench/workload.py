"""The benchmark workload: one small DDP training job that elastic-run and torchrun both run unchanged.

It uses plain ``torch.distributed.init_process_group("gloo")`` (env:// rendezvous, no ``import elastic``)
so torchrun runs it natively; only under elastic-run (``ELASTIC_AGENT_SOCKET`` set) does it send each step
to its agent with ``elastic.report`` (a local datagram), so that the master's event log sees the first
step of a recovery (bench/phases.py). Data and initial weights are deterministic. Rank 0 checkpoints to
disk after every step (``torch.save`` to a temporary file, then an atomic rename) so either launcher can
resume.

Output lines (stdout, flushed, parsed by ``bench/common.py``)::

    BENCH start restart=<TORCHELASTIC_RESTART_COUNT> resumed=<step> rank=R world=W pid=P t=<time.time()>
    BENCH init restart=R rank=R world=W t=...       # after init_process_group
    BENCH step=N world=W rank=R restart=R t=...     # after step N is complete and checkpointed
    BENCH done step=N rank=R t=...

``resumed`` is the step of the checkpoint this rank found (0 when none); after the process group is
up, rank 0's step and weights are broadcast so that every rank continues from the same state.

In-process mode (``BENCH_INPROCESS=1``, under elastic-run only): the same training inside
``elastic.run(train, state)``, so that live workers keep their processes across a failure. ``elastic.run``
forms the group (no ``init_process_group`` here) and re-forms it after each fault; ``train`` prints
``start`` (with this process's pid: unchanged for a survivor) and ``init`` at every formation, ``resumed``
being the step the ranks agreed on, and commits each step after its line. ``--pg-timeout`` does not apply.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

CKPT_NAME = "latest.pt"
#: Set to 1 (by bench/common.py's elastic-run-inprocess tool) for the in-process mode.
INPROCESS_ENV = "BENCH_INPROCESS"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="checkpoint folder (shared by all ranks)")
    p.add_argument("--steps", type=int, default=1_000_000, help="stop after this step (default: %(default)s)")
    p.add_argument(
        "--step-time", type=float, default=0.05, help="seconds of simulated compute per step (sleep)"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-only", action="store_true", help="init the process group, print 'init', barrier, exit"
    )
    p.add_argument(
        "--pg-timeout", type=float, default=0, help="process group timeout in seconds (0: torch's default)"
    )
    p.add_argument(
        "--state-mb",
        type=float,
        default=0,
        help="in-process mode: this many MB of extra state beside the model (replicated, committed each "
        "step, sent to a joining rank), as a large model's would be (default: none)",
    )
    return p.parse_args(argv)


def emit(kind: str, **fields: object) -> None:
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    sys.stdout.flush()
    # One write(2) per line: ranks that share the launcher's stdout (torchrun) never interleave mid-line.
    os.write(sys.stdout.fileno(), f"BENCH {kind} {text} t={time.time():.6f}\n".encode())


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def batch(step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a function of (seed, step) only, never of the world size."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, 32, generator=gen)
    y = x[:, :1].sin() + 0.1 * x[:, 1:2]
    return x, y


def load(ckpt_dir: Path) -> dict | None:
    path = ckpt_dir / CKPT_NAME
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None


def save(ckpt_dir: Path, state: dict) -> None:
    tmp = ckpt_dir / f".{CKPT_NAME}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, ckpt_dir / CKPT_NAME)  # readers see the old or the new file, never half of one


def build(args: argparse.Namespace, state: dict | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, from the checkpoint ``state`` when there is one."""
    model = make_model(args.hidden, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return model, optimizer


def train_step(
    ddp: nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    step: int,
    rank: int,
    world: int,
) -> None:
    """Compute step ``step`` + 1: this rank's share of the step's global batch, backward, optimizer step."""
    if args.step_time:
        time.sleep(args.step_time)
    x, y = batch(step, args.batch_size, args.seed)
    optimizer.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world]).backward()
    optimizer.step()


def step_done(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rank: int,
    world: int,
    restart: str,
) -> None:
    """Rank 0 checkpoints the completed ``step``; every rank prints its line."""
    if rank == 0:
        save(ckpt_dir, {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    emit("step", step=step, world=world, rank=rank, restart=restart)


def _agent_report():  # noqa: ANN202 - elastic.report.report, or None
    """``elastic.report.report`` under elastic-run; None elsewhere (torchrun never imports elastic)."""
    if not os.environ.get("ELASTIC_AGENT_SOCKET"):
        return None
    from elastic.report import report

    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    state = None if args.init_only else load(ckpt_dir)
    resumed = int(state["step"]) if state else 0
    if os.environ.get(INPROCESS_ENV) == "1" and not args.init_only:
        return run_inprocess(args, ckpt_dir, state)
    emit("start", restart=restart, resumed=resumed, rank=rank, world=world, pid=os.getpid())

    kwargs = {"timeout": datetime.timedelta(seconds=args.pg_timeout)} if args.pg_timeout else {}
    dist.init_process_group("gloo", **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    emit("init", restart=restart, rank=rank, world=world)
    if args.init_only:
        dist.barrier()
        dist.destroy_process_group()
        return 0

    report = _agent_report()
    model, optimizer = build(args, state)
    # Rank 0's checkpoint rules: its step is broadcast here, its weights by DDP's constructor.
    step_t = torch.tensor([resumed], dtype=torch.int64)
    dist.broadcast(step_t, src=0)
    step = int(step_t.item())
    ddp = DistributedDataParallel(model)
    while step < args.steps:
        train_step(ddp, optimizer, args, step, rank, world)
        step += 1
        step_done(ckpt_dir, model, optimizer, step, rank, world, restart)
        if report is not None:
            report(step)
    dist.barrier()
    emit("done", step=step, rank=rank)
    dist.destroy_process_group()
    return 0


class Ballast:
    """``--state-mb`` of state that training does not touch: what the in-process recovery moves for a large
    model (each commit copies it, a joining rank receives it). Deterministic: every rank's is equal."""

    def __init__(self, megabytes: float) -> None:
        self.tensor = torch.full((int(megabytes * 1e6) // 4,), 0.5)  # written: its pages are in memory

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor.copy_(state["tensor"])


def run_inprocess(args: argparse.Namespace, ckpt_dir: Path, state: dict | None) -> int:
    """The training loop inside ``elastic.run``: this process lives on when a peer or a node is lost."""
    import elastic  # here only: the normal mode runs under torchrun, without the package

    model, optimizer = build(args, state)
    states: dict = {"model": model, "optimizer": optimizer}
    if args.state_mb:
        states["ballast"] = Ballast(args.state_mb)

    def train(world: elastic.World) -> int:
        # elastic.run updated the environment for this round (TORCHELASTIC_RESTART_COUNT included).
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        rank, size = world.rank, world.world_size
        emit("start", restart=restart, resumed=world.step, rank=rank, world=size, pid=os.getpid())
        emit("init", restart=restart, rank=rank, world=size)  # elastic.run formed the group already
        ddp = DistributedDataParallel(model)  # on this world's group: rebuilt at every formation
        step = world.step
        while step < args.steps:
            train_step(ddp, optimizer, args, step, rank, size)
            step += 1
            step_done(ckpt_dir, model, optimizer, step, rank, size, restart)
            world.commit(step)  # reports the step too; raises WorldChanged when a new round forms
        dist.barrier()
        emit("done", step=step, rank=rank)
        return step

    try:
        elastic.run(train, states, step=int(state["step"]) if state else 0)
    finally:
        elastic.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
