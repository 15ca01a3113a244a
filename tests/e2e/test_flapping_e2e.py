"""Flapping nodes end to end: a real ``elastic-master`` with a short flap window and three real
``elastic-run`` agents (fake nodes on this machine, real gloo workers of scripts/train_script.py). One
agent, with a fixed ``--node-id``, is SIGKILLed and restarted until the master excludes it; the other two
then train on without another round, and ``elastic-master readmit`` lets the node join again.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import e2e
import pytest
from e2e import base_env, elastic_master_argv, elastic_run_argv, train_args, wait_until
from multinode_cluster import START_S, STEP_LINE, agent_env, start_cluster

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow

FLAP_LIMIT = 2  # the third loss within the window excludes
#: Long enough that only the operator's command lets the node back in during the test.
FLAP_COOLDOWN_S = 300.0
ASSIGNED = r"round (\d+): node rank \d+ of (\d+)"


@pytest.mark.timeout(300)
def test_a_crash_looping_node_is_excluded_the_others_train_on_and_readmit_lets_it_back(launch, tmp_path):
    cluster = start_cluster(
        launch,
        tmp_path,
        "2:3",
        "--flap-limit",
        str(FLAP_LIMIT),
        "--flap-window",
        "120",
        "--flap-cooldown",
        str(FLAP_COOLDOWN_S),
        "--max-restarts",
        "10",  # the survivors' collective errors at each loss are refunded; no budget is the question here
    )
    script = train_args(steps=100000, step_time=0.1, ckpt_every=50)
    stable = [cluster.agent(f"node-{i}", script) for i in range(2)]
    flappy = cluster.agent("flappy", script)
    flappy.wait_for(ASSIGNED, START_S)
    for agent in stable:
        agent.wait_for(r"^\[rank\d\]:start rank=\d+ world=3 ", START_S)

    # Two restarts of the agent are two losses of its node id: it is let back in each time.
    for _ in range(FLAP_LIMIT):
        os.killpg(flappy.pid, signal.SIGKILL)
        assert flappy.wait(10) == -signal.SIGKILL
        flappy = cluster.agent("flappy", script)
        flappy.wait_for(ASSIGNED, START_S)
    master_offset = len(cluster.master.output())
    offsets = {agent: len(agent.output()) for agent in stable}
    os.killpg(flappy.pid, signal.SIGKILL)
    flappy.wait(10)
    refused = cluster.agent("flappy", script)  # the third loss: excluded, and this agent refused
    code = refused.wait(START_S)
    cluster.master.wait_for(
        rf"node_flapping_excluded: node flappy excluded for flapping: lost {FLAP_LIMIT + 1} times within "
        r"120s .*elastic-master readmit flappy",
        10,
        after=master_offset,
    )
    assert code != 0, refused.output()[-2000:]
    last = refused.output().strip().splitlines()[-1]
    assert "excluded from job" in last and "for flapping" in last and "elastic-master readmit flappy" in last
    assert "Traceback" not in refused.output()

    # The survivors restart once at world 2 (a free membership change), then train on: no other round.
    for agent in stable:
        agent.wait_for(r"^\[rank\d\]:start rank=\d+ world=2 ", START_S, after=offsets[agent])
    wait_until(lambda: all(len(a.worker_pids()) == 1 for a in stable), START_S, "the survivors' workers")
    pids = [a.worker_pids() for a in stable]
    settled = len(cluster.master.output())
    first = wait_until(lambda: _last_step(stable, world=2), START_S, "a step at world 2")
    wait_until(lambda: _last_step(stable, world=2) >= first + 30, START_S, "30 more steps", 0.2)
    assert [a.worker_pids() for a in stable] == pids, "a survivor's workers restarted after the exclusion"
    assert "round_opened" not in cluster.master.output()[settled:]
    assert "worker_failed" not in cluster.master.output()[settled:]

    # The operator sees it, and re-admits it; its next agent joins and trains.
    shown = cluster.status_cli(cluster.token_file)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^flappy\s+-\s+excluded\s", shown.stdout, re.M), shown.stdout
    assert "excluded node flappy: flapping: lost 3 times within 120s" in shown.stdout
    readmit = _readmit(cluster, "flappy")
    assert readmit.returncode == 0 and "node flappy re-admitted" in readmit.stdout, readmit.stderr
    again = _readmit(cluster, "flappy")
    assert again.returncode == 1, again.stderr
    assert again.stderr.strip().count("\n") == 0 and "not excluded for flapping" in again.stderr
    cluster.master.wait_for(r"node_readmitted: node flappy re-admitted by an operator", 10)
    back = cluster.agent("flappy", script)
    back.wait_for(r"^\[rank\d\]:start rank=\d+ world=3 ", START_S)


def _last_step(agents: list, world: int) -> int:
    """The newest step global rank 0 (on one of ``agents``) reported at ``world``; 0 before any."""
    steps = [int(m) for a in agents for m in re.findall(STEP_LINE.format(world=world), a.output(), re.M)]
    return max(steps, default=0)


def _readmit(cluster, node_id: str) -> subprocess.CompletedProcess[str]:
    argv = elastic_master_argv(
        "readmit",
        node_id,
        "--master",
        cluster.address,
        "--job-id",
        cluster.job_id,
        "--token-file",
        str(cluster.token_file),
    )
    return subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=60)


@pytest.mark.timeout(240)
def test_a_crash_loop_of_agents_with_default_node_ids_is_excluded(launch, tmp_path):
    # Agents without --node-id are HOSTNAME-PID: a new id at every restart. With --nnodes 2:2 and one agent
    # the round never closes, so no worker starts: each agent joins, waits, and is SIGKILLed (a crash).
    cluster = start_cluster(launch, tmp_path, "2:2", "--flap-limit", "1", "--flap-window", "120")
    argv = elastic_run_argv(
        "--nnodes",
        "2:2",
        "--nproc-per-node",
        "1",
        "--master",
        cluster.address,
        "--job-id",
        cluster.job_id,
        "--token-file",
        str(cluster.token_file),
        "--no-warm-start",
        sys.executable,
        "-c",
        "pass",
    )
    for loss in range(2):  # the second loss is more than --flap-limit 1
        offset = len(cluster.master.output())
        agent = launch(argv, name=f"agent-default-{loss}", env=agent_env())
        joined = cluster.master.wait_for(r"node (\S+) \(\S+, 1 workers\) joined", START_S, after=offset)
        node = joined.group(1)
        assert node == f"{socket.gethostname()}-{agent.pid}", "the default id is HOSTNAME-PID"
        os.killpg(agent.pid, signal.SIGKILL)
        assert agent.wait(10) == -signal.SIGKILL
        cluster.master.wait_for(rf"node_dead: node {re.escape(node)} declared dead", START_S, after=offset)
    cluster.master.wait_for(r"node_flapping_excluded: the agents with default node ids", 10)
    refused = launch(argv, name="agent-default-refused", env=agent_env())  # yet another id
    assert refused.wait(START_S) == 4, refused.output()[-2000:]
    last = refused.output().strip().splitlines()[-1]
    host_key = rf"{re.escape(socket.gethostname())}@\S+"
    assert re.search(rf"default node ids \(HOSTNAME-PID\) at {host_key} are excluded from job", last), last
    assert "Traceback" not in refused.output()
