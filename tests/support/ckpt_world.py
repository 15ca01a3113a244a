"""Small gloo worlds of real worker processes (tests/support/ckpt_worker.py) for the multi-rank checkpoint
tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e import (
    REPO,
    base_env,
    free_port,
)

WORKER = Path(__file__).with_name("ckpt_worker.py")


def run_world(world: int, args: list[str], log_dir: Path, per_rank_env=None) -> None:
    """Run tests/support/ckpt_worker.py on ``world`` ranks; fail with their output unless all exit 0."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for rank in range(world):
            env = base_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            for name in (
                "ELASTIC_SHM_DIR",
                "ELASTIC_CKPT_DIR",
                "ELASTIC_COMMITTED_STEP",
                "ELASTIC_AGENT_SOCKET",
            ):
                env.pop(name, None)
            env.update(per_rank_env(rank) if per_rank_env else {})
            with (log_dir / f"rank{rank}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), *args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=REPO,
                    )
                )
        for proc in procs:
            proc.wait(timeout=240)  # the workers' own watchdog dumps their stacks and exits at 200 s
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "\n".join((log_dir / f"rank{r}.log").read_text() for r in range(world))
    assert all(p.returncode == 0 for p in procs), logs


def results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
