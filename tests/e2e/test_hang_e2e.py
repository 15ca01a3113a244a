"""End-to-end tests of hang detection, the node check and the straggler report: real ``elastic-run`` agents
(and an ``elastic-master`` daemon for the multi-node ones), real worker processes with gloo.

1. A SIGSTOPped worker is declared hung within the hang timeout + one heartbeat; its stack is recorded,
   the world restarts, the stopped process is gone and the job finishes.
2. The same for a worker that stays alive but stops reporting steps (a small script in tmp_path).
3. ``--node-check`` with a node whose check is made to fail (``ELASTIC_NODE_CHECK_FAIL=1``): that node is
   excluded and the job runs on the others; with ``--node-check=warn`` it runs on all.
4. A node made slow (``--step-time`` of scripts/train_script.py) is flagged as a straggler in status.

Every wait is a poll of a log or of the status with a deadline; the ``launch`` fixture kills every process
tree at teardown, and each test checks that nothing it started survives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import e2e
import httpx
import pytest
from e2e import (
    TRAIN_SCRIPT,
    Proc,
    alive,
    base_env,
    elastic_master_argv,
    elastic_run_argv,
    wait_until,
    worker_pid,
)

from elastic.control.protocol import API_PREFIX, JOB_HEADER

launch = e2e.launch  # the fixture

pytestmark = pytest.mark.slow

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 4.0
START_S = 90.0  # agents joining and their workers' first step, on a loaded 2-core machine
EXIT_S = 120.0
#: Slack for reading the agent's log and a loaded machine, on top of "hang timeout + one heartbeat".
DETECTION_SLACK_S = 1.5
TOKEN = "health-test-token"


def env(**extra: str) -> dict[str, str]:
    return base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def assert_no_survivors(*procs: Proc) -> None:
    wait_until(lambda: not any(p.survivors() for p in procs), 20, "every process the agents started to exit")


def standalone(launch, tmp_path: Path, hang_timeout: float, *script: str, name: str = "agent") -> Proc:
    argv = elastic_run_argv(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--heartbeat-interval",
        str(HEARTBEAT_INTERVAL_S),
        "--hang-timeout",
        str(hang_timeout),
        "--log-dir",
        str(tmp_path / "logs"),
        "--stop-grace",
        "2",
        *script,
    )
    return launch(argv, name=name, env=env())


# -- 1 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_sigstopped_worker_is_declared_hung_and_the_world_restarts(launch, tmp_path):
    hang_timeout = 5.0
    agent = standalone(
        launch,
        tmp_path,
        hang_timeout,
        str(TRAIN_SCRIPT),
        "--steps",
        "40",
        "--step-time",
        "0.1",
        "--batch-size",
        "32",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    )
    agent.wait_for(r"^\[rank0\]:step=5 ", START_S)
    victim = worker_pid(agent, 1, "train_script.py")

    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    verdict = agent.wait_for(rf"\[agent\.[\w.]+\] rank 1 \(local rank 1, pid {victim}\) is hung: (.*)$", 60)
    detected_s = time.monotonic() - stopped_at
    print(f"\nSIGSTOP: hang declared {detected_s:.2f}s after the stop (timeout {hang_timeout:g}s)")

    assert detected_s <= hang_timeout + HEARTBEAT_INTERVAL_S + DETECTION_SLACK_S
    assert "its process has been stopped" in verdict.group(1)
    # Named as the root cause (first), reported as a hang, and the world restarts from the checkpoint.
    worker_failed = r"\[master\.[\w.]+\] worker_failed: round 1: rank 1 \(local rank 1 on node \S+\) hung: "
    agent.wait_for(worker_failed, 30)
    agent.wait_for(r"^\[rank1\]:start rank=1 world=2 restart=1 resumed_step=\d+$", START_S)
    wait_until(lambda: not alive(victim), 20, "the stopped worker to be gone")
    agent.descendants()  # remember the new workers, for the survivor check
    assert agent.wait(EXIT_S) == 0, agent.output()[-4000:]
    assert "job succeeded" in agent.output()
    assert re.search(r"^\[rank0\]:done step=40$", agent.output(), re.M)
    # The hung worker's Python stack was recorded next to its logs (py-spy when installed, else faulthandler).
    dumps = [p for p in (tmp_path / "logs" / "round1" / "rank1").glob("stack*.txt") if p.stat().st_size]
    assert dumps, sorted(str(p) for p in (tmp_path / "logs").rglob("*"))
    assert "train_script.py" in dumps[0].read_text()
    assert_no_survivors(agent)


STALLING_SCRIPT = """
import os
import sys
import threading
import time

import elastic

rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def stall_forever():
    print(f"stalling rank={rank}", flush=True)
    threading.Event().wait()  # alive and well, but no step ever again


