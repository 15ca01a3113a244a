"""Replayed sharded flash saves (elastic/checkpoint/dcp_io.py): after one full DCP save, later saves of
a state of the same structure are replayed without DCP's collectives, and each loads back (``dcp.load``) as
the state that was saved, small objects included; a state whose layout changed (a key added, a pickle that
grew) gets a full save again. Two real gloo ranks of one node (tests/support/shard_replay_worker.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from e2e import REPO, base_env, free_port

WORKER = Path(__file__).resolve().parents[1] / "support" / "shard_replay_worker.py"


@pytest.mark.timeout(180)
def test_saves_of_an_unchanged_structure_are_replayed_and_load_back_exactly(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"elastic-test-replay-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    out, port = tmp_path / "result.json", str(free_port())
    procs = []
    try:
        for rank in ("0", "1"):
            argv = [sys.executable, str(WORKER), rank, "2", port, str(shm), str(out)]
            log = (tmp_path / f"rank{rank}.log").open("wb")
            procs.append((subprocess.Popen(argv, env=base_env(), cwd=REPO, stdout=log, stderr=log), log))
        for proc, _ in procs:
            proc.wait(timeout=150)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        shutil.rmtree(shm, ignore_errors=True)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("rank*.log")))
    assert all(proc.returncode == 0 for proc, _ in procs), logs[-4000:]
    result = json.loads(out.read_text())
    assert result["mismatches"] == [], result
    # Step 1 records; 2-4 replay (new step and lr included); a longer note (5) and a new key (6) make
    # full saves; 7 replays.
    assert result["recorded"] == [1, 5, 6], result
