"""Regenerate ``gloo_*_peer_killed.stderr``: the stderr of the survivor of a 2-process gloo job whose other
process is SIGKILLed mid-collective, as torch writes it (its excepthook prefixes each line ``[rank0]: ``).

Run: ``python tests/data/make_gloo_peer_killed.py ddp`` (DDP backward: the all_reduce of its comm hook) or
``... allreduce`` (a plain ``dist.all_reduce``). Not part of the suite: the files are the fixtures of
tests/unit/agent/test_failure_summary.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(rank: int, port: int, mode: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2000, 2000))
    for step in range(100000):
        if mode == "allreduce":
            dist.all_reduce(torch.randn(4_000_000))
        else:
            model(torch.randn(8, 2000)).sum().backward()
        print(f"step {step}", flush=True)


def main(mode: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    assert procs[1].stdout is not None
    for count, _ in enumerate(procs[1].stdout, 1):  # a few steps in, mid-collective
        if count == 5:
            break
    procs[1].send_signal(signal.SIGKILL)
    survivor = procs[0].communicate(timeout=120)[1]
    procs[1].wait()
    (HERE / f"gloo_{mode}_peer_killed.stderr").write_bytes(survivor)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[1])
    else:
        main(sys.argv[1])
