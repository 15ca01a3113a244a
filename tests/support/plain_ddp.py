"""An unmodified torchrun-style DDP script (no elastic import): gloo, a tiny model, steps of about 50 ms.

For the adaptive hang tests (tests/e2e/test_adaptive_hang_e2e.py). Its only output is one line per 20 steps
(``step=N rank=R restart=K``), ``start``/``done`` lines, and the fault's line. Arguments:

    plain_ddp.py STEPS [--loop-at STEP --loop-restart K] [--eval-every N [--eval-s SECONDS]]

``--loop-at``: rank 1 enters a pure-Python busy loop after that step in restart ``--loop-restart`` (no model
runs, no collective). ``--eval-every``: every N steps an evaluation pass of ``--eval-s`` seconds (default
10 x the step time: forward passes under no_grad, no optimizer step).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEP_S = 0.05

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--loop-at", type=int, default=0)
parser.add_argument("--loop-restart", type=int, default=0)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--eval-s", type=float, default=10 * STEP_S)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 8), torch.randn(16, 1)
print(f"start rank={rank} restart={restart}", flush=True)
for step in range(1, args.steps + 1):
    started = time.monotonic()
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    time.sleep(max(0.0, STEP_S - (time.monotonic() - started)))
    if step % 20 == 0:
        print(f"step={step} rank={rank} restart={restart}", flush=True)
    if args.loop_at and step == args.loop_at and rank == 1 and restart == args.loop_restart:
        print(f"looping rank={rank}", flush=True)
        n = 0
        while True:  # alive and busy, but neither a model nor a collective ever again
            n += 1
    if args.eval_every and step % args.eval_every == 0:
        model.eval()
        with torch.no_grad():
            end = time.monotonic() + args.eval_s
            while time.monotonic() < end:
                model(x)
                time.sleep(STEP_S / 5)
        model.train()
print(f"done rank={rank} restart={restart}", flush=True)
dist.destroy_process_group()
