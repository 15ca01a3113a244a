"""A user's first hour on the command line: log lines that say when, how bad and where; the
commands' versions; ``--quiet``; a mistyped ``--master`` caught instead of hidden; a duplicate node id.

Real ``elastic-run``/``elastic-master`` processes (``python -m agent``/``master``) through the ``launch``
fixture, which kills every process tree it started at teardown. Workers are tiny scripts without torch
and agents run with ``--no-warm-start``, so that no zygote imports torch: each test takes seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import e2e
import pytest
from e2e import base_env, elastic_master_argv, elastic_run_argv, free_port

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

START_S = 60.0  # a master or an agent starting on a loaded 2-core machine
EXIT_S = 90.0

#: ``TIME LEVEL NODE [LOGGER] MESSAGE`` with TIME in ISO 8601 UTC with milliseconds.
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) +(\S+) \[[\w.]+\] "
)

SCRIPT = """\
import os, sys
rank = os.environ["RANK"]
print(f"hello from {rank}", flush=True)
print(f"[rank{rank}]: a line torch's excepthook prefixed itself", file=sys.stderr, flush=True)
"""


def script(tmp_path: Path, text: str = SCRIPT) -> str:
    path = tmp_path / "worker.py"
    path.write_text(text)
    return str(path)


def start_master(launch, tmp_path: Path, *extra: str) -> tuple[e2e.Proc, str, Path]:
    """A master on a free port of 127.0.0.1: ``(process, address, token file)``."""
    token = tmp_path / "tok"
    master = launch(
        elastic_master_argv(
            "--host", "127.0.0.1", "--port", "0", "--job-id", "fh", "--token-file", str(token), *extra
        ),
        name="master",
    )
    port = master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1)
    master.wait_for("leads job", START_S)
    return master, f"127.0.0.1:{port}", token


def agent_argv(address: str, token: Path, node: str, *extra: str) -> list[str]:
    return elastic_run_argv(
        "--master", address, "--job-id", "fh", "--token-file", str(token), "--node-id", node,
        "--no-warm-start", "--stop-grace", "2", *extra,
    )  # fmt: skip


def control_lines(output: str) -> list[str]:
    """The agent's own lines: not the workers' (``[rankN]:``) nor the CLI's final ``elastic-run:`` line."""
    return [
        line
        for line in output.splitlines()
        if line and not line.startswith(("[rank", "elastic-run:", "elastic-master:"))
    ]


# -- logs -------------------------------------------------------------------------------------------------
def test_every_agent_and_master_line_carries_a_utc_time_a_level_and_the_node(launch, tmp_path):
    master, address, token = start_master(launch, tmp_path)
    agent = launch(agent_argv(address, token, "node-a", script(tmp_path)), name="agent")
    assert agent.wait(EXIT_S) == 0, agent.output()[-3000:]

    lines = control_lines(agent.output())
    assert any("job succeeded" in line for line in lines), agent.output()
    for line in lines:
        match = TEXT_LINE.match(line)
        assert match and match.group(2) == "node-a", line
    for line in control_lines(master.output()):
        match = TEXT_LINE.match(line)
        assert match and match.group(2) == "master", line


def test_log_format_json_writes_one_object_a_line(launch, tmp_path):
    master, address, token = start_master(launch, tmp_path, "--log-format", "json")
    agent = launch(agent_argv(address, token, "node-j", "--log-format", "json", script(tmp_path)), name="a")
    assert agent.wait(EXIT_S) == 0, agent.output()[-3000:]

    for proc, node in ((agent, "node-j"), (master, "master")):
        records = [json.loads(line) for line in control_lines(proc.output())]
        assert records, proc.output()
        for record in records:
            assert {"time", "level", "node", "logger", "message"} <= set(record), record
            assert record["node"] == node and record["time"].endswith("Z"), record
    assert any(r["message"] == "job succeeded" for r in map(json.loads, control_lines(agent.output())))


def test_quiet_leaves_only_warnings_the_outcome_and_the_workers_output(launch, tmp_path):
    agent = launch(elastic_run_argv("--standalone", "--no-warm-start", "--quiet", script(tmp_path)), name="a")
    assert agent.wait(EXIT_S) == 0, agent.output()

    lines = control_lines(agent.output())
    kept = ("job succeeded", "standalone master at ")  # the outcome, and how to reach the master
    assert [line for line in lines if " INFO " in line and not any(k in line for k in kept)] == [], lines
    assert "[rank0]:hello from 0" in agent.output().splitlines()


