"""Master failover end to end: real etcd, real ``elastic-master`` daemons, real
``elastic-run`` agents as fake nodes on this machine (``--nproc-per-node 1``, distinct ``--node-id``) and
real gloo workers of scripts/train_script.py.

* (a) two masters on one etcd: exactly one leads, the standby refuses state changes with 503;
* (b) SIGKILL of the leading master: the standby leads within a few seconds and the workers never notice
  (no restart, every step exactly once; the new leader accepts the agents' node secrets), and the job
  finishes;
* (b') etcd lost while training: the leader steps down (503), the workers keep training, and once etcd is
  back the same master leads again and the job finishes without a restart;
* (b'') SIGSTOP of the leading master (hung or partitioned: connections accepted, never answered): the
  same as (b), without false dead verdicts, and the thawed old leader serves nothing stale;
* (c) the same as (b) with a single master that is SIGKILLed and restarted on the same port;
* (d) a node dies while no master is up: the master that comes back declares it dead after the grace
  period and the survivor continues alone;
* (e) without a durable store, a restarted master is reported to the agents, which rejoin (no split brain).

Timings are short (heartbeat 0.5 s, timeout 3 s, last call 1 s; agents give up after 60 s without a
master). Every wait polls with a deadline, and the ``launch`` fixture kills every process tree it started;
each test also checks that nothing it started is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import e2e
import httpx
import pytest
from e2e import free_port, train_args, wait_until
from failover_cluster import (
    FAILOVER_LIMIT_S,
    HEARTBEAT_TIMEOUT_S,
    START_S,
    UNKNOWN_NODE,
    Job,
    alive,
    assert_no_false_verdicts,
    assert_uninterrupted_training,
    headers,
    http_status,
    kill,
    log_time,
    rank0_agent,
    starts,
    steps_of,
)

from agent.checkpoints.fence import FENCE_FILE
from elastic.checkpoint import layout
from elastic.control.protocol import API_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown


@pytest.mark.timeout(240)
def test_two_masters_on_one_etcd_exactly_one_leads_and_the_standby_refuses_state_changes(
    launch, tmp_path, etcd_endpoint
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    masters = [job.master(int(a.rsplit(":", 1)[1]), f"master-{i}") for i, a in enumerate(addresses)]

    wait_until(
        lambda: sorted(job.info(a) for a in addresses) == [200, 503],
        START_S,
        "one master to lead and the other to stand by",
    )
    lead = next(i for i, a in enumerate(addresses) if job.info(a) == 200)
    leader, standby = addresses[lead], addresses[1 - lead]

    # Still exactly one leader a moment later (polled over two lease renewals), and only one says so.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert [job.info(leader), job.info(standby)] == [200, 503]
    assert [len(re.findall(r"leads job", m.output())) for m in masters] == [int(i == lead) for i in range(2)]

    join = {
        "node_id": "n0",
        "host": "127.0.0.1",
        "nproc": 1,
        "store_port": 29501,
        "min_nodes": 2,
        "max_nodes": 2,
    }
    beat = {"node_id": "n0", "round": 1, "state": "running"}
    response = httpx.post(
        f"http://{standby}{API_PREFIX}/join",
        json=join,
        headers=headers(job.job_id),
        timeout=5.0,
        trust_env=False,
    )
    assert response.status_code == 503 and response.json()["error"] == "not_leader", response.text
    assert http_status("POST", standby, "/heartbeat", job.job_id, beat) == 503
    assert http_status("GET", standby, "/status", job.job_id) == 503
    # The leader takes the same join; the standby still refuses it afterwards (it serves no stale copy).
    assert http_status("POST", leader, "/join", job.job_id, join) == 200
    assert http_status("POST", standby, "/join", job.job_id, join) == 503
    assert [n["node_id"] for n in job.status(leader)["nodes"]] == ["n0"]
    job.shut_down()


# -- (b) --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_sigkill_of_the_leader_the_standby_takes_over_and_training_goes_on_untouched(
    launch, tmp_path, etcd_endpoint
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    masters = [job.master(p, f"master-{i}") for i, p in enumerate(ports)]
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], START_S, "a leader")
    lead = next(i for i, a in enumerate(addresses) if job.info(a) == 200)

    steps = 100
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", addresses, script) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    before = job.status(addresses[lead])
    assert (before["round"], before["restart_count"], before["phase"]) == (1, 0, "training")

    killed_at_output = len(rank0.output())
    kill(masters[lead])
    standby = addresses[1 - lead]
    failover_s = job.wait_leader(standby, FAILOVER_LIMIT_S)
    during = steps_of(rank0, killed_at_output)  # steps printed while no master led
    print(
        f"\n(b) standby led {failover_s:.2f}s after SIGKILL of the leader; {len(during)} steps ran meanwhile"
    )
    assert during, "the workers stood still while no master led"

    after = job.status(standby)
    assert after["master_id"] != before["master_id"]
    for key in ("round", "restart_count", "phase", "world_size"):
        assert after[key] == before[key], key
    # Past the takeover grace period, both nodes are alive and still in round 1.
    takeover = masters[1 - lead].wait_for(r"master_takeover: .*", 10)
    rank0.wait_for(r"^\[rank0\]:step=\d+ loss", 30, after=len(rank0.output()))
    wait_until(
        lambda: len(steps_of(rank0, killed_at_output)) >= len(during) + 2 * HEARTBEAT_TIMEOUT_S / 0.15,
        60,
        "training to go on past the takeover grace period",
    )
    status = job.status(standby)
    assert {n["node_id"]: n["state"] for n in status["nodes"]} == {"node-0": "running", "node-1": "running"}
    assert (status["round"], status["restart_count"]) == (1, 0)

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert_no_false_verdicts(masters[1 - lead])
    assert "took over job" in takeover.group(0)
    job.shut_down()


# -- (b'') --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_frozen_leader_the_standby_takes_over_without_false_verdicts_and_the_old_leader_stands_by(
    launch, tmp_path, etcd_endpoint
):
    """SIGSTOP stands for a hung or partitioned leader: connections to it are accepted, never answered."""
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    masters = [job.master(p, f"master-{i}") for i, p in enumerate(ports)]
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], START_S, "a leader")
    lead = next(i for i, a in enumerate(addresses) if job.info(a) == 200)

    steps = 100
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", addresses, script) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)

    frozen = masters[lead]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        failover_s = job.wait_leader(addresses[1 - lead], FAILOVER_LIMIT_S)
        print(f"\n(b'') standby led {failover_s:.2f}s after SIGSTOP of the leader")
        at = len(rank0.output())
        wait_until(
            lambda: len(steps_of(rank0, at)) >= 2 * HEARTBEAT_TIMEOUT_S / 0.15,
            60,
            "training to go on past the takeover grace period",
        )
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # The thawed old leader knows its lease ran out: it refuses to serve from its first request on.
    assert job.info(addresses[lead]) == 503
    frozen.wait_for(r"lost the leadership of job", 10)

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert_no_false_verdicts(masters[1 - lead])
    assert job.info(addresses[lead]) == 503
    job.shut_down()


# -- (c) --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_single_master_sigkilled_and_restarted_on_the_same_port_with_etcd_resumes_the_job(
    launch, tmp_path, etcd_endpoint
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    port = free_port()
    address = f"127.0.0.1:{port}"
    master = job.master(port, "master")
    job.wait_leader(address, START_S)

    steps = 100
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", [address], script) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    before = job.status(address)

    killed_at = time.monotonic()
    killed_at_output = len(rank0.output())
    kill(master)
    restarted = job.master(port, "master-restarted")
    job.wait_leader(address, FAILOVER_LIMIT_S + START_S)
    downtime_s = time.monotonic() - killed_at
    during = steps_of(rank0, killed_at_output)
    print(f"\n(c) restarted master led {downtime_s:.2f}s after SIGKILL; {len(during)} steps ran meanwhile")
    assert during, "the workers stood still while no master led"

    after = job.status(address)
    assert after["master_id"] != before["master_id"]
    for key in ("round", "restart_count", "phase", "world_size"):
        assert after[key] == before[key], key
    restarted.wait_for(r"master_takeover: .*took over job", 10)
    wait_until(
        lambda: len(steps_of(rank0, killed_at_output)) >= len(during) + 2 * HEARTBEAT_TIMEOUT_S / 0.15,
        60,
        "training to go on past the takeover grace period",
    )
    status = job.status(address)
    assert {n["node_id"]: n["state"] for n in status["nodes"]} == {"node-0": "running", "node-1": "running"}

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert_no_false_verdicts(restarted)
    job.shut_down()


# -- (d) --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_node_dying_while_no_master_is_up_is_declared_dead_after_the_grace_and_the_survivor_rescales(
    launch, tmp_path, etcd_endpoint
):
    job = Job(launch, tmp_path, "1:2", f"etcd://{etcd_endpoint}")
    port = free_port()
    address = f"127.0.0.1:{port}"
    master = job.master(port, "master")
    job.wait_leader(address, START_S)

    steps = 60
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", [address], script) for i in range(2)]
    survivor = rank0_agent(agents)  # it hosts the workers' TCPStore: the other node is the one to lose
    victim = next(a for a in agents if a is not survivor)
    victim_id = "node-0" if victim is agents[0] else "node-1"
    survivor.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    victim_workers = victim.worker_pids()
    assert len(victim_workers) == 1
    survivor.descendants()

    kill(master)
    kill(victim)  # its workers follow their agent (the reaper); the survivor's collective then fails
    wait_until(lambda: not any(alive(p) for p in victim_workers), 15, "the dead node's workers to exit")
    restarted = job.master(port, "master-restarted")
    job.wait_leader(address, FAILOVER_LIMIT_S + START_S)

    lead = restarted.wait_for(r"^(?P<at>\S+) .*leads job", 10)
    dead = restarted.wait_for(
        rf"^(?P<at>\S+) .*node_dead: node {victim_id} declared dead "
        r"\(no heartbeat for (?P<age>[\d.]+)s\)",
        30,
    )
    verdict_s = log_time(dead) - log_time(lead)
    print(
        f"\n(d) the node lost while no master was up was declared dead {verdict_s:.2f}s after the "
        f"master came back (grace {HEARTBEAT_TIMEOUT_S:g}s)"
    )
    assert float(dead.group("age")) >= HEARTBEAT_TIMEOUT_S
    assert verdict_s >= HEARTBEAT_TIMEOUT_S - 0.2  # the grace period: no verdict before it ends

    survivor.wait_for(r"^\[rank0\]:step=\d+ loss=\S+ world=1$", START_S)
    job.finish(survivor)
    world1 = [s for s, w in steps_of(survivor) if w == 1]
    assert world1 and world1[-1] == steps
    assert re.search(rf"^\[rank0\]:done step={steps}$", survivor.output(), re.M)
    final = job.status(address)
    assert final["phase"] == "succeeded" and [n["node_id"] for n in final["nodes"]] == [
        "node-0" if victim_id == "node-1" else "node-1"
    ]
    victim.wait(10)
    job.shut_down()


# -- (e) --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_memory_store_master_restart_is_reported_to_agents_which_rejoin_and_finish(launch, tmp_path):
    job = Job(launch, tmp_path, "2:2", "memory://")
    port = free_port()
    address = f"127.0.0.1:{port}"
    master = job.master(port, "master")
    job.wait_leader(address, START_S)

    steps = 60
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", [address], script) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    before = job.status(address)

    kill(master)
    restarted = job.master(port, "master-restarted")
    job.wait_leader(address, START_S)
    for agent in agents:
        agent.wait_for(UNKNOWN_NODE + r".*stopping workers and rejoining", 30)
        agent.wait_for(
            r"it lost the job's state \(restarted without a durable store\); joining its rounds "
            r"afresh",
            30,
        )

    job.finish(*agents)
    after = job.status(address)
    assert after["master_id"] != before["master_id"] and after["phase"] == "succeeded"
    # Every node restarted its workers once, from the shared checkpoint, and none kept the old world.
    for agent in agents:
        first, second = starts(agent)
        assert first[1:] == (2, 0, 0) and second[1] == 2 and second[3] >= 10, starts(agent)
    assert re.search(rf"^\[rank0\]:done step={steps}$", "".join(a.output() for a in agents), re.M)
    assert "leads job" in restarted.output()
    # Nothing lost on disk either: the restarted master is a new job incarnation (its memory is gone), and
    # --ckpt-dir's fence takes its persists: the last step is durable and nothing was superseded.
    assert layout.read_marker(job.ckpt_dir) == job.ckpt_dir / layout.step_file_name(steps)
    assert json.loads((job.ckpt_dir / FENCE_FILE).read_text())["incarnation"], (
        "the fence names the incarnation"
    )
    for agent in agents:
        assert "was not persisted" not in agent.output(), agent.output()[-3000:]
    job.shut_down()


# -- (b') ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_etcd_lost_while_training_the_leader_steps_down_and_training_goes_on_until_etcd_is_back(
    launch, tmp_path, etcd_server
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_server.endpoint}")
    port = free_port()
    address = f"127.0.0.1:{port}"
    master = job.master(port, "master")
    job.wait_leader(address, START_S)

    steps = 100
    script = train_args(steps=steps, step_time=0.15)
    agents = [job.agent(f"node-{i}", [address], script) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)

    lost_at_output = len(rank0.output())
    lost_at = time.monotonic()
    etcd_server.kill()
    # The leader steps down once it cannot renew its lease (2/3 of the 3 s TTL): no master serves stale state.
    wait_until(lambda: job.info(address) == 503, 10, "the leader to step down without etcd")
    stepped_down_s = time.monotonic() - lost_at
    master.wait_for(r"lost the leadership of job", 10)
    # Meanwhile the workers train on: wait for a few steps while no master leads.
    wait_until(lambda: len(steps_of(rank0, lost_at_output)) >= 10, 30, "steps while etcd is down")
    assert job.info(address) == 503

    etcd_server.start()
    back_at = time.monotonic()
    job.wait_leader(address, 30)
    relead_s = time.monotonic() - back_at
    print(
        f"\n(b') leader stepped down {stepped_down_s:.2f}s after etcd died; led again {relead_s:.2f}s "
        f"after etcd was back; {len(steps_of(rank0, lost_at_output))} steps ran meanwhile"
    )
    assert len(re.findall(r"leads job", master.output())) == 2
    status = job.status(address)
    assert (status["round"], status["restart_count"], status["phase"]) == (1, 0, "training")

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert_no_false_verdicts(master)
    job.shut_down()
