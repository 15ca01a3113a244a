"""The one exit-code table (elastic.exit_codes): its values are what pod failure policies and SLURM scripts
match on, the agent's and the master's names are rows of it, and importing it imports nothing else."""

from __future__ import annotations

import signal
import subprocess
import sys

from agent.errors import EXIT_CONFIG, EXIT_FAILED, AgentError
from elastic.exit_codes import ExitCode, for_signal
from master.job.job import EXIT_FAILED as JOB_FAILED


def test_the_table_keeps_its_values() -> None:
    assert {code.name: int(code) for code in ExitCode} == {
        "SUCCESS": 0,
        "FAILED": 1,
        "USAGE": 2,
        "FAILED_FOR_GOOD": 3,
        "NODE_UNHEALTHY": 4,
    }
    assert for_signal(signal.SIGTERM) == 128 + 15


def test_agent_and_master_use_rows_of_the_table() -> None:
    assert EXIT_FAILED is ExitCode.FAILED is JOB_FAILED and EXIT_CONFIG is ExitCode.USAGE
    assert AgentError("bad flag").exit_code == 1


def test_importing_the_table_imports_only_the_standard_library() -> None:
    code = "import sys, elastic.exit_codes; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    code += "('torch', 'pydantic', 'httpx', 'master', 'agent')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
