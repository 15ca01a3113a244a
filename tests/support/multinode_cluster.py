"""A cluster of real ``elastic-run`` agents (fake nodes on this machine) and a master, with the helpers the
multi-node end-to-end tests share: starting it, reading the agents' output, asserting nothing survives."""

from __future__ import annotations

import re
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from e2e import (
    Proc,
    base_env,
    elastic_master_argv,
    elastic_run_argv,
    wait_until,
)

from elastic.control.protocol import API_PREFIX, JOB_HEADER

TOKEN = "multinode-test-token"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
LAST_CALL_S = 1.0
#: Generous bounds for a loaded 2-core machine (other suites run concurrently).
START_S = 90.0  # master start, or agents joining and their workers' first step
EXIT_S = 120.0  # a job finishing once its last phase started

# Worker lines as the agent forwards them: ``[rank<R>]:<line>``.
STEP_LINE = r"^\[rank0\]:step=(\d+) loss=\S+ world={world}$"
START_LINE = re.compile(r"^\[rank(\d+)\]:start rank=\d+ world=(\d+) restart=(\d+) resumed_step=(\d+)$", re.M)
FAILED_LINE = re.compile(r"^elastic-run: job failed: .*$", re.M)


def agent_env() -> dict[str, str]:
    return base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@dataclass
class Cluster:
    """One job: a master daemon plus helpers to start agents (fake nodes) against it."""

    launch: object
    job_id: str
    master: Proc
    address: str
    nnodes: str
    token_file: Path
    ckpt_dir: Path

    def agent(self, node_id: str, script: list[str], env: dict[str, str] | None = None) -> Proc:
        """An ``elastic-run`` agent for ``node_id``; ``env``: variables added to the agents' environment."""
        argv = elastic_run_argv(
            "--nnodes",
            self.nnodes,  # the same as the master's
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
            str(self.ckpt_dir),
            "--stop-grace",
            "2",
            *script,
        )
        return self.launch(argv, name=f"agent-{node_id}", env={**agent_env(), **(env or {})})

    def status(self) -> dict:
        """``GET /v1/status`` as JSON."""
        headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: self.job_id}
        response = httpx.get(f"http://{self.address}{API_PREFIX}/status", headers=headers, timeout=10)
        response.raise_for_status()
        return response.json()

    def status_cli(self, token_file: Path) -> subprocess.CompletedProcess[str]:
        argv = elastic_master_argv(
            "status", "--master", self.address, "--job-id", self.job_id, "--token-file", str(token_file)
        )
        return subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=60)


def unique_job_id() -> str:
    # Unique per test: the agents' shared-memory checkpoint folders are named by job and node id, and other
    # suites may run jobs on this machine at the same time.
    return f"mn-{uuid.uuid4().hex[:8]}"


def start_cluster(launch, tmp_path: Path, nnodes: str, *extra: str) -> Cluster:
    job_id = unique_job_id()
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN + "\n")
    master = launch(
        elastic_master_argv(
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # the master binds a free port and logs it: no race for the port
            "--job-id",
            job_id,
            "--nnodes",
            nnodes,
            "--token-file",
            str(token_file),
            "--heartbeat-interval",
            str(HEARTBEAT_INTERVAL_S),
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
            "--last-call",
            str(LAST_CALL_S),
            *extra,
        ),
        name="master",
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
    master.wait_for(r"leads job", START_S)
    return Cluster(launch, job_id, master, f"127.0.0.1:{port}", nnodes, token_file, tmp_path / "ckpt")


def node_rank(agent: Proc, round_number: int = 1) -> int:
    match = agent.wait_for(rf"round {round_number}: node rank (\d+) of", START_S)
    return int(match.group(1))


def starts(agent: Proc) -> list[tuple[int, int, int, int]]:
    """``(rank, world, restart, resumed_step)`` of every worker start this agent forwarded."""
    return [tuple(int(g) for g in m) for m in START_LINE.findall(agent.output())]


def failed_lines(agent: Proc) -> list[str]:
    return FAILED_LINE.findall(agent.output())


def remember_workers(*agents: Proc) -> None:
    """Record the agents' descendants now, so that :func:`assert_no_survivors` checks them later."""
    for agent in agents:
        agent.descendants()


def assert_succeeded(*agents: Proc) -> None:
    for agent in agents:
        code = agent.wait(EXIT_S)
        assert code == 0, f"{agent.log.name} exited {code}:\n{agent.output()[-4000:]}"
        assert "job succeeded" in agent.output()


def assert_no_survivors(*procs: Proc) -> None:
    """Every process the launched trees were seen to start is gone (zombies count as gone)."""
    wait_until(lambda: not any(p.survivors() for p in procs), 15, "the agents' workers and reapers to exit")


def parse_table(header: str, rows: list[str]) -> list[dict[str, str]]:
    """Rows of the status table as {column: cell}; cells are left-aligned under their column title."""
    columns = ("NODE", "RANK", "STATE", "HEARTBEAT AGE", "RESTARTS", "ROUND", "WORLD")
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S+(?: \S+)*", header)]
    titles = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    assert titles[: len(columns)] == list(columns), header  # more columns may follow
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{t: row[a:b].strip() for t, (a, b) in zip(titles, bounds, strict=True)} for row in rows]


def wait_for_any(agents: list[Proc], pattern: str, timeout: float, after: dict | None = None):
    """The first of ``agents`` whose output (past its offset in ``after``) matches ``pattern``."""
    regex = re.compile(pattern, re.M)
    after = after or {}

    def probe():
        for agent in agents:
            match = regex.search(agent.output(), after.get(agent, 0))
            if match:
                return agent, match
        return None

    return wait_until(probe, timeout, f"{pattern!r} in the output of one of {[a.log.name for a in agents]}")


# -- 1 ----------------------------------------------------------------------------------------------------
