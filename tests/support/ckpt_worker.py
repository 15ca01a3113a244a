"""A worker process for the multi-rank checkpoint tests (tests/e2e/test_flash_checkpoint.py).

    python tests/support/ckpt_worker.py load OUT_DIR [CKPT_DIR]
        elastic.load(CKPT_DIR); writes OUT_DIR/rank<R>.json = {"step": S or None, "value": state["value"]}
    python tests/support/ckpt_worker.py sharded-save OUT_DIR CKPT_DIR STEP
        saves a DTensor state sharded over the world (elastic.save_sharded)
    python tests/support/ckpt_worker.py sharded-steps OUT_DIR CKPT_DIR|- LAST
        elastic.save_sharded of steps 1..LAST, the tensors times the step (flash saves under ELASTIC_SHM_DIR)
    python tests/support/ckpt_worker.py sharded-load OUT_DIR CKPT_DIR
        loads it into state sharded for this world (elastic.load_sharded); rank 0 torch.saves the full
        tensors to OUT_DIR/full.pt and every rank writes OUT_DIR/rank<R>.json = {"step": S}

Started with torchrun's environment by the test; gloo on CPU.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import elastic

WATCHDOG_S = 200


def sharded_state(world: int, zeros: bool, scale: float = 1.0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    tensors = {name: t * scale for name, t in expected_tensors().items()}
    if zeros:
        tensors = {name: torch.zeros_like(t) for name, t in tensors.items()}
    return {
        "model": {
            name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in tensors.items() if name != "rep"
        },
        "rep": tensors["rep"],
        "meta": {"epoch": 0 if zeros else 4},
    }


def expected_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    # Rows not divisible by 2 or 3: uneven shards at every world size of the test.
    return {
        "w": torch.randn(13, 5, generator=gen),
        "b": torch.randn(7, generator=gen),
        "rep": torch.randn(3, generator=gen),
        # Shards of 64 KiB or more at worlds 2-4 but the last at 4 (30 rows): a restore receives those
        # straight into the state's tensors (shard_restore.recv_records), the smaller ones by copy.
        "big": torch.randn(129, 512, generator=gen),
    }


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def main() -> None:
    # Should a rank hang (a collective without its peers), its stacks land in the log the test shows.
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    mode, out = sys.argv[1], Path(sys.argv[2])
    ckpt_dir = sys.argv[3] if len(sys.argv) > 3 else None
    elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if mode == "load":
            loaded = elastic.load(ckpt_dir)
            step, value = (None, None) if loaded is None else (loaded[1], loaded[0]["value"].tolist())
            write_json(out / f"rank{rank}.json", {"step": step, "value": value})
        elif mode == "sharded-save":
            elastic.save_sharded(sharded_state(world, zeros=False), int(sys.argv[4]), ckpt_dir)
        elif mode == "sharded-steps":
            for step in range(1, int(sys.argv[4]) + 1):
                state = sharded_state(world, zeros=False, scale=float(step))
                elastic.save_sharded(state, step, None if ckpt_dir == "-" else ckpt_dir)
        elif mode == "sharded-load":
            state = sharded_state(world, zeros=True)
            step = elastic.load_sharded(state, ckpt_dir=None if ckpt_dir == "-" else ckpt_dir)
            full = {name: t.full_tensor() for name, t in state["model"].items()}  # collectives: all ranks
            if rank == 0:
                torch.save({**full, "rep": state["rep"], "meta": state["meta"]}, out / "full.pt")
            received = elastic.sharded.last_restore_received_bytes()
            direct = elastic.sharded.last_restore_direct_bytes()
            write_json(out / f"rank{rank}.json", {"step": step, "received": received, "direct": direct})
        else:
            raise SystemExit(f"unknown mode {mode}")
        dist.barrier()  # rank 0 hosts the TCPStore: nobody tears the group down while others still use it
    finally:
        elastic.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
