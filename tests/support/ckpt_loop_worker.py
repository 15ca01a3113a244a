"""A worker for tests/e2e/test_ckpt_faults_e2e.py: flash-saves a state of a given size in a loop.

    python tests/support/ckpt_loop_worker.py --stop-file PATH [--size-mib M] [--persist] [--step-time S]
                                     [--idle-from-restart K]

Every rank saves ``{"w": <M MiB of float32>}`` with :func:`elastic.save` at steps 1, 2, ... (asking the
agent to persist each save with ``--persist``), until PATH exists; then it saves once more and exits 0.
A worker of restart K or later (``--idle-from-restart``) saves nothing: it prints ``idle`` and waits for
PATH. Every rank prints ``start restart=R pid=P`` first; local rank 0 prints ``saved last_step=N`` last.
No process group: each rank saves on its own, as the ranks of a replicated job do.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import time
from pathlib import Path

import torch

import elastic

WATCHDOG_S = 300  # a worker the test forgot never outlives it by much


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--size-mib", type=float, default=0.01)
    parser.add_argument("--persist", action="store_true")
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--idle-from-restart", type=int, default=None)
    args = parser.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    talk = os.environ.get("LOCAL_RANK", "0") == "0"
    print(f"start restart={restart} pid={os.getpid()}", flush=True)
    if args.idle_from_restart is not None and restart >= args.idle_from_restart:
        if talk:
            print("idle", flush=True)
        while not args.stop_file.exists():
            time.sleep(0.05)
        return
    state = {"w": torch.ones(max(1, int(args.size_mib * (1 << 20)) // 4))}
    step = 0
    while True:
        stopping = args.stop_file.exists()  # read before the save: one more save follows it
        step += 1
        elastic.save(state, step, persist=args.persist)
        if stopping:
            break
        if args.step_time:
            time.sleep(args.step_time)
    if talk:
        print(f"saved last_step={step}", flush=True)


if __name__ == "__main__":
    main()
