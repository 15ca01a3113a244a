"""Node credentials end to end: a real ``elastic-master`` daemon, real ``elastic-run`` agents as fake nodes on
this machine (distinct or, on purpose, equal ``--node-id``), real gloo workers of scripts/train_script.py,
and a process that holds the job's token but no node's secret, talking to the master with httpx.

* a token holder without node A's secret can make the master record no failure, leave or heartbeat for A
  (403 each), nor take A's id (409); ``GET /v1/status`` is unchanged by those requests and the job finishes;
* a second agent started with a live agent's ``--node-id`` is refused (409), retries, and exits non-zero
  with one line naming the id after ``--master-timeout``; the first one trains on unharmed;
* an agent SIGKILLed and restarted with the same ``--node-id`` replaces its predecessor and trains;
* an agent whose node id another process took over (after the master declared it dead while it was
  frozen) is refused with 403 when it comes back, and stops with one line.

(That the agents' secrets survive a failover to another master is checked by the failover tests:
tests/e2e/test_master_failover_e2e.py and tests/integration/test_etcd_store.py.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import e2e
import httpx
import psutil
import pytest
from e2e import Proc, train_args, wait_until
from multinode_cluster import (
    HEARTBEAT_TIMEOUT_S,
    START_S,
    STEP_LINE,
    TOKEN,
    Cluster,
    agent_env,
    assert_no_survivors,
    assert_succeeded,
    remember_workers,
    start_cluster,
    starts,
    wait_for_any,
)
from tools import MISSING_TOOL, require_tool

from agent.errors import EXIT_CONFIG
from elastic.control.protocol import API_PREFIX, JOB_HEADER, NODE_SECRET_HEADER

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow

#: --master-timeout of the duplicate agent: how long it retries the refused join.
DUPLICATE_TIMEOUT_S = 5.0


def on_another_machine() -> list[str]:
    """A command prefix that runs a program with a /dev/shm of its own (a private mount namespace), as on
    another machine: two agents of one node id on one machine are already refused by the checkpoint
    shared-memory lock of the node (``/dev/shm/elastic-<job>-<node>``) before they reach the master. The
    test process's ELASTIC_SHM_ROOT (tests/conftest.py) is made again in the new /dev/shm."""
    unshare = require_tool("unshare")
    prefix = [unshare, "--mount", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs tmpfs /dev/shm && mkdir -p "${ELASTIC_SHM_ROOT:-/dev/shm}" && exec "$@"',
              "sh"]  # fmt: skip
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # under CI=true this skip fails the run (tests/conftest.py), as tools' do
        pytest.skip(
            f"{MISSING_TOOL} 'unshare --mount' with the right to mount (root): {probe.stderr.strip()}"
        )
    return prefix


def agent(cluster: Cluster, node_id: str, script: list[str], *extra: str, prefix: tuple = ()) -> Proc:
    """``cluster.agent`` with more agent options (``--master-timeout``), run under ``prefix``."""
    argv = [*prefix] + e2e.elastic_run_argv(
        "--nnodes", cluster.nnodes, "--nproc-per-node", "1", "--master", cluster.address,
        "--job-id", cluster.job_id, "--token-file", str(cluster.token_file), "--node-id", node_id,
        "--ckpt-dir", str(cluster.ckpt_dir), "--stop-grace", "2", *extra, *script,
    )  # fmt: skip
    return cluster.launch(argv, name=f"agent-{node_id}", env=agent_env())


def stable(status: dict) -> dict:
    """What a request for a node could change in ``GET /v1/status``, without what training moves by
    itself (steps, step times, heartbeat ages, checkpoint steps, the event log)."""
    job = {k: status[k] for k in ("phase", "round", "world_size", "nnodes", "restart_count", "outcome")}
    keys = ("node_id", "rank", "state", "restarts", "round", "host", "nproc")
    job["nodes"] = sorted(tuple(row[k] for k in keys) for row in status["nodes"])
    return job


