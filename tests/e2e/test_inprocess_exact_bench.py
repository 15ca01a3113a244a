"""Short version of bench/inprocess_exact.py --smoke (one run, 3 SIGKILLs of the rank-1
worker of scripts/train_inprocess.py at a fixed world of 2) recovers in process every time, keeps the
survivor's PID, gives the replaced ranks the survivor's state, trains every sample once, redoes no
committed step, ends bitwise equal to an uninterrupted run, and leaves no process behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runs import run_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_worker_kills_end_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    out, data = tmp_path / "report.md", tmp_path / "exact.json"
    argv = [
        "bench/inprocess_exact.py",
        "--smoke",
        "--workdir",
        str(tmp_path / "work"),
        "--markdown-out",
        str(out),
    ]
    proc, left = run_bench([*argv, "--json", str(data)], timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| elastic-run-inprocess" in out.read_text()
    (run,) = json.loads(data.read_text())["runs"]
    assert run["recovered"] and run["kills"] == 3 and run["done_step"] == 45, run
    assert run["survivor_pid_unchanged"] and run["worlds"] == 4, run
    assert run["replaced_state_equal"] and run["rank1_pids"] == 4, run
    assert (run["steps_redone"], run["steps_missing"], run["samples_twice"]) == (0, 0, 0), run
    assert run["weights_bitwise_equal"] is True, run
    assert not left, f"processes left behind by bench/inprocess_exact.py: {left}"