def test_a_worker_line_that_carries_its_rank_prefix_is_not_prefixed_twice(launch, tmp_path):
    agent = launch(elastic_run_argv("--standalone", "--no-warm-start", "--quiet", script(tmp_path)), name="a")
    assert agent.wait(EXIT_S) == 0, agent.output()

    assert "[rank0]: a line torch's excepthook prefixed itself" in agent.output().splitlines()
    assert "[rank0]:[rank0]:" not in agent.output()


@pytest.mark.parametrize("module", ["agent", "master"])
def test_version_prints_the_installed_package_version(module):
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=60,
    )
    name = "elastic-run" if module == "agent" else "elastic-master"
    assert (out.returncode, out.stdout.strip()) == (0, f"{name} {version('elastic-run')}"), out


# -- typos caught ---------------------------------------------------------------------------------------
def test_a_master_address_that_does_not_answer_is_waited_for_never_hosted(launch, tmp_path):
    port = free_port()
    argv = elastic_run_argv(
        "--master", f"127.0.0.1:{port}", "--job-id", "fh", "--master-timeout", "2", "--no-warm-start",
        script(tmp_path),
    )  # fmt: skip
    agent = launch(argv, name="agent")
    code = agent.wait(EXIT_S)

    assert code == 1, agent.output()
    assert "hosts it" not in agent.output()
    assert f"no job master answered at 127.0.0.1:{port}" in agent.output()


def test_host_master_hosts_the_master_of_a_master_address_that_does_not_answer(launch, tmp_path):
    port = free_port()
    argv = elastic_run_argv(
        "--master",
        f"127.0.0.1:{port}",
        "--host-master",
        "--job-id",
        "fh",
        "--no-warm-start",
        script(tmp_path),
    )
    agent = launch(argv, name="agent")
    assert agent.wait(EXIT_S) == 0, agent.output()[-3000:]
    assert "this agent hosts it (convenience mode)" in agent.output()


def test_a_web_server_at_the_master_address_is_named_in_one_line_and_exits_2(launch, tmp_path):
    port = free_port()
    web = launch([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(port)], name="web")
    web.wait_for(rf"Serving HTTP on 127\.0\.0\.1 port {port}", START_S)
    expected = f"127.0.0.1:{port} is not an elastic-master (HTTP 404, text/html)"

    agent = launch(
        elastic_run_argv(
            "--master", f"127.0.0.1:{port}", "--job-id", "fh", "--no-warm-start", script(tmp_path)
        ),
        name="agent",
    )
    assert agent.wait(EXIT_S) == 2, agent.output()
    assert [line for line in agent.output().splitlines() if "elastic-master" in line] == [
        f"elastic-run: error: {expected}"
    ], agent.output()
    assert "<html" not in agent.output().lower() and "hosts it" not in agent.output()

    status = subprocess.run(
        elastic_master_argv("status", "--master", f"127.0.0.1:{port}", "--job-id", "fh"),
        capture_output=True, text=True, env=base_env(), timeout=60,
    )  # fmt: skip
    assert (status.returncode, status.stderr.strip()) == (2, f"elastic-master: error: {expected}"), status