def wait_running(cluster: Cluster, nodes: int) -> dict:
    """The status once ``nodes`` nodes report running."""

    def probe() -> dict | None:
        status = cluster.status()
        return status if [n["state"] for n in status["nodes"]] == ["running"] * nodes else None

    return wait_until(probe, START_S, f"{nodes} nodes running", interval=0.2)


# -- 1 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_token_holder_without_a_nodes_secret_cannot_report_for_it_nor_take_its_id(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "2")
    script = train_args(steps=40, step_time=0.1)
    agents = [cluster.agent("node-a", script), cluster.agent("node-b", script)]
    wait_for_any(agents, STEP_LINE.format(world=2), START_S)
    before = stable(wait_running(cluster, 2))
    master_at = len(cluster.master.output())

    auth = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: cluster.job_id}
    url = f"http://{cluster.address}{API_PREFIX}"
    failure = {"rank": 0, "local_rank": 0, "exit_code": 1, "message": "forged"}
    beat = {"node_id": "node-a", "round": before["round"], "state": "running"}
    join = dict(node_id="node-a", host="127.0.0.1", nproc=1, store_port=29999, min_nodes=2, max_nodes=2)
    watch = {"node_id": "node-a", "round": before["round"], "timeout": 0}
    with httpx.Client(base_url=url, headers=auth, trust_env=False, timeout=30) as http:
        for extra in ({}, {NODE_SECRET_HEADER: "guessed-secret"}):
            refused = {
                "failure": http.post(
                    "/heartbeat", json={**beat, "state": "failed", "failure": failure}, headers=extra
                ),
                "success": http.post("/heartbeat", json={**beat, "state": "succeeded"}, headers=extra),
                "heartbeat": http.post("/heartbeat", json=beat, headers=extra),
                "leave": http.post("/leave", json={"node_id": "node-a", "reason": "forged"}, headers=extra),
                "round": http.get("/round", params={"node_id": "node-a", "timeout": 0}, headers=extra),
                "watch": http.get("/watch", params=watch, headers=extra),
            }
            for what, response in refused.items():
                assert response.status_code == 403, (what, response.text)
                assert response.json()["error"] == "bad_node_secret", (what, response.text)
            taken = http.post("/join", json=join, headers=extra)
            assert taken.status_code == 409 and taken.json()["error"] == "duplicate_node", taken.text
            assert "node-a" in taken.json()["message"]

    assert stable(cluster.status()) == before
    new_lines = cluster.master.output()[master_at:]
    recorded = ("worker_failed", "node_left", "node_succeeded", "node_suspect", "round_opened", "node_joined")
    assert not [kind for kind in recorded if kind in new_lines], new_lines
    remember_workers(*agents)
    assert_succeeded(*agents)
    assert sorted(s[:3] for a in agents for s in starts(a)) == [(0, 2, 0), (1, 2, 0)], "no restart"
    assert_no_survivors(*agents)


# -- 2 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_second_agent_with_a_live_agents_node_id_is_refused_and_exits_after_the_master_timeout(
    launch, tmp_path
):
    on_another_machine()  # before anything starts: it may skip
    cluster = start_cluster(launch, tmp_path, "2")
    steps = 300  # long enough that the job still runs when the duplicate gives up
    script = train_args(steps=steps, step_time=0.1)
    agents = [cluster.agent("node-a", script), cluster.agent("node-b", script)]
    rank0, _ = wait_for_any(agents, STEP_LINE.format(world=2), START_S)
    duplicate = agent(
        cluster, "node-a", script, "--master-timeout", str(DUPLICATE_TIMEOUT_S), prefix=on_another_machine()
    )

    duplicate.wait_for(r"master refused the join \(duplicate_node: node id node-a is in use", START_S)
    code = duplicate.wait(START_S)
    assert code == EXIT_CONFIG, duplicate.output()[-3000:]
    assert f"[rank0]:done step={steps}" not in rank0.output(), "the job ended before the duplicate gave up"
    errors = [line for line in duplicate.output().splitlines() if line.startswith("elastic-run:")]
    assert len(errors) == 1, duplicate.output()[-3000:]
    line = (
        r"elastic-run: error: master refused the join for \d+s "
        rf"\(--master-timeout {DUPLICATE_TIMEOUT_S:g}s\): node id node-a is in use by another live agent of "
        r"job \S+; give every agent its own --node-id .*"
    )
    assert re.fullmatch(line, errors[0]), errors[0]
    assert "Traceback" not in duplicate.output()
    assert not re.search(r"^\[rank\d+\]", duplicate.output(), re.M), "the duplicate started no worker"

    at = len(rank0.output())
    rank0.wait_for(r"^\[rank0\]:step=\d+ loss", START_S, after=at)  # the first node trains on
    remember_workers(*agents)
    assert_succeeded(*agents)
    assert sorted(s[:3] for a in agents for s in starts(a)) == [(0, 2, 0), (1, 2, 0)], "no restart"
    assert_no_survivors(*agents)


