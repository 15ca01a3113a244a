"""bench/guard_overhead.py's short version: the integrity guard's cost per model size, guard off and on in
the same processes, and normal training that trips no detection (the full run: 10,000 steps, 1 GiB)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runs import run_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_guard_overhead_benchmark_measures_both_sizes_and_no_false_detection(tmp_path: Path) -> None:
    out = tmp_path / "guard.json"
    proc, left = run_bench(["bench/guard_overhead.py", "--smoke", "--json", str(out)], timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["size"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"example", "256"}
    assert runs["256"]["bytes"] == 256 * 256 * 4
    assert all(r["parts"] >= 1 and r["step_off_s"] > 0 and r["step_on_s"] > 0 for r in runs.values())
    assert runs["example"]["false_steps"] == 50 and runs["example"]["false_detections"] == 0
    assert "| example" in proc.stdout and "overhead %" in proc.stdout
    assert not left, f"processes left behind: {left}"
