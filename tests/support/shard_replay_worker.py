"""One rank of tests/integration/test_shard_replay.py: sharded flash saves into one node's shared-memory
folder (no agent), each loaded back with ``dcp.load`` and compared; rank 0 writes what it saw as JSON.

    python tests/support/shard_replay_worker.py RANK WORLD PORT SHM_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    rank, world, port, shm, out = sys.argv[1:6]
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, ELASTIC_LOCAL_RANK=rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ELASTIC_SHM_DIR=shm)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import elastic
    from elastic.checkpoint import shard_save

    torch.set_num_threads(1)
    elastic.init_process_group()
    mesh = init_device_mesh("cpu", (int(world),))
    recorded: list[int] = []
    full_save = shard_save._recorded

    def spy(state, root, tmp, pool, step, save_id, protect):  # noqa: ANN001 - the function it wraps
        recorded.append(step)
        return full_save(state, root, tmp, pool, step, save_id, protect)

    shard_save._recorded = spy

    def sharded(rows: int, seed: int) -> DTensor:
        torch.manual_seed(seed + int(rank))
        return DTensor.from_local(torch.randn(rows, 16), mesh, [Shard(0)])

    model = {"w": sharded(8, 1), "b": torch.full((16,), 0.5)}
    state = {"model": model, "step": 0, "lr": 0.1, "note": "short"}
    mismatches: list[str] = []
    for step in range(1, 8):
        state["model"]["w"].to_local().add_(1.0)  # in place, as an optimizer step does
        state["model"]["b"].add_(0.25)
        state["step"], state["lr"] = step, 0.1 * step
        if step == 5:
            state["note"] = "longer " * 200  # its pickle no longer fits its place: a full save
        if step == 6:
            state["model"]["extra"] = sharded(4, 7)  # a new key: a full save
        folder = elastic.save_sharded(state, step)
        torch.distributed.barrier()  # local rank 0 commits the folder after the save returned
        empty = {
            "model": {k: _zeros_like(v) for k, v in state["model"].items()},
            "step": -1,
            "lr": -1.0,
            "note": "",
        }
        dcp.load(empty, checkpoint_id=folder)
        for key, value in state["model"].items():
            got = empty["model"][key]
            mine = value.to_local() if isinstance(value, DTensor) else value
            theirs = got.to_local() if isinstance(got, DTensor) else got
            if not torch.equal(mine, theirs):
                mismatches.append(f"step {step}: model.{key}")
        small = ("step", "lr", "note")
        if [empty[k] for k in small] != [state[k] for k in small]:
            mismatches.append(f"step {step}: {[empty[k] for k in small]}")
    if rank == "0":
        Path(out).write_text(json.dumps({"recorded": recorded, "mismatches": mismatches}))
    elastic.destroy_process_group()


def _zeros_like(value):  # noqa: ANN001, ANN202 - a DTensor or a tensor
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor.from_local(torch.zeros_like(value.to_local()), value.device_mesh, value.placements)
    return torch.zeros_like(value)


if __name__ == "__main__":
    main()
