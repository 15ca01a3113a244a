"""A planned restart or a crash of the leading master never restarts training:
real etcd, real ``elastic-master`` daemons, real ``elastic-run`` agents as fake nodes, real gloo workers.

* the leader SIGTERMed (or SIGKILLed) three times in a row, restarted as the standby each time: no worker
  restart (same worker PIDs, ``restart=0``), no dead verdict, each step exactly once in rank 0's output;
* a corrupt or unknown-schema state put into etcd with ``etcdctl``: the master exits 1 with one line
  naming the key, no traceback, and leaves no leader key behind;
* an exception in the tick (the test hook ``ELASTIC_MASTER_TICK_FAULT_S``): a traceback, exit 1, the
  lease revoked, and the standby leads.

The helpers (and their short heartbeat settings) are those of tests/e2e/test_master_failover_e2e.py.
"""

from __future__ import annotations

import os
import re
import signal

import e2e
import pytest
from e2e import base_env, free_port, train_args, wait_until
from failover_cluster import (
    FAILOVER_LIMIT_S,
    START_S,
    Job,
    assert_no_false_verdicts,
    assert_uninterrupted_training,
    kill,
    rank0_agent,
    steps_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
launch = e2e.launch

#: Leader changes per test (the benchmark bench/failover.py does 20 of each).
CYCLES = 3
#: A master that steps down exits once its connections drained (master.http.serving.DRAIN_GRACE_S = 5 s).
EXIT_LIMIT_S = 30.0


def leader_index(job: Job, addresses: list[str]) -> int:
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], START_S, "one leader")
    return next(i for i, a in enumerate(addresses) if job.info(a) == 200)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_leader_stopped_three_times_in_a_row_training_never_notices(launch, tmp_path, etcd_endpoint, sig):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    masters = [job.master(p, f"master-{i}") for i, p in enumerate(ports)]
    lead = leader_index(job, addresses)

    steps = 400  # long enough to outlast the cycles below; they check that it is not done yet
    agents = [job.agent(f"node-{i}", addresses, train_args(steps=steps, step_time=0.1)) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    workers = sorted(p for a in agents for p in a.worker_pids())
    assert len(workers) == 2

    every_master = list(masters)
    for cycle in range(CYCLES):
        old = masters[lead]
        at = len(rank0.output())
        if sig == signal.SIGKILL:
            kill(old)
        else:
            os.kill(old.pid, sig)
        job.wait_leader(addresses[1 - lead], FAILOVER_LIMIT_S)
        if sig == signal.SIGTERM:
            old.wait_for(r"stepped down from job", EXIT_LIMIT_S)
            assert old.wait(EXIT_LIMIT_S) == -signal.SIGTERM  # uvicorn re-raises the signal once served
        # The old leader comes back as the standby, on its port; the workers trained on meanwhile.
        masters[lead] = job.master(ports[lead], f"master-{lead}-restart-{cycle}")
        every_master.append(masters[lead])
        back = addresses[lead]
        wait_until(lambda: job.info(back) == 503, START_S, "the restarted master to stand by")  # noqa: B023
        wait_until(lambda: len(steps_of(rank0, at)) >= 5, 60, f"steps after change {cycle + 1}")  # noqa: B023
        assert "done step" not in rank0.output(), "training ended before the last leader change"
        lead = 1 - lead

    assert sorted(p for a in agents for p in a.worker_pids()) == workers  # the same worker processes
    status = job.status(addresses[lead])
    assert (status["round"], status["restart_count"]) == (1, 0)
    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)
    for master in every_master:
        assert_no_false_verdicts(master)
    job.shut_down()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "state, why",
    [
        ("{not json", r"is not JSON"),
        ('{"schema": 99, "job_id": "JOB"}', r"schema version 99 is not one this master reads"),
        ('{"schema": 1, "job_id": "JOB"}', r"the field 'rendezvous' is missing"),
        ('{"job_id": "other-job"}', r"belongs to job 'other-job'"),
    ],
    ids=["not-json", "unknown-schema", "missing-field", "other-job"],
)
def test_unreadable_stored_state_exits_1_with_one_line_naming_the_key(
    launch, tmp_path, etcd_server, state, why
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_server.endpoint}")
    key = f"/elastic/{job.job_id}/state"
    etcd_server.must("put", key, state.replace("JOB", job.job_id))

    master = job.master(free_port(), "master")
    assert master.wait(EXIT_LIMIT_S) == 1
    out = master.output()
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"elastic-master: error: cannot continue job {job.job_id}: its stored state \(etcd key {key} at "
        rf"{re.escape(etcd_server.endpoint)}\) .*{why}.*; fix or delete that key",
        last,
    ), out
    assert "Traceback" not in out, out
    # It resigned: no leader key is left for a standby to wait out.
    assert etcd_server.must("get", f"/elastic/{job.job_id}/leader").strip() == ""
    # The state itself is left as it was, for the operator to inspect.
    assert etcd_server.must("get", "--print-value-only", key).strip() == state.replace("JOB", job.job_id)
    job.shut_down()


@pytest.mark.timeout(300)
def test_a_crash_in_the_tick_logs_a_traceback_exits_1_and_the_standby_leads(launch, tmp_path, etcd_endpoint):
    fault_s = 12.0  # long enough for the standby to start before the leader's tick fails

    def faulty_launch(argv, name="proc", env=None):
        return launch(argv, name=name, env=base_env(ELASTIC_MASTER_TICK_FAULT_S=str(fault_s)))

    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_endpoint}")
    faulty = Job(faulty_launch, tmp_path, "2:2", job.store, job_id=job.job_id)
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    leader = faulty.master(ports[0], "faulty")
    job.wait_leader(addresses[0], START_S)
    standby = job.master(ports[1], "standby")
    assert job.info(addresses[1]) == 503
    assert leader.popen.poll() is None, "the leader failed before the standby was up: raise fault_s"

    assert leader.wait(fault_s + EXIT_LIMIT_S) == 1
    out = leader.output()
    assert "Traceback" in out and "InjectedFault" in out, out
    assert out.strip().splitlines()[-1].startswith("elastic-master: error: the master's tick task crashed")
    assert "stepped down from job" in out, out  # it revoked its lease before exiting
    job.wait_leader(addresses[1], FAILOVER_LIMIT_S)
    standby.wait_for(r"master_takeover: .*took over job", 10)
    faulty.procs.clear()
    job.shut_down()
