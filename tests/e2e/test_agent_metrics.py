"""``elastic-run --metrics-port``: a real agent of a real job serves its own Prometheus metrics behind the
job token; they move (the restart counter after a worker is SIGKILLed, the step), ``promtool check
metrics`` accepts them, and the listener rules refuse the listener off loopback with a guessable token."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from e2e import TRAIN_SCRIPT, base_env, elastic_run_argv, launch, wait_until  # noqa: F401 - launch: fixture
from prometheus_client.parser import text_string_to_metric_families
from tools import require_tool

from agent.cli.main import main as elastic_run_main

TOKEN = "agent-metrics-test-token"
START_S = 120.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels without job_id and node): value}`` of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job_id", "node")))
            out[(s.name, labels)] = s.value
    return out


def scrape(url: str, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(url, headers=headers, timeout=10, trust_env=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_agent_serves_its_metrics_behind_the_token_and_counts_a_restart(launch, tmp_path: Path):  # noqa: F811
    promtool = require_tool("promtool")
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    agent = launch(
        elastic_run_argv(
            "--standalone",
            "--nproc-per-node",
            "1",
            "--node-id",
            "metrics-node",
            "--token-file",
            str(token_file),
            "--metrics-port",
            "0",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
            "--stop-grace",
            "2",
            str(TRAIN_SCRIPT),
            "--steps",
            "100000",  # killed by the fixture: the test reads the metrics while it trains
            "--step-time",
            "0.05",
            "--ckpt-every",
            "5",
        ),
        name="agent",
        env=base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    port = agent.wait_for(r"metrics on 127\.0\.0\.1:(\d+)/metrics \(http\)", START_S).group(1)
    url = f"http://127.0.0.1:{port}/metrics"

    for token in (None, "not-the-token"):
        refused = scrape(url, token)
        assert refused.status_code == 401, refused.text
        assert "metrics-node" not in refused.text and "elastic_agent" not in refused.text
    assert scrape(f"http://127.0.0.1:{port}/v1/status", TOKEN).status_code == 404

    def current() -> dict:
        reply = scrape(url, TOKEN)
        assert reply.status_code == 200, reply.text
        return samples(reply.text)

    before = wait_until(
        lambda: (m := current()).get(("elastic_agent_step", ())) and m,
        START_S,
        "the first steps",
        interval=0.2,
    )
    assert before[("elastic_agent_worker_starts_total", ())] == 1
    assert before[("elastic_agent_restarts_total", ())] == 0
    assert before[("elastic_agent_workers", (("state", "running"),))] == 1
    assert before[("elastic_agent_node_state", (("state", "running"),))] == 1

    (worker,) = agent.worker_pids()
    os.kill(worker, signal.SIGKILL)

    def restarted() -> dict | None:
        m = current()
        stepping = m.get(("elastic_agent_step", ())) is not None
        return m if m[("elastic_agent_restarts_total", ())] == 1 and stepping else None

    after = wait_until(
        restarted, START_S, "the restart counter to rise and the workers to step", interval=0.2
    )
    assert after[("elastic_agent_worker_starts_total", ())] == 2
    assert after[("elastic_agent_worker_failures_total", (("kind", "crash"),))] == 1
    assert after[("elastic_agent_job_restarts_charged", ())] == 1
    assert after[("elastic_agent_workers", (("state", "running"),))] == 1
    assert after[("elastic_agent_round", ())] > before[("elastic_agent_round", ())]
    persists = wait_until(
        lambda: (m := current())[("elastic_agent_persists_total", ())] > 0 and m,
        60,
        "a persist",
        interval=0.2,
    )
    assert persists[("elastic_agent_persist_seconds_count", ())] >= 1
    assert persists[("elastic_agent_persist_seconds_sum", ())] > 0
    assert persists[("elastic_agent_persisted_step", ())] >= 5
    # The worker's in-memory saves, as it timed them (elastic.save -> report_checkpoint's save_s).
    saves = persists[("elastic_agent_checkpoint_save_seconds_count", ())]
    assert saves >= 1 and persists[("elastic_agent_checkpoint_save_seconds_sum", ())] > 0
    assert persists[("elastic_agent_checkpoint_save_seconds_bucket", (("le", "+Inf"),))] == saves

    live = scrape(url, TOKEN).text
    assert 'node="metrics-node"' in live
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=live, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.timeout(30)
def test_the_metrics_listener_off_loopback_with_a_derived_token_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.delenv("ELASTIC_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exited:
        elastic_run_main(
            [
                "--nnodes",
                "2",
                "--master",
                "127.0.0.1:29999",  # a master on loopback: a derived token is allowed for it
                "--local-addr",
                "10.255.0.1",
                "--metrics-port",
                "0",
                str(TRAIN_SCRIPT),
            ]
        )
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "elastic-run: error: --metrics-port: the agent's metrics listener on 10.255.0.1 is"
    )
    assert "--token-file" in line
