"""Masters, agents and assertions shared by the master failover end-to-end tests (real masters on a real etcd,
real agents and gloo workers, short heartbeat settings)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from e2e import Proc, alive, base_env, elastic_master_argv, elastic_run_argv, wait_until

from elastic.control.protocol import API_PREFIX, JOB_HEADER

TOKEN = "failover-test-token"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
LAST_CALL_S = 1.0
MASTER_TIMEOUT_S = 60.0
#: Generous bounds for a loaded 2-core machine (other suites may run beside these: workers importing torch
#: under a load average of 20 took over a minute to reach step 10).
START_S = 120.0  # a master start, or agents joining and their workers' first steps
EXIT_S = 120.0  # a job finishing once its last phase started
#: The standby leads once the dead leader's etcd lease (3 s) expired; "a few seconds", with slack for load.
FAILOVER_LIMIT_S = 10.0

STEP = re.compile(r"^\[rank0\]:step=(\d+) loss=\S+ world=(\d+)$", re.M)
START = re.compile(r"^\[rank(\d+)\]:start rank=\d+ world=(\d+) restart=(\d+) resumed_step=(\d+)$", re.M)
UNKNOWN_NODE = "the master no longer knows this node"


# -- helpers ------------------------------------------------------------------------------------------------
def headers(job_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job_id}


def http_status(method: str, address: str, path: str, job_id: str, body: dict | None = None) -> int:
    """The HTTP status of one request, 0 when nothing answers."""
    try:
        response = httpx.request(
            method,
            f"http://{address}{API_PREFIX}{path}",
            json=body,
            headers=headers(job_id),
            timeout=5.0,
            trust_env=False,
        )
    except httpx.TransportError:
        return 0
    return response.status_code


def get_json(address: str, path: str, job_id: str) -> dict:
    response = httpx.get(
        f"http://{address}{API_PREFIX}{path}", headers=headers(job_id), timeout=5.0, trust_env=False
    )
    assert response.status_code == 200, response.text
    return response.json()


def log_time(line_match: re.Match[str]) -> float:
    """The wall-clock time of a master log line (its first field: ISO 8601 UTC, ``...T11:40:46.946Z``)."""
    return datetime.fromisoformat(line_match.group("at").replace("Z", "+00:00")).timestamp()


@dataclass
class Job:
    """One job: its masters (started on fixed ports, so that a restart reuses one) and its agents."""

    launch: object
    tmp_path: Path
    nnodes: str
    store: str
    job_id: str = field(default_factory=lambda: f"failover-{uuid.uuid4().hex[:8]}")
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_file = self.tmp_path / "tok"
        self.token_file.write_text(TOKEN + "\n")
        self.ckpt_dir = self.tmp_path / "ckpt"

    def master(self, port: int, name: str, *extra: str, store: str | None = None) -> Proc:
        """A master on ``port`` (``store``: its own --store, default the job's; ``extra``: more flags)."""
        argv = elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--job-id",
            self.job_id,
            "--nnodes",
            self.nnodes,
            "--token-file",
            str(self.token_file),
            "--store",
            store or self.store,
            "--heartbeat-interval",
            str(HEARTBEAT_INTERVAL_S),
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
            "--last-call",
            str(LAST_CALL_S),
            *extra,
        )
        proc = self.launch(argv, name=name)
        self.procs.append(proc)
        proc.wait_for(rf"listening on 127\.0\.0\.1:{port}$", START_S)
        return proc

    def agent(self, node_id: str, masters: list[str], script: list[str]) -> Proc:
        argv = elastic_run_argv(
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            "1",
            "--master",
            ",".join(masters),
            "--job-id",
            self.job_id,
            "--token-file",
            str(self.token_file),
            "--node-id",
            node_id,
            "--ckpt-dir",
            str(self.ckpt_dir),
            "--stop-grace",
            "2",
            "--master-timeout",
            str(MASTER_TIMEOUT_S),
            *script,
        )
        proc = self.launch(
            argv, name=f"agent-{node_id}", env=base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        )
        self.procs.append(proc)
        return proc

    def info(self, address: str) -> int:
        return http_status("GET", address, "/info", self.job_id)

    def wait_leader(self, address: str, timeout: float) -> float:
        """Seconds until the master at ``address`` answers ``/v1/info`` with 200 (it leads)."""
        start = time.monotonic()
        wait_until(lambda: self.info(address) == 200, timeout, f"the master at {address} to lead")
        return time.monotonic() - start

    def status(self, address: str) -> dict:
        return get_json(address, "/status", self.job_id)

    def finish(self, *agents: Proc) -> None:
        """Every agent exits 0 with 'job succeeded'."""
        for agent in agents:
            code = agent.wait(EXIT_S)
            assert code == 0, f"{agent.log.name} exited {code}:\n{agent.output()[-4000:]}"
            assert "job succeeded" in agent.output(), agent.output()[-3000:]

    def shut_down(self) -> None:
        """Stop the masters (SIGTERM), then check that no process this job started is left."""
        for proc in self.procs:
            proc.descendants()  # remember every child, to check them afterwards
            if proc.popen.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            proc.wait(30)
        wait_until(lambda: not any(p.survivors() for p in self.procs), 15, "every started process to exit")
        assert not [p.pid for p in self.procs if alive(p.pid)]


def kill(proc: Proc) -> None:
    """SIGKILL a launched process group (a master or an agent; workers live in their own sessions)."""
    proc.descendants()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def rank0_agent(agents: list[Proc]) -> Proc:
    matches = wait_until(
        lambda: [a for a in agents if re.search(r"round \d+: node rank 0 of", a.output())],
        START_S,
        "a node rank 0",
    )
    return matches[0]


def steps_of(agent: Proc, after: int = 0) -> list[tuple[int, int]]:
    """``(step, world)`` of every rank-0 step line this agent forwarded past ``after``."""
    return [(int(s), int(w)) for s, w in STEP.findall(agent.output()[after:])]


def starts(agent: Proc) -> list[tuple[int, int, int, int]]:
    """``(rank, world, restart, resumed_step)`` of every worker start this agent forwarded."""
    return [tuple(int(g) for g in m) for m in START.findall(agent.output())]


def assert_uninterrupted_training(agents: list[Proc], steps: int) -> None:
    """One worker start per node (restart 0), rank 0 printed every step 1..steps exactly once at world 2,
    and no agent restarted its workers or was told about a new round."""
    assert sorted(s for a in agents for s in starts(a)) == [(0, 2, 0, 0), (1, 2, 0, 0)]
    rank0 = rank0_agent(agents)
    assert steps_of(rank0) == [(i, 2) for i in range(1, steps + 1)]
    assert re.search(rf"^\[rank0\]:done step={steps}$", rank0.output(), re.M)
    for agent in agents:
        out = agent.output()
        assert "restarting workers" not in out and UNKNOWN_NODE not in out, out[-3000:]
        assert "node secret" not in out, out[-3000:]  # the credentials went over with the job's state
        assert not re.search(r"round [2-9]\d*: node rank", out), out[-3000:]


def assert_no_false_verdicts(master: Proc) -> None:
    out = master.output()
    assert "declared dead" not in out and "round_opened" not in out, out[-3000:]


# -- (a) --------------------------------------------------------------------------------------------------
