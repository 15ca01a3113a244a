"""CI's rules for the suite itself: a test never passes CI by skipping for a missing system tool."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from e2e import REPO, SUPPORT, base_env

TESTS = REPO / "tests"

PROBE = """
from tools import require_tool

def test_needs_a_missing_tool():
    require_tool("no-such-tool-for-elastic-run-tests")

def test_needs_a_present_tool():
    assert require_tool("sh")
"""


def run_probe(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    for name in ("tools.py", "etcd_server.py", "ports.py"):
        shutil.copy(SUPPORT / name, tmp_path / name)
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = base_env()
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_a_missing_tool_skips_with_its_reason_outside_ci(tmp_path: Path) -> None:
    result = run_probe(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    assert "missing test tool 'no-such-tool-for-elastic-run-tests'" in result.stdout
    assert "install-test-tools.sh" in result.stdout


@pytest.mark.timeout(90)
def test_a_missing_tool_fails_the_run_under_ci(tmp_path: Path) -> None:
    result = run_probe(tmp_path, ci="true")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed" in result.stdout
    assert "CI=true: a missing tool fails the run" in result.stdout


@pytest.mark.timeout(60)
def test_the_tools_script_lists_what_is_missing() -> None:
    script = REPO / "scripts" / "install-test-tools.sh"
    result = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=30)
    assert result.returncode in (0, 1), result.stderr
    assert ("all test tools present" in result.stdout) == (result.returncode == 0), result.stdout
