"""A real Prometheus scrapes two real jobs' masters (token from a credentials file, 0.5 s interval): one
job loses a worker to SIGKILL, the other runs undisturbed. Checked on raw samples (range vectors, not
``increase()``, which extrapolates): the restart counter rose by exactly 1, the recovery histogram has
one observation per phase, goodput equals the value recomputed from the event log within 2 % and is
lower than the undisturbed job's. Then ``promtool check metrics`` accepts the live exposition."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import e2e
import httpx
import pytest
from e2e import base_env, elastic_master_argv, elastic_run_argv, free_port, train_args, wait_until
from tools import require_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
launch = e2e.launch

TOKEN = "prometheus-test-token"
START_S = 150.0
PHASES = ("detect", "rendezvous", "restart", "first_step")
CAUSES = ("worker_failure", "hang", "node_loss", "scale_up")


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def goodput_from_events(events: list[dict], at: float) -> float:
    """Goodput at ``at`` recomputed from an event log (docs/observability.md's definition: training time
    less the redone steps' time, over wall time)."""
    start = next(e["time"] for e in events if e["kind"] == "job_started")
    end = next((e["time"] for e in events if e["kind"] in ("job_succeeded", "job_failed")), None)
    until = min(at, end) if end is not None else at
    training, since, ended, redone = 0.0, None, None, 0.0
    for event in events:
        if event["kind"] == "round_opened" and event["time"] <= until:
            redone += event["data"].get("redone_s", 0.0)  # steps trained again: not productive
        mark = event["data"].get("training")
        if mark == "started" and event["data"]["training_at"] <= until:
            since = event["data"]["training_at"]
        elif mark == "stopped" and since is not None:
            training += min(event["data"]["training_at"], until) - since
            since, ended = None, min(event["data"]["training_at"], until)
        elif mark == "stopped" and ended is not None and event["data"]["training_at"] < ended:
            training -= ended - event["data"]["training_at"]  # the world broke earlier than first known
            ended = event["data"]["training_at"]
    if since is not None:
        training += until - since
    return (training - min(redone, training)) / (until - start)


class Prometheus:
    def __init__(self, launch, tmp_path: Path, targets: list[str], token_file: Path) -> None:
        binary = require_tool("prometheus")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
            "scrape_configs:\n  - job_name: elastic\n    authorization:\n"
            f"      credentials_file: {token_file}\n"
            f"    static_configs:\n      - targets: [{', '.join(targets)}]\n"
        )
        self.address = f"127.0.0.1:{free_port()}"
        self.proc = launch(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={self.address}",
                "--log.level=warn",
            ],
            name="prometheus",
        )
        wait_until(self._ready, 60, "Prometheus to be ready", interval=0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://{self.address}/-/ready", timeout=2, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def scraped_since(self, instance: str, since: float) -> bool:
        """Whether Prometheus scraped ``instance`` after the Unix time ``since`` (its ``up`` series)."""
        series = self.samples(f'up{{instance="{instance}"}}', "1m")
        return bool(series) and series[0][1][-1][0] > since

    def samples(self, selector: str, window: str = "10m") -> list[tuple[dict, list[tuple[float, float]]]]:
        """Raw samples of ``selector`` over the last ``window`` (a range-vector instant query)."""
        reply = httpx.get(
            f"http://{self.address}/api/v1/query",
            params={"query": f"{selector}[{window}]"},
            timeout=10,
            trust_env=False,
        ).json()
        assert reply["status"] == "success", reply
        return [
            (r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in reply["data"]["result"]
        ]


def start_job(launch, tmp_path: Path, name: str, token_file: Path) -> tuple[str, Path, object]:
    job_id = e2e.unique_job(f"prom-{name}")
    port = free_port()
    event_log = tmp_path / f"{name}-events.jsonl"
    master = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--job-id",
            job_id,
            "--nnodes",
            "1",
            "--token-file",
            str(token_file),
            "--heartbeat-interval",
            "0.5",
            "--heartbeat-timeout",
            "5",
            "--last-call",
            "0.2",
            "--event-log",
            str(event_log),
        ),
        name=f"master-{name}",
    )
    master.wait_for(rf"listening on 127\.0\.0\.1:{port}$", START_S)
    agent = launch(
        elastic_run_argv(
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--master",
            f"127.0.0.1:{port}",
            "--job-id",
            job_id,
            "--token-file",
            str(token_file),
            "--node-id",
            f"{name}-a",
            "--ckpt-dir",
            str(tmp_path / f"{name}-ckpt"),
            # Without the warm-start zygote a restart costs a fresh interpreter and torch import (seconds),
            # well above the noise between the jobs' start-ups; with it, a recovery takes a fraction of one.
            "--stop-grace",
            "2",
            "--no-warm-start",
            *train_args(300, 0.05),
        ),
        name=f"agent-{name}",
        env=base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    return f"127.0.0.1:{port}", event_log, agent


def test_prometheus_sees_one_restart_its_phases_and_the_goodput_of_the_event_log(tmp_path, launch) -> None:
    promtool = require_tool("promtool")
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    kill_addr, kill_log, kill_agent = start_job(launch, tmp_path, "kill", token_file)
    calm_addr, calm_log, calm_agent = start_job(launch, tmp_path, "calm", token_file)
    prometheus = Prometheus(launch, tmp_path, [kill_addr, calm_addr], token_file)

    def first_steps(path: Path) -> list[dict]:
        return [e for e in read_events(path) if e["kind"] == "first_step"]

    wait_until(lambda: first_steps(kill_log), START_S, "the killed job to train", interval=0.2)
    wait_until(
        lambda: prometheus.samples(f'elastic_restarts_total{{instance="{kill_addr}"}}'),
        30,
        "Prometheus to scrape the job",
        interval=0.2,
    )
    (worker,) = kill_agent.worker_pids()
    os.kill(worker, signal.SIGKILL)
    recovered = wait_until(
        lambda: [e for e in first_steps(kill_log) if e["cause"]],
        START_S,
        "the recovery's first step",
        interval=0.2,
    )
    assert recovered[0]["cause"] == "worker_failure"
    assert set(recovered[0]["durations"]) == {*PHASES, "total"}
    for agent in (kill_agent, calm_agent):
        assert agent.wait(START_S) == 0, agent.output()[-3000:]
    finished = time.time()  # the finished jobs' masters keep serving: wait for a scrape of each after it
    wait_until(
        lambda: all(prometheus.scraped_since(a, finished) for a in (kill_addr, calm_addr)),
        START_S,
        "a scrape of each finished job",
        interval=0.2,
    )

    restarts = prometheus.samples(f'elastic_restarts_total{{instance="{kill_addr}"}}')
    (values,) = [[v for _, v in samples] for _, samples in restarts]
    assert values[0] == 0 and values[-1] == 1 and sorted(values) == values, values
    counts = prometheus.samples(f'elastic_recovery_seconds_count{{instance="{kill_addr}"}}')
    # Every (phase, cause) series exists from the start (zero until observed); one kill: one observation of
    # each phase, all of cause worker_failure, each series rising from 0.
    assert len(counts) == len(PHASES) * len(CAUSES), counts
    observed = {(m["phase"], m["cause"]): [v for _, v in s] for m, s in counts if s[-1][1] > 0}
    assert set(observed) == {(phase, "worker_failure") for phase in PHASES}, observed
    assert all(values[0] == 0 and values[-1] == 1 for values in observed.values()), observed

    goodput = {}
    for address, path in ((kill_addr, kill_log), (calm_addr, calm_log)):
        (series,) = prometheus.samples(f'elastic_goodput_ratio{{instance="{address}"}}')
        at, value = series[1][-1]
        expected = goodput_from_events(read_events(path), at)
        assert value == pytest.approx(expected, rel=0.02), (address, value, expected)
        goodput[address] = value
    assert goodput[kill_addr] < goodput[calm_addr], goodput

    live = httpx.get(
        f"http://{kill_addr}/metrics",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
        trust_env=False,
    )
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=live.text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
