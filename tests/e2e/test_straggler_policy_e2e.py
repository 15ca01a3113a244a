"""``--straggler-policy evict`` end to end: a real ``elastic-master`` and three real ``elastic-run`` agents
(fake nodes on this machine, gloo workers of scripts/train_script.py, which calls ``elastic.track_ddp``),
one of them sleeping much longer per step. The master evicts it: its agent exits 4 with one line saying
why, the other two train on at world size 2, status shows the exclusion and readmit lifts it.
"""

from __future__ import annotations

import re

import e2e
import httpx
import pytest
from e2e import train_args, wait_until
from multinode_cluster import START_S, TOKEN, start_cluster

from elastic.control.protocol import API_PREFIX, JOB_HEADER, PROTOCOL_HEADER, PROTOCOL_VERSION

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_an_evicted_straggler_exits_4_the_others_train_on_and_readmit_lifts_it(launch, tmp_path):
    cluster = start_cluster(
        launch, tmp_path, "2:3", "--straggler-policy", "evict", "--straggler-cooldown", "300"
    )
    fast = [
        cluster.agent(f"node-{i}", train_args(steps=100000, step_time=0.02, ckpt_every=50)) for i in (0, 1)
    ]
    slow = cluster.agent("node-slow", train_args(steps=100000, step_time=0.3, ckpt_every=50))

    assert slow.wait(START_S) == 4, slow.output()[-3000:]  # exit code 4: this node is unhealthy
    last = slow.output().strip().splitlines()[-1]
    assert "node node-slow is excluded from job" in last and "straggler evicted: compute time" in last, last
    assert "elastic-master readmit node-slow" in last and "Traceback" not in slow.output()
    event = cluster.master.wait_for(
        r"straggler_evicted: node node-slow excluded: straggler evicted: (.*)$", 10
    )
    assert re.search(
        r"\d+\.\d\dx the median .* for \d+ steps \(\d+\.\ds; --straggler-policy evict\)", event[1]
    )

    # The others restart once at world size 2 and train on.
    for agent in fast:
        agent.wait_for(r"^\[rank\d\]:start rank=\d+ world=2 ", START_S)
    steps = lambda: [int(s) for s in re.findall(r"^\[rank0\]:step=(\d+) \S+ world=2$", _output(fast), re.M)]  # noqa: E731
    first = wait_until(lambda: max(steps(), default=0), START_S, "a step at world 2")
    wait_until(lambda: max(steps()) >= first + 5, START_S, "5 more steps at world 2", 0.2)

    headers = {
        "Authorization": f"Bearer {TOKEN}",
        JOB_HEADER: cluster.job_id,
        PROTOCOL_HEADER: str(PROTOCOL_VERSION),
    }
    status = httpx.get(f"http://{cluster.address}{API_PREFIX}/status", headers=headers, timeout=10).json()
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert nodes["node-slow"]["state"] == "excluded"
    assert nodes["node-slow"]["excluded_reason"].startswith("straggler evicted: compute time")
    assert nodes["node-slow"]["readmit_in_s"] > 200

    url = f"http://{cluster.address}{API_PREFIX}/nodes/node-slow/readmit"
    assert httpx.post(url, headers=headers, timeout=10).status_code == 200
    cluster.master.wait_for(r"node_readmitted: node node-slow re-admitted by an operator", 10)
    assert "node-slow" not in {n["node_id"] for n in cluster.status()["nodes"]}


def _output(agents: list) -> str:
    return "".join(agent.output() for agent in agents)