# -- 3 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_an_agent_sigkilled_and_restarted_with_the_same_node_id_replaces_its_predecessor_and_trains(
    launch, tmp_path
):
    cluster = start_cluster(launch, tmp_path, "2")
    steps = 40
    script = train_args(steps=steps, step_time=0.15)
    first = cluster.agent("node-a", script)
    victim = cluster.agent("node-b", script)
    wait_for_any([first, victim], STEP_LINE.format(world=2), START_S)
    victim_workers = victim.worker_pids()
    master_at = len(cluster.master.output())

    os.killpg(victim.pid, signal.SIGKILL)  # the agent alone (its workers follow it by themselves)
    assert victim.wait(10) == -signal.SIGKILL
    wait_until(lambda: not any(psutil.pid_exists(p) for p in victim_workers), 15, "its workers to exit")
    reborn = cluster.agent("node-b", script)

    reborn.wait_for(r"round \d+: node rank \d of 2", START_S + HEARTBEAT_TIMEOUT_S)
    reborn.wait_for(r"^\[rank\d\]:start rank=\d world=2", START_S)
    remember_workers(first, reborn)
    assert_succeeded(first, reborn)
    master_log = cluster.master.output()[master_at:]
    # Its predecessor is replaced: declared dead (its connection closed), or replaced by the join at once.
    replaced = re.search(r"node_dead: node node-b declared dead|node_replaced: node node-b", master_log)
    assert replaced, master_log
    assert "bad_node_secret" not in reborn.output() + first.output()
    assert sum(f"[rank0]:done step={steps}" in a.output() for a in (first, reborn)) == 1
    assert_no_survivors(first, reborn)


# -- 4 ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_an_agent_whose_node_id_was_taken_over_is_refused_and_stops_with_one_line(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "1")
    frozen = cluster.agent("node-a", train_args(steps=1000, step_time=0.1))
    frozen.wait_for(STEP_LINE.format(world=1), START_S)
    remember_workers(frozen)
    master_at = len(cluster.master.output())

    os.kill(frozen.pid, signal.SIGSTOP)  # the agent alone: it neither heartbeats nor closes a connection
    try:
        cluster.master.wait_for(
            r"node_dead: node node-a declared dead", 4 * HEARTBEAT_TIMEOUT_S, after=master_at
        )
        auth = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: cluster.job_id}
        join = dict(node_id="node-a", host="127.0.0.1", nproc=1, store_port=29999, min_nodes=1, max_nodes=1)
        taken = httpx.post(f"http://{cluster.address}{API_PREFIX}/join", json=join, headers=auth, timeout=30)
        assert taken.status_code == 200 and taken.json()["node_secret"], taken.text
    finally:
        os.kill(frozen.pid, signal.SIGCONT)

    code = frozen.wait(START_S)
    assert code == EXIT_CONFIG, frozen.output()[-3000:]
    errors = [line for line in frozen.output().splitlines() if line.startswith("elastic-run:")]
    assert len(errors) == 1, frozen.output()[-3000:]
    assert re.fullmatch(
        r"elastic-run: error: master rejected the \S+: wrong node secret for node node-a: "
        r"another agent joined as node-a since .*",
        errors[0],
    ), errors[0]
    assert "Traceback" not in frozen.output()
    assert_no_survivors(frozen)
