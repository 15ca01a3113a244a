"""One connection per agent. A real ``elastic-run`` agent of a one-node job, its worker holding
(heartbeats every 0.5 s, the watch long-poll pending at the master), holds exactly one TCP connection to the
master's port, counted on the agent's process (psutil). ``ELASTIC_MASTER_STREAM=0`` gives the plain HTTP
client of before: one connection per thread that talks to the master (4 here, soon after the start)."""

from __future__ import annotations

import re
import signal

import e2e
import httpx
import psutil
import pytest
from e2e import elastic_run_argv, wait_until
from multinode_cluster import START_S, TOKEN, agent_env, start_cluster

launch = e2e.launch
jobs = e2e.jobs

pytestmark = pytest.mark.slow

LONG_POLLS = "elastic_master_long_polls_open"
HEARTBEATS = "elastic_master_heartbeats_total"

HOLD = """\
import time
print("holding", flush=True)
time.sleep(600)
"""


def connections_to(pid: int, address: str) -> int:
    """Open TCP connections of process ``pid`` to ``address``."""
    port = int(address.rpartition(":")[2])
    conns = psutil.Process(pid).net_connections("tcp")
    return sum(1 for c in conns if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def metric(address: str, name: str) -> float:
    """One figure of the master's ``/metrics`` (the sum over its labels)."""
    response = httpx.get(
        f"http://{address}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10, trust_env=False
    )
    response.raise_for_status()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", response.text, re.M))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stream", ["1", "0"], ids=["stream", "plain-http"])
def test_an_agent_holds_one_connection_to_its_master(launch, jobs, tmp_path, stream):
    cluster = start_cluster(launch, tmp_path, "1")
    jobs.append(cluster.job_id)
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    options = {
        "--nnodes": "1",
        "--nproc-per-node": "1",
        "--master": cluster.address,
        "--job-id": cluster.job_id,
        "--token-file": str(cluster.token_file),
        "--node-id": "node-a",
        "--ckpt-dir": str(tmp_path / "ckpt"),
        "--stop-grace": "2",
    }
    argv = elastic_run_argv(*(part for pair in options.items() for part in pair), str(script))
    agent = launch(argv, name="agent", env={**agent_env(), "ELASTIC_MASTER_STREAM": stream})
    agent.wait_for(r"^\[rank0\]:holding$", START_S)
    wait_until(
        lambda: metric(cluster.address, LONG_POLLS) == 1, START_S, "the agent's watch to wait at the master"
    )
    # At each of several heartbeats the master receives, while the watch waits: the agent's connections.
    counts = []
    for _ in range(5):
        seen = metric(cluster.address, HEARTBEATS)
        wait_until(lambda seen=seen: metric(cluster.address, HEARTBEATS) > seen, 30, "the next heartbeat")
        counts.append(connections_to(agent.pid, cluster.address))
        assert metric(cluster.address, LONG_POLLS) == 1, "the watch still waits"
    if stream == "1":
        assert counts == [1] * len(counts), counts
    else:  # heartbeat and watch at least; the main loop's and the rendezvous thread's until keep-alive ends
        assert min(counts) >= 2, counts
    agent.popen.send_signal(signal.SIGTERM)  # leaves the job and exits, removing its shared memory
    agent.wait(60)