for step in range(1, 6):
    elastic.report(step)
    time.sleep(0.05)
    if step == 3 and rank == 1 and restart == 0:
        stall_forever()
print(f"finished rank={rank} restart={restart}", flush=True)
"""


# -- 2 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_worker_alive_but_without_progress_is_declared_hung_and_the_world_restarts(launch, tmp_path):
    hang_timeout = 3.0
    script = tmp_path / "stalls.py"
    script.write_text(textwrap.dedent(STALLING_SCRIPT))
    agent = standalone(launch, tmp_path, hang_timeout, str(script))

    agent.wait_for(r"^\[rank1\]:stalling rank=1$", START_S)
    stalled_at = time.monotonic()  # the worker reported step 3 just before this line
    victim = worker_pid(agent, 1, "stalls.py")
    verdict = agent.wait_for(rf"\[agent\.[\w.]+\] rank 1 \(local rank 1, pid {victim}\) is hung: (.*)$", 60)
    detected_s = time.monotonic() - stalled_at
    print(f"\nno progress: hang declared {detected_s:.2f}s after the last step (timeout {hang_timeout:g}s)")

    assert detected_s <= hang_timeout + HEARTBEAT_INTERVAL_S + DETECTION_SLACK_S
    assert verdict.group(1).startswith("no step for ") and "(last step 3;" in verdict.group(1)
    assert "stopped" not in verdict.group(1)  # alive and running all along, only without progress
    agent.wait_for(r"^\[rank1\]:finished rank=1 restart=1$", START_S)
    wait_until(lambda: not alive(victim), 20, "the hung worker to be gone")
    assert agent.wait(EXIT_S) == 0, agent.output()[-4000:]
    assert "hung: no step for" in agent.output()
    stack = tmp_path / "logs" / "round1" / "rank1" / "stack.txt"
    pyspy = stack.with_name("stack-py-spy.txt")
    recorded = (pyspy if pyspy.exists() else stack).read_text()
    assert "stall_forever" in recorded, recorded
    assert_no_survivors(agent)


# -- multi-node helpers ---------------------------------------------------------------------------------
class Cluster:
    def __init__(self, launch, tmp_path: Path, nnodes: str, *master_flags: str) -> None:
        self.launch, self.tmp_path, self.nnodes = launch, tmp_path, nnodes
        self.job_id = f"health-{uuid.uuid4().hex[:8]}"
        self.token_file = tmp_path / "tok"
        self.token_file.write_text(TOKEN + "\n")
        self.master = launch(
            elastic_master_argv(
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--job-id",
                self.job_id,
                "--nnodes",
                nnodes,
                "--token-file",
                str(self.token_file),
                "--heartbeat-interval",
                str(HEARTBEAT_INTERVAL_S),
                "--heartbeat-timeout",
                str(HEARTBEAT_TIMEOUT_S),
                "--last-call",
                "1",
                *master_flags,
            ),
            name="master",
        )
        port = self.master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
        self.master.wait_for(r"leads job", START_S)
        self.address = f"127.0.0.1:{port}"
        self.agents: list[Proc] = []

    def agent(self, node_id: str, *script: str, extra_env: dict[str, str] | None = None) -> Proc:
        argv = elastic_run_argv(
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            "1",
            "--master",
            self.address,
            "--job-id",
            self.job_id,
            "--token-file",
            str(self.token_file),
            "--node-id",
            node_id,
            "--ckpt-dir",
            str(self.tmp_path / "ckpt"),
            "--stop-grace",
            "2",
            *script,
        )
        proc = self.launch(argv, name=f"agent-{node_id}", env=env(**(extra_env or {})))
        self.agents.append(proc)
        return proc

    def status(self) -> dict:
        headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: self.job_id}
        response = httpx.get(f"http://{self.address}{API_PREFIX}/status", headers=headers, timeout=10)
        response.raise_for_status()
        return response.json()

    def status_table(self) -> str:
        argv = elastic_master_argv(
            "status", "--master", self.address, "--job-id", self.job_id, "--token-file", str(self.token_file)
        )
        done = subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout


def train(steps: int, step_time: float) -> list[str]:
    return [str(TRAIN_SCRIPT), "--steps", str(steps), "--step-time", str(step_time), "--batch-size", "32"]


# -- 3 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_node_check_excludes_a_node_whose_check_fails_and_the_job_runs_on_the_others(launch, tmp_path):
    # A generous slowness factor: three checks share two cores here, so timings are noisy; this test is
    # about a failing node (slowness verdicts are unit-tested).
    cluster = Cluster(launch, tmp_path, "2:3", "--node-check", "--node-check-factor", "100")
    good = [cluster.agent(n, *train(6, 0.05)) for n in ("node-a", "node-b")]
    bad = cluster.agent("node-c", *train(6, 0.05), extra_env={"ELASTIC_NODE_CHECK_FAIL": "1"})

    excluded = cluster.master.wait_for(r"^.*node_excluded: node check: node node-c excluded: (.*)$", START_S)
    assert "failed: check failed at matmul: RuntimeError: injected node-check failure" in excluded.group(1)
    assert bad.wait(60) == 4, bad.output()[-3000:]
    assert re.search(
        r"^elastic-run: node node-c was excluded from the job by the node check \(failed: .*; "
        r"the job goes on without it$",
        bad.output(),
        re.M,
    ), bad.output()[-3000:]
    for agent in good:
        agent.descendants()
        assert agent.wait(EXIT_S) == 0, agent.output()[-4000:]
        assert re.search(
            r"\[agent\.[\w.]+\] node check (passed|failed at \w+: .*); matmul ", agent.output(), re.M
        )
    rank0 = next(a for a in good if re.search(r"^\[rank0\]:done step=6$", a.output(), re.M))
    assert re.search(r"^\[rank0\]:step=1 loss=\S+ world=2$", rank0.output(), re.M)
    assert "restart=0" in rank0.output()  # the check round is not a restart

    status = cluster.status()
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert nodes["node-c"]["state"] == "excluded"
    assert nodes["node-c"]["node_check"]["stage"] == "matmul" and not nodes["node-c"]["node_check"]["ok"]
    assert nodes["node-a"]["node_check_verdict"].startswith("ok")
    assert nodes["node-a"]["node_check"]["matmul_s"] > 0
    assert status["restart_count"] == 0
    table = cluster.status_table()
    assert re.search(r"^node-c\s+-\s+excluded\s.*check-failed$", table, re.M), table
    assert re.search(r"^node check node-c: failed: check failed at matmul: .*; no figures$", table, re.M), (
        table
    )
    assert re.search(r"^node check node-a: ok.*; matmul [\d.]+ ms on cpu", table, re.M), table
    assert_no_survivors(*cluster.agents)


@pytest.mark.timeout(300)
def test_node_check_warn_only_reports_a_failing_node_and_the_job_runs_on_all(launch, tmp_path):
    cluster = Cluster(launch, tmp_path, "2", "--node-check=warn", "--node-check-factor", "100")
    agents = [
        cluster.agent("node-a", *train(6, 0.05)),
        cluster.agent("node-b", *train(6, 0.05), extra_env={"ELASTIC_NODE_CHECK_FAIL": "1"}),
    ]

    cluster.master.wait_for(
        r"node check: node node-b failed: check failed at matmul: .*\(warn only\)$", START_S
    )
    for agent in agents:
        agent.descendants()
        assert agent.wait(EXIT_S) == 0, agent.output()[-4000:]
    assert any(re.search(r"^\[rank0\]:done step=6$", a.output(), re.M) for a in agents)
    assert "world=2" in "".join(a.output() for a in agents)
    nodes = {n["node_id"]: n for n in cluster.status()["nodes"]}
    assert nodes["node-b"]["state"] != "excluded"
    assert nodes["node-b"]["node_check_verdict"].startswith("failed: check failed at matmul")
    assert "node_excluded" not in cluster.master.output()
    assert_no_survivors(*agents)


# -- 4 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_slow_node_is_flagged_as_a_straggler_in_status(launch, tmp_path):
    cluster = Cluster(launch, tmp_path, "2", "--straggler-factor", "2")
    # A step computes for about 0.2 s here (2 cores shared by both nodes); the slow node sleeps 1 s more.
    fast = cluster.agent("node-fast", *train(20, 0.0))
    slow = cluster.agent("node-slow", *train(20, 1.0))

    def flagged():
        nodes = {n["node_id"]: n for n in cluster.status()["nodes"]}
        return nodes if nodes.get("node-slow", {}).get("straggler") else None

    nodes = wait_until(flagged, START_S, "node-slow to be flagged as a straggler")
    assert not nodes["node-fast"]["straggler"]
    # In lock step both nodes take as long per step; the slow one computes (here: sleeps) most of it.
    assert nodes["node-slow"]["compute_time_s"] > 2 * nodes["node-fast"]["compute_time_s"]
    assert nodes["node-slow"]["step_time_s"] >= 1.0
    event = cluster.master.wait_for(r"straggler: node node-slow is a straggler: compute time (.*)$", 10)
    print(f"\nstraggler event: {event.group(0)}")
    table = cluster.status_table()
    row = next(line for line in table.splitlines() if line.startswith("node-slow"))
    assert row.split()[-1] == "straggler" and re.search(r"\d\.\d{3}s\(\d\.\d{3}s\)", row), table
    assert "straggler" not in next(line for line in table.splitlines() if line.startswith("node-fast"))
    for agent in (fast, slow):
        agent.descendants()
        assert agent.wait(EXIT_S) == 0, agent.output()[-4000:]
    assert_no_survivors(fast, slow)
