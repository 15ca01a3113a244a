"""One rank of tests/integration/test_inprocess_state_transfer.py: ``python state_transfer_rank.py RANK
WORLD PORT OUT CASE``. Rank 0 trained 3 steps and committed them; the other ranks are fresh (a replaced
rank) and receive them through elastic.inprocess.state.agree; each rank writes what it holds to OUT.RANK.pt.

CASE: ``plain`` (a model, its SGD optimizer with momentum and a sampler), ``sparse`` (plus a sparse tensor:
the whole state goes as one pickled object), ``shape`` (the receiver's model is built wider: its tensors
do not fit, new ones are received and load_state_dict reports the mismatch)."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from elastic.inprocess.state import Committed, agree
from elastic.sampler import ElasticSampler


class Extra:
    """A stateful object beside the model: a dense and, in case ``sparse``, a sparse tensor."""

    def __init__(self, sparse: bool) -> None:
        self.dense = torch.zeros(5, dtype=torch.float64)
        self.sparse = torch.zeros(3, 3).to_sparse() if sparse else None

    def state_dict(self) -> dict:
        return {"dense": self.dense, "sparse": self.sparse}

    def load_state_dict(self, state: dict) -> None:
        self.dense.copy_(state["dense"])
        self.sparse = state["sparse"]


def main() -> None:
    rank, world, port, out, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    store = dist.TCPStore(
        "127.0.0.1",
        int(port),
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=30),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    width = 6 if case == "shape" and rank != 0 else 4
    model = nn.Linear(width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(64, num_replicas=1, rank=0, global_batch_size=8)
    extra = Extra(sparse=case == "sparse")
    objects = {"model": model, "optimizer": optimizer, "sampler": sampler, "extra": extra}
    committed = Committed(objects, step=0)
    if rank == 0:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(3, width)).sum().backward()
            optimizer.step()
            sampler.advance()
        extra.dense += 1.5
        if extra.sparse is not None:
            extra.sparse = torch.eye(3).to_sparse()
        committed.take(3)
    try:
        decided = agree(committed)
        error = ""
    except RuntimeError as exc:  # load_state_dict's size mismatch, case shape
        decided, error = None, str(exc).splitlines()[0]
    torch.save(
        {
            "step": decided.step if decided else None,
            "error": error,
            "model": model.state_dict(),
            "momentum": [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
            if optimizer.state
            else [],
            "sampler": sampler.state_dict(),
            "dense": extra.dense,
            "sparse": extra.sparse.to_dense() if extra.sparse is not None else None,
            "committed_step": committed.step,
        },
        f"{out}.{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
