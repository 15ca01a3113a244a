"""A checkpoint keeper in a process of its own, for tests/integration/test_ckpt_safety.py (another agent, as
seen from the test process: its own pid, its own locks).

    python tests/support/keeper_proc.py ROOT JOB NODE [--ckpt-dir DIR --step S --round R --delay SECONDS]
                                              [--exit-without-stop]

Starts a :class:`agent.checkpoints.keeper.CheckpointKeeper` in ROOT and prints ``folder PATH``. With
``--step`` it writes a checkpoint of step S into its folder the way a worker does, asks for its persist to DIR
(round R; ``--delay``: the persist pauses mid-copy, as ``ELASTIC_PERSIST_DELAY_S``) and prints
``requested``. With ``--exit-without-stop`` it then ends at once, leaving its folder behind (its parent
may keep it a zombie); else it waits for a line (or EOF) on stdin, stops the keeper (the stop ends the
pause and finishes the persist), prints ``stopped`` and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent.checkpoints.keeper import CheckpointKeeper
from elastic.checkpoint import layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("job")
    parser.add_argument("node")
    parser.add_argument("--ckpt-dir", type=Path)
    parser.add_argument("--step", type=int)
    parser.add_argument("--round", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--exit-without-stop", action="store_true")
    args = parser.parse_args()

    keeper = CheckpointKeeper(
        args.job, args.node, ckpt_dir=args.ckpt_dir, root=args.root, keep=2, persist_delay_s=args.delay
    ).start()
    print(f"folder {keeper.folder}", flush=True)
    if args.step is not None:
        path = keeper.folder / layout.step_file_name(args.step)
        data = f"state of step {args.step} from pid {os.getpid()}".encode()
        layout.atomic_write(path, lambda f: f.write(data), durable=False)
        keeper.on_checkpoint(0, args.step, str(path), round_number=args.round)
        print("requested", flush=True)
    if args.exit_without_stop:
        os._exit(0)  # like a SIGKILL: no stop, the folder stays
    sys.stdin.readline()
    keeper.stop()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
