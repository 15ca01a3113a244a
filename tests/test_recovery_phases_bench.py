"""Issue 19, check 2, short version: one worker kill of bench/recovery.py under ``elastic-master
--event-log``; the recovery's phases from the event log agree with the benchmark's own timing of the same
recovery (kill -> every rank's first step) within max(10 %, 30 ms); the mapping: bench/phases.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import phases  # noqa: E402


@pytest.mark.timeout(30)
def test_agreement_is_within_ten_percent_or_thirty_milliseconds() -> None:
    assert phases.agrees(0.329, 0.300)  # within 30 ms
    assert not phases.agrees(0.335, 0.300)
    assert phases.agrees(5.5, 6.0)  # 10 %
    assert not phases.agrees(5.3, 6.0)
    rows = phases.compare(
        {"detect": 0.01, "rendezvous": 0.05, "restart": 0.1, "first_step": 0.2, "total": 0.36}, 0.15, 0.37
    )
    assert [r["checked"] for r in rows] == [False, False, True]
    assert rows[2] == {
        "what": "total vs kill -> every rank stepped",
        "event_log": 0.36,
        "bench": 0.37,
        "agrees": True,
        "checked": True,
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_event_logs_recovery_phases_agree_with_the_benchmarks_own_timing(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [
        sys.executable,
        "bench/recovery.py",
        "--smoke",
        "--tools",
        "elastic-run",
        "--workdir",
        str(tmp_path / "w"),
    ]
    proc = subprocess.run(
        [*argv, "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=380
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["recovered"], run["note"]
    assert set(run["phases"]) == {*phases.PHASES, "total"}, run["phases"]
    assert run["phases"]["total"] == pytest.approx(sum(run["phases"][p] for p in phases.PHASES), abs=1e-4)
    (total,) = [row for row in run["phase_check"] if row["checked"]]
    assert total["agrees"], f"event log {total['event_log']}s vs the benchmark's {total['bench']}s"
    assert "Recovery phases from the master's event log" in proc.stdout