def test_a_duplicate_node_id_on_one_host_exits_2(launch, tmp_path):
    _, address, token = start_master(launch, tmp_path)
    go = tmp_path / "go"
    waiting = script(tmp_path, f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n")
    first = launch(agent_argv(address, token, "twin", waiting), name="first")
    first.wait_for(r"round 1: node rank 0 of 1", START_S)

    second = launch(agent_argv(address, token, "twin", waiting), name="second")
    code = second.wait(EXIT_S)
    go.touch()

    assert code == 2, second.output()
    assert "give each agent its own --node-id" in second.output()
    assert first.wait(EXIT_S) == 0, first.output()[-3000:]


# -- --standalone: where its master is, and its token -------------------------------------------------
STANDALONE_LINE = (
    r"standalone master at (?P<address>\S+) \(job (?P<job>\S+)\), "
    r"token file (?P<token>\S+) \(removed at exit\)"
)


def test_standalone_names_its_master_and_a_private_token_file_that_status_and_metrics_accept(
    launch, tmp_path
):
    import httpx

    go = tmp_path / "go"
    waiting = script(tmp_path, f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n")
    argv = elastic_run_argv(
        "--standalone", "--no-warm-start", "--quiet", "--ckpt-dir", str(tmp_path / "ckpt"), waiting
    )
    agent = launch(argv, name="agent")
    found = agent.wait_for(STANDALONE_LINE, START_S)
    address, job, token_file = found.group("address"), found.group("job"), Path(found.group("token"))

    assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.parent.stat().st_mode & 0o777 == 0o700
    assert tmp_path not in token_file.parents, "not in the working directory or --ckpt-dir"
    status = subprocess.run(
        elastic_master_argv("status", "--master", address, "--job-id", job, "--token-file", str(token_file)),
        capture_output=True, text=True, env=base_env(), timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status
    token = token_file.read_text().strip()
    metrics = httpx.get(f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert metrics.status_code == 200 and "elastic_" in metrics.text
    go.touch()

    assert agent.wait(EXIT_S) == 0, agent.output()[-3000:]
    assert not token_file.parent.exists(), "the token's folder is removed at exit"


# -- hang stacks outlive the agent --------------------------------------------------------------------
STALLING = """\
import os, threading
import elastic

rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(1, 4):
    elastic.report(step)
if restart == 0:
    print("stalling", flush=True)
    threading.Event().wait()  # alive, but no step ever again
"""


@pytest.mark.timeout(240)
def test_a_hang_stack_taken_without_log_dir_is_kept_after_the_agent_exits(launch, tmp_path):
    argv = elastic_run_argv(
        "--standalone", "--no-warm-start", "--heartbeat-interval", "0.5", "--hang-timeout", "2",
        "--stop-grace", "2", script(tmp_path, STALLING),
    )  # fmt: skip
    agent = launch(argv, name="agent")
    assert agent.wait(EXIT_S * 2) == 0, agent.output()[-4000:]

    saved = re.search(r"rank 0: Python stack \(\S+\) saved to (\S+):$", agent.output(), re.M)
    assert saved, agent.output()[-4000:]
    stack = Path(saved.group(1))
    assert stack.is_file() and "wait" in stack.read_text(), "the stack file outlives the agent"
    assert f"Python stack in {stack}" in agent.output()


# -- say why, while waiting --------------------------------------------------------------------------
def test_an_agent_waiting_for_its_master_says_so_at_once_then_every_interval(launch, tmp_path):
    from agent.executor.master_link import WAIT_LINE_INTERVAL_S

    port = free_port()
    timeout = WAIT_LINE_INTERVAL_S * 1.5  # room for exactly two lines: at the start and one interval later
    argv = elastic_run_argv(
        "--master", f"127.0.0.1:{port}", "--job-id", "fh", "--master-timeout", f"{timeout:g}",
        "--no-warm-start", script(tmp_path),
    )  # fmt: skip
    agent = launch(argv, name="agent")
    assert agent.wait(EXIT_S) == 1, agent.output()

    lines = re.findall(
        rf"no answer from 127\.0\.0\.1:{port} for (\d+) s; waiting, giving up after", agent.output()
    )
    assert len(lines) == 2, agent.output()
    assert int(lines[0]) <= 5, "the first line comes within 5 s of the wait's start"


def test_a_master_lost_mid_run_is_reported_at_once_with_what_happens_next(launch, tmp_path):
    master, address, token = start_master(launch, tmp_path, "--heartbeat-interval", "0.5")
    go = tmp_path / "go"
    waiting = script(tmp_path, f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n")
    agent = launch(agent_argv(address, token, "node-l", "--master-timeout", "5", waiting), name="agent")
    agent.wait_for(r"round 1: node rank 0 of 1", START_S)
    master.kill()

    lost = agent.wait_for(
        rf"lost the job master: no answer from {re.escape(address)} for \d+ s; .*$", START_S
    )
    assert "giving up after --master-timeout 5 s; the workers keep training meanwhile" in lost.group(0)
    go.touch()
    assert agent.wait(EXIT_S) == 1, agent.output()[-3000:]
