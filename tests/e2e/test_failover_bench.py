"""bench/failover.py runs end to end in its --smoke mode (2 leader changes per signal on a private etcd),
prints its table, writes --json, finds no worker restart and no dead verdict, and leaves no process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runs import run_bench


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(500)
def test_failover_benchmark_smoke(tmp_path: Path) -> None:
    out, data = tmp_path / "report.md", tmp_path / "failover.json"
    argv = ["bench/failover.py", "--smoke", "--workdir", str(tmp_path / "work"), "--markdown-out", str(out)]
    proc, left = run_bench([*argv, "--json", str(data)], timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "| SIGTERM" in report and "| SIGKILL" in report and "command: `python bench/failover.py" in report
    runs = {r["signal"]: r for r in json.loads(data.read_text())["runs"]}
    for run in runs.values():
        assert len(run["serve_s"]) == run["cycles"] == 2, run
        assert (run["worker_starts"], run["max_restart_count"], run["dead_verdicts"]) == (2, 0, 0), run
        assert (run["steps_repeated"], run["steps_skipped"]) == (0, 0), run
    assert not left, f"processes left behind by bench/failover.py: {left}"
