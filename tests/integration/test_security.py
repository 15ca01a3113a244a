"""Security rules of the command lines: no public default token off loopback, no short token, no token in
workers."""

from __future__ import annotations

import subprocess
import sys

import e2e
import pytest
from e2e import REPO, base_env, elastic_run_argv

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

SCRIPT = "scripts/train_script.py"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = base_env()
    env.pop("ELASTIC_TOKEN", None)
    return subprocess.run(
        elastic_run_argv(*args, SCRIPT), env=env, cwd=REPO, capture_output=True, text=True, timeout=50
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [
        ["--nnodes", "1:2", "--master", "10.255.0.1:29400"],
        ["--master", "10.255.0.1:29400,127.0.0.1:29400"],
    ],
    ids=["master", "one-standby-off-loopback"],
)
def test_a_master_off_loopback_without_a_token_is_refused_before_any_connection(args: list[str]) -> None:
    # Refused while the command line is resolved: nothing is sent to the (unreachable) address.
    result = run_cli(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-run: error: "), result.stderr
    assert "--token-file" in lines[0] and "ELASTIC_TOKEN" in lines[0]


def host_address() -> str | None:
    """A non-loopback IPv4 address of this host (``hostname -I``), or None."""
    import ipaddress
    import shutil

    if shutil.which("hostname") is None:
        return None
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    for address in out:
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and not ip.is_loopback:
            return address
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchruns_c10d_spelling_without_a_token_runs_unauthenticated_with_one_warning_line(launch) -> None:
    """torchrun's c10d line on an address of this host off loopback, no token: the job runs as torchrun's
    would (before: exit 2), with one warning line naming the risk and the fix; ``elastic-master status``
    without a token says the job is unauthenticated; ``--master`` at the same address still needs a token."""
    from e2e import free_port, train_args

    address = host_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address (hostname -I)")
    endpoint = f"{address}:{free_port()}"
    env = base_env()
    env.pop("ELASTIC_TOKEN", None)
    job = "c10d-open"
    argv = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job]
    agent = launch(elastic_run_argv(*argv, *train_args(steps=40, step_time=0.05)), "agent", env)
    agent.wait_for(r"^\[rank0\]:step=\d+ ", 90)
    shown = subprocess.run(
        [sys.executable, "-m", "master", "status", "--master", endpoint, "--job-id", job],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("auth: unauthenticated (c10d, no token)"), shown.stdout
    # The status page says so too (signed in with the token anyone can derive from the job id).
    import httpx

    from elastic.control.auth import derived_token
    from master.http.ui import CSRF_COOKIE

    with httpx.Client(base_url=f"http://{endpoint}", timeout=30) as client:
        client.get("/ui/login")
        client.post("/ui/login", data={"csrf": client.cookies.get(CSRF_COOKIE), "token": derived_token(job)})
        page = client.get("/ui")
    assert page.status_code == 200 and 'id="auth"' in page.text, page.text[:500]
    assert "unauthenticated (c10d, no token)" in page.text
    refused = run_cli("--nnodes", "1", "--master", endpoint, "--rdzv-id", job)
    assert refused.returncode == 2 and "--token-file" in refused.stderr, refused.stderr
    assert agent.wait(150) == 0, agent.output()[-3000:]
    lines = agent.output().splitlines()
    warnings = [line for line in lines if " WARNING " in line and not line.startswith("[rank")]
    assert len(warnings) == 1, warnings
    assert "unauthenticated (c10d, no token)" in warnings[0] and "--token-file" in warnings[0]
    assert "anyone who can reach that port" in warnings[0]


@pytest.mark.timeout(10)
def test_the_status_table_escapes_what_nodes_sent() -> None:
    from elastic.control.job_settings import JobSettings
    from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
    from master.cli.status import render_status
    from master.job.job import Job

    job = Job(JobSettings(job_id="j", min_nodes=1, max_nodes=1, last_call_s=0.0), now=0.0)
    join = JoinRequest(node_id="a", host="h", nproc=1, store_port=2000, min_nodes=1, max_nodes=1)
    secret = job.join(join, 0.0).node_secret
    job.tick(0.0)
    forged = "disk full\nFAKE [elastic.master] job_succeeded\x1b[2J"
    beat = HeartbeatRequest(node_id="a", round=job.rdzv.round, state=NodeState.RUNNING, persist_error=forged)
    job.heartbeat(beat, 1.0, secret)
    table = render_status(job.status(1.0))
    assert "\x1b" not in table
    assert not [line for line in table.splitlines() if line.startswith("FAKE")], table
    assert "disk full\\nFAKE [elastic.master] job_succeeded\\x1b[2J" in table


SHORT = "fifteen-bytes!!"  # one byte short of elastic.control.auth.MIN_TOKEN_BYTES


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("command", "where"),
    [
        (["master", "--job-id", "j", "--nnodes", "1", "--token-file", "{file}"], "file"),
        (["agent", "--nnodes", "1", "--standalone", "--token-file", "{file}", SCRIPT], "file"),
        (["agent", "--nnodes", "1", "--master", "127.0.0.1:1", SCRIPT], "env"),
    ],
    ids=["elastic-master", "elastic-run-token-file", "elastic-run-env"],
)
def test_a_token_shorter_than_16_bytes_is_refused_at_start_with_one_line_and_exit_2(
    tmp_path, command: list[str], where: str
) -> None:
    """A short token is guessed even at the rate limit of wrong tokens: both command lines refuse one
    before serving or connecting (before, a 1-character token was accepted)."""
    token_file = tmp_path / "token"
    token_file.write_text(SHORT + "\n")
    token_file.chmod(0o600)
    env = base_env() if where == "file" else base_env(ELASTIC_TOKEN=SHORT)
    if where == "file":
        env.pop("ELASTIC_TOKEN", None)
    argv = [sys.executable, "-m", *(arg.replace("{file}", str(token_file)) for arg in command)]
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "fewer than 16" in lines[0], result.stderr


def test_created_and_derived_tokens_are_long_enough(tmp_path, monkeypatch) -> None:
    """The tokens the project makes itself stay valid: a created token file, the convenience token derived
    from a job id, and a token of exactly 16 bytes."""
    from elastic.control.auth import MIN_TOKEN_BYTES, TOKEN_ENV, derived_token, job_token

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    created = job_token(str(tmp_path / "new-token"), create=True)
    assert created is not None and job_token(str(tmp_path / "new-token")) == created
    assert len(derived_token("j").encode()) >= MIN_TOKEN_BYTES
    monkeypatch.setenv(TOKEN_ENV, "x" * MIN_TOKEN_BYTES)
    assert job_token(None) == "x" * MIN_TOKEN_BYTES
