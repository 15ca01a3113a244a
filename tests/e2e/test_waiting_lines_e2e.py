"""The agent says why while it waits for other nodes, and why it restarts its workers: real
``elastic-master`` and ``elastic-run`` processes (``python -m master``/``agent``) through the ``launch``
fixture, which kills every process tree it started at teardown. Workers are tiny scripts without torch and
agents run with ``--no-warm-start``; deadlines come from the agent's line interval (WAIT_LINE_INTERVAL_S).
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import e2e
import pytest
from e2e import elastic_master_argv, elastic_run_argv

from agent.executor.master_link import WAIT_LINE_INTERVAL_S

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

START_S = 60.0  # a master or an agent starting on a loaded 2-core machine
EXIT_S = 90.0
FIRST_LINE_S = 5.0  # the bound for the first waiting line after the wait's start

#: ``TIME LEVEL NODE [LOGGER] MESSAGE``: TIME in ISO 8601 UTC with milliseconds (the agent's text format).
LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z \w+ +\S+ \[[\w.]+\] (.*)$", re.M)


def start_master(launch, tmp_path: Path, *extra: str) -> tuple[e2e.Proc, str, Path]:
    """A master on a free port of 127.0.0.1: ``(process, address, token file)``."""
    token = tmp_path / "tok"
    master = launch(
        elastic_master_argv(
            "--host", "127.0.0.1", "--port", "0", "--job-id", "wl", "--token-file", str(token), *extra
        ),
        name="master",
    )  # fmt: skip
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
    master.wait_for("leads job", START_S)
    return master, f"127.0.0.1:{port}", token


def agent(launch, address: str, token: Path, node: str, nnodes: str, script: Path) -> e2e.Proc:
    argv = elastic_run_argv(
        "--master", address, "--job-id", "wl", "--token-file", str(token), "--node-id", node,
        "--nnodes", nnodes, "--no-warm-start", "--stop-grace", "2", str(script),
    )  # fmt: skip
    return launch(argv, name=node)


def logged_at(proc: e2e.Proc, pattern: str) -> list[datetime]:
    """When the agent logged each of its lines whose message matches ``pattern``."""
    regex = re.compile(pattern)
    return [
        datetime.fromisoformat(when) for when, message in LINE.findall(proc.output()) if regex.search(message)
    ]


def test_an_agent_waiting_for_other_nodes_says_so_soon_then_once_per_interval(launch, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello', flush=True)\n")
    master, address, token = start_master(launch, tmp_path, "--nnodes", "2:3", "--last-call", "1")
    first = agent(launch, address, token, "n-a", "2:3", script)
    nodes = r"round 1: 1 of 2 nodes joined \(min 2, max 3\); waiting for 1 more node to reach the minimum 2$"
    seen = first.wait_for(nodes, START_S)
    first.wait_for(nodes, WAIT_LINE_INTERVAL_S + FIRST_LINE_S, after=seen.end())

    [joined] = logged_at(first, r"^joined: waiting for round 1")
    one, two = logged_at(first, nodes)[:2]
    assert (one - joined).total_seconds() <= FIRST_LINE_S, first.output()[-3000:]
    assert (two - one).total_seconds() >= WAIT_LINE_INTERVAL_S, "one line per interval, not more"

    second = agent(launch, address, token, "n-b", "2:3", script)
    assert first.wait(EXIT_S) == 0, first.output()[-3000:]
    assert second.wait(EXIT_S) == 0, second.output()[-3000:]
    assert len(logged_at(first, nodes)) <= 3, "no more waiting lines once assigned"


KILLED_ONCE = """\
import os, signal, threading
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait(120)  # the survivor trains on until its agent stops it for the restart
print("done", flush=True)
"""


def test_a_killed_worker_makes_every_agent_say_the_cause_the_attempt_and_the_budget(launch, tmp_path):
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    master, address, token = start_master(launch, tmp_path, "--nnodes", "2", "--max-restarts", "3")
    agents = [agent(launch, address, token, node, "2", script) for node in ("n-a", "n-b")]
    for proc in agents:
        assert proc.wait(EXIT_S) == 0, proc.output()[-3000:]
    # Rank 1 is the node that joined second: whichever it was, every agent names it.
    [killed] = [
        proc for proc in agents if logged_at(proc, r"^rank 1 \(local rank 0\) failed with signal SIGKILL")
    ]
    node = "n-a" if killed is agents[0] else "n-b"
    restart = (
        rf"restarting workers \(attempt 1 of 3 restarts\): rank 1 \(local rank 0 on node {node}\) failed "
        r"with signal SIGKILL$"
    )
    for proc in agents:  # the failed node and the survivor alike, once each
        assert len(logged_at(proc, restart)) == 1, proc.output()[-3000:]
        assert not logged_at(proc, r"^master opened round"), "the plain line gave way to the cause"
