"""A partitioned leader steps aside (master.job.liveness.SelfSuspicion, master.service.service): real etcd,
two real ``elastic-master`` daemons, two real ``elastic-run`` agents, gloo workers (scripts/train_script.py).

* The leader is cut off from every agent but not from etcd (an nft rule drops every packet to the leader's
  port; its etcd connection stays up): instead of declaring both nodes dead and restarting the world, it
  suspects itself and resigns; the standby leads, the agents go on with it: 0 worker restarts, no agent
  exits, every step exactly once.
* Every agent SIGKILLed at once: the nodes are still declared dead, within two heartbeat timeouts plus the
  lease TTL, after at most one resignation.

Short settings (tests/support/failover_cluster.py); every wait has a deadline, the nft table is deleted in
a ``finally``, and the ``launch`` fixture kills every process tree it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid

import e2e
import pytest
from e2e import free_port, train_args, wait_until
from failover_cluster import (
    FAILOVER_LIMIT_S,
    HEARTBEAT_TIMEOUT_S,
    START_S,
    Job,
    assert_no_false_verdicts,
    assert_uninterrupted_training,
    kill,
    rank0_agent,
    steps_of,
)
from tools import MISSING_TOOL, require_tool

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

#: The etcd lease TTL of elastic-master (master.store.etcd_store.EtcdStore's default).
LEASE_TTL_S = 3.0
#: Slack for a loaded 2-core machine on top of a deadline derived from the settings.
SLACK_S = 5.0
RESIGNED = "resigns the leadership"
#: How long the leader stays cut off (the issue's check: 30 s, far past every timeout of the short settings).
PARTITION_S = 30.0
STEP_TIME_S = 0.15


def two_masters(job: Job) -> tuple[list[str], list, int]:
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    masters = [job.master(p, f"master-{i}") for i, p in enumerate(ports)]
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], START_S, "a leader")
    return addresses, masters, next(i for i, a in enumerate(addresses) if job.info(a) == 200)


class Partition:
    """An nft table of its own that drops every packet sent to one TCP port (the agents' side of a cut:
    the master behind it hears nothing and its answers reach nobody); :meth:`heal` deletes it."""

    def __init__(self, port: int) -> None:
        self.nft = require_tool("nft")
        self.table = f"elastic_partition_{uuid.uuid4().hex[:8]}"
        rules = "\n".join(
            [f"table inet {self.table} {{", "chain out {", "type filter hook output priority 0;"]
            + [f"tcp dport {port} drop", "}", "}", ""]
        )
        subprocess.run([self.nft, "-f", "-"], input=rules, text=True, check=True, timeout=30)

    def heal(self) -> None:
        subprocess.run([self.nft, "delete", "table", "inet", self.table], check=False, timeout=30)


@pytest.fixture
def nft_usable() -> None:
    nft = require_tool("nft")
    probe = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # under CI=true this skip fails the run (tests/conftest.py)
        pytest.skip(f"{MISSING_TOOL} 'nft' usable by this user (root): {probe.stderr.strip()}")


@pytest.mark.timeout(300)
def test_a_leader_cut_off_from_the_agents_resigns_and_the_standby_leads_without_a_restart(
    launch, tmp_path, etcd_endpoint, nft_usable
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    addresses, masters, lead = two_masters(job)
    leader, standby = masters[lead], masters[1 - lead]
    # Enough steps to train through the whole partition and some more after it heals.
    steps = int(1.5 * PARTITION_S / STEP_TIME_S)
    agents = [
        job.agent(f"node-{i}", addresses, train_args(steps=steps, step_time=STEP_TIME_S)) for i in range(2)
    ]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)

    partition = Partition(int(addresses[lead].rsplit(":", 1)[1]))
    cut = time.monotonic()
    try:
        # The leader suspects itself one heartbeat timeout into the silence, then resigns its lease.
        leader.wait_for(RESIGNED, HEARTBEAT_TIMEOUT_S + FAILOVER_LIMIT_S)
        job.wait_leader(addresses[1 - lead], FAILOVER_LIMIT_S)
        at = len(rank0.output())
        # The fault lasts PARTITION_S (its length is the check, not a synchronisation), and training must
        # go on under the standby all along: past its takeover grace, its verdicts would have come by now.
        wait_until(
            lambda: (
                time.monotonic() - cut >= PARTITION_S
                and len(steps_of(rank0, at)) >= 2 * HEARTBEAT_TIMEOUT_S / STEP_TIME_S
            ),
            PARTITION_S + 60,
            f"training to go on under the standby for the {PARTITION_S:.0f} s partition",
        )
        assert all(a.popen.poll() is None for a in agents), "no agent exits"
        assert rank0.popen.poll() is None and steps_of(rank0, at)[-1][0] < steps, (
            "the job outlasted the partition"
        )
    finally:
        partition.heal()

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    assert "master_suspected" in leader.output()
    assert "declared dead" not in leader.output(), leader.output()[-3000:]
    assert_no_false_verdicts(standby)
    assert RESIGNED not in standby.output(), "the successor does not resign in turn"
    job.shut_down()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_all_agents_lost_at_once_with_two_masters_are_declared_dead_after_at_most_one_resignation(
    launch, tmp_path, etcd_endpoint, fault
):
    """SIGKILL: the agents' connections close, and the leader believes that (no suspicion). SIGSTOP: nothing
    closes, so the leader cannot tell this from its own partition: it suspects itself and resigns once,
    and the standby, restoring the incident, declares the silent nodes dead when its grace ends."""
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    addresses, masters, lead = two_masters(job)
    agents = [job.agent(f"node-{i}", addresses, train_args(steps=400, step_time=0.15)) for i in range(2)]
    rank0_agent(agents).wait_for(r"^\[rank0\]:step=5 loss", START_S)

    for agent in agents:
        agent.descendants()  # remembered, for the survivor check at the end
        os.killpg(agent.pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
    lost = time.monotonic()
    deadline = 2 * HEARTBEAT_TIMEOUT_S + LEASE_TTL_S + SLACK_S

    def declared() -> set[str]:
        return {n for m in masters for n in re.findall(r"node (node-\d) declared dead", m.output())}

    try:
        wait_until(lambda: declared() == {"node-0", "node-1"}, deadline, "both nodes declared dead")
        print(f"\n{fault}: both nodes declared dead {time.monotonic() - lost:.1f}s after the fault")
        resignations = [m.output().count(RESIGNED) for m in masters]
        if fault == "SIGKILL":
            assert resignations == [0, 0], "closed connections are believed"
        else:
            assert resignations == [int(i == lead) for i in range(2)], "exactly one resignation: the leader's"
            assert "declared dead" in masters[1 - lead].output(), "the successor declares them"
    finally:
        for agent in agents:
            if agent.popen.poll() is None:
                kill(agent)  # SIGKILL reaches stopped processes too; the reaper ends their workers
    job.shut_down()
