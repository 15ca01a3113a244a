"""The one exit-code table (elastic/exit_codes.py; docs/cli.md, "Exit codes"), one test per code path that
causes it, with real ``elastic-run`` and ``elastic-master`` processes.

Codes other tests already assert, not repeated here:

- 1, a final step that is not durable: tests/e2e/test_persist_trust_e2e.py (the agent exits 1 and says
  where its copy is kept); 1, restarts exhausted: tests/e2e/test_multinode_e2e.py.
- 2, a token off loopback missing or too short: tests/integration/test_security.py; a duplicate node id:
  tests/e2e/test_node_credentials_e2e.py; an address that is not an elastic-master: tests/e2e/
  test_first_hour.py.
- 3 (failed for good): nothing produces it yet; the policy issue's rules (crash loop, recurring NaN) set
  it on the job's outcome, which every agent and ``elastic-master --exit-on-job-end`` exit with.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import e2e
import pytest
from e2e import REPO, base_env, elastic_master_argv, elastic_run_argv, free_port, train_args

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow

START_S = 90.0


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("exit-codes-test-token-0123456789\n")
    path.chmod(0o600)
    return path


@pytest.mark.timeout(120)
def test_2_a_bad_flag_on_either_command():
    for argv in (
        elastic_run_argv("--no-such-flag", "scripts/train_script.py"),
        elastic_master_argv("--no-such-flag"),
    ):
        result = _run(argv)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "no such option" in result.stderr.lower(), result.stderr


@pytest.mark.timeout(120)
def test_1_when_no_master_ever_answered():
    port = free_port()
    result = _run(
        elastic_run_argv("--master", f"127.0.0.1:{port}", "--master-timeout", "2", "scripts/train_script.py")
    )
    assert result.returncode == 1, result.stderr
    assert f"no job master answered at 127.0.0.1:{port} within 2s" in result.stderr.splitlines()[-1]


@pytest.mark.timeout(180)
def test_143_when_the_agent_is_sent_sigterm(launch):
    agent = launch(elastic_run_argv("--standalone", *train_args(steps=100000, step_time=0.1)), "agent")
    agent.wait_for(r"^\[rank0\]:step=\d+ ", START_S)
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(60) == 128 + signal.SIGTERM


@pytest.mark.timeout(300)
def test_4_a_node_excluded_for_flapping(launch, tmp_path):
    """A node id lost more than --flap-limit times (its agent killed and started again) is excluded: its
    next agent is refused at join and exits 4, "replace the node"."""
    token, port = _token(tmp_path), free_port()
    master = launch(
        elastic_master_argv(
            "--host", "127.0.0.1", "--port", str(port), "--job-id", "flap4", "--nnodes", "1:2",
            "--token-file", str(token), "--flap-limit", "1", "--flap-window", "300", "--flap-cooldown", "300",
        ),
        "master",
    )  # fmt: skip
    master.wait_for(r"listening on ", START_S)
    argv = elastic_run_argv(
        "--master", f"127.0.0.1:{port}", "--job-id", "flap4", "--nnodes", "1:2", "--node-id", "flappy",
        "--token-file", str(token), "--no-warm-start", *train_args(steps=100000, step_time=0.1),
    )  # fmt: skip
    for _ in range(2):  # the first join, then one loss: still under the limit
        agent = launch(argv, "agent")
        agent.wait_for(r"joined: waiting for round", START_S)
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(30)
    refused = launch(argv, "refused")
    assert refused.wait(START_S) == 4, refused.output()[-2000:]
    assert "for flapping" in refused.output().strip().splitlines()[-1]


@pytest.mark.timeout(300)
def test_exit_on_job_end_exits_with_the_jobs_code(launch, tmp_path):
    """``elastic-master --exit-on-job-end`` exits 0 after a job that succeeded (nothing to persist), and 1
    (retryable) after a job whose restart budget a failing worker spent; /healthz and /readyz answer
    without a token meanwhile."""
    import httpx

    token = _token(tmp_path)
    failing = tmp_path / "fail.py"
    failing.write_text("raise SystemExit(7)\n")
    for job, script, code in (
        ("ends-ok", train_args(steps=3, step_time=0.0), 0),
        ("ends-bad", [str(failing)], 1),
    ):
        port = free_port()
        master = launch(
            elastic_master_argv(
                "--host", "127.0.0.1", "--port", str(port), "--job-id", job, "--token-file", str(token),
                "--max-restarts", "0", "--exit-on-job-end",
            ),
            f"master-{job}",
        )  # fmt: skip
        master.wait_for(r"listening on ", START_S)
        for path, word in (("/healthz", "ok"), ("/readyz", "ready")):
            reply = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert reply.status_code == 200 and reply.text.strip() == word
        agent = launch(
            elastic_run_argv(
                "--master", f"127.0.0.1:{port}", "--job-id", job, "--token-file", str(token),
                "--max-restarts", "0", "--no-warm-start", *script,
            ),
            f"agent-{job}",
        )  # fmt: skip
        assert agent.wait(START_S) == code, agent.output()[-2000:]
        assert master.wait(60) == code, master.output()[-2000:]
        assert f"exiting {code} (--exit-on-job-end)" in master.output()
