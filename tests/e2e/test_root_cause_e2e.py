"""The job's failure summary names the real root cause (``elastic-run`` end to end, real worker processes).

A worker killed by a signal from outside is reported as that signal, not with a line it printed earlier
(a warning); a worker that raises is reported with its traceback's last line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e import elastic_run_argv, launch  # noqa: F401 - launch is a fixture

WARNING = "elastic.save: no checkpoint folder (set ELASTIC_CKPT_DIR or --ckpt-dir); keeping it in memory only"

KILLED = f"""
import os, signal, sys
print({WARNING!r}, file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or an operator would
"""

RAISES = f"""
import sys
print({WARNING!r}, file=sys.stderr, flush=True)
raise RuntimeError("boom")
"""


def summary_of(launch, tmp_path: Path, script: str) -> str:  # noqa: F811
    path = tmp_path / "worker.py"
    path.write_text(script)
    argv = elastic_run_argv(
        "--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--no-warm-start", str(path)
    )
    proc = launch(argv, name="agent")
    assert proc.wait(60) == 1, proc.output()[-3000:]
    lines = [line for line in proc.output().splitlines() if line.startswith("elastic-run: job failed:")]
    assert len(lines) == 1, proc.output()[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigkilled_worker_is_reported_as_sigkill_not_with_a_warning_it_printed(launch, tmp_path: Path):  # noqa: F811
    summary = summary_of(launch, tmp_path, KILLED)
    assert summary.endswith("failed with signal SIGKILL"), summary
    assert "no checkpoint folder" not in summary


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_that_raises_is_reported_with_its_tracebacks_last_line(launch, tmp_path: Path):  # noqa: F811
    summary = summary_of(launch, tmp_path, RAISES)
    assert summary.endswith("failed with exit code 1: RuntimeError: boom"), summary
