"""Running a benchmark script (bench/*.py) from a test: its result and the processes it left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psutil
from e2e import REPO


def _tagged(tag: str) -> list[int]:
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("BENCH_SMOKE_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def run_bench(argv: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run a benchmark script; returns its result and the PIDs it left behind (tagged by environment)."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, BENCH_SMOKE_TAG=tag)
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc, _tagged(tag)
