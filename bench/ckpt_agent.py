"""The agent's checkpoint side in a process of its own, for bench/checkpoint.py.

    python bench/ckpt_agent.py JOB NODE

Starts a :class:`agent.checkpoints.keeper.CheckpointKeeper` (keep 2) and the progress channel that feeds it,
as an elastic-run agent does, and prints ``folder PATH`` and ``socket PATH``. Then it answers lines on
stdin: ``wait STEP`` prints ``persisted STEP`` once the keeper has persisted that step (``failed STEP``
after 600 s); ``quit`` (or EOF) stops the keeper, which removes its folder, and prints ``stopped``.

A process of its own, as in production: the worker's save then shares neither the GIL nor the
interpreter with the keeper's threads, only the machine's cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.checkpoints.keeper import CheckpointKeeper  # noqa: E402
from agent.observe.channel import ProgressChannel  # noqa: E402


def main() -> None:
    job, node = sys.argv[1], sys.argv[2]
    keeper = CheckpointKeeper(job, node, keep=2).start()
    channel = ProgressChannel(on_checkpoint=keeper.on_checkpoint)
    try:
        channel.reset(1)
        print(f"folder {keeper.folder}", flush=True)
        print(f"socket {channel.path}", flush=True)
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "quit":
                break
            if command == "wait":
                step = int(arg)
                print(f"{'persisted' if keeper.wait_persisted(step, 600) else 'failed'} {step}", flush=True)
    finally:
        channel.close()
        keeper.stop()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
