"""One worker of tests/integration/test_inprocess_pause_while_forming.py: ``python forming_rank.py``, its
rank, world and store from the environment the test (acting as the agent, through the agent's real
:class:`~agent.executor.inprocess.InProcessHub`) gives it. It trains under :func:`elastic.run`: a line
``formed round=R rank=K world=W step=S pid=P`` each time its group formed, a commit every few
milliseconds, and it returns after three steps of round 3."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import elastic


def main() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def train(world: elastic.World) -> int:
        print(
            f"formed round={world.round} rank={world.rank} world={world.world_size} step={world.step} "
            f"pid={os.getpid()}",
            flush=True,
        )
        step = world.step
        for _ in range(3 if world.round == 3 else 1_000_000):
            with torch.no_grad():
                model.weight.add_(1.0)
            time.sleep(0.005)  # the training step's compute
            step += 1
            world.commit(step)
        return step

    final = elastic.run(train, {"model": model}, backend="gloo")
    print(f"done step={final}", flush=True)


if __name__ == "__main__":
    main()
