"""Token rotation without a restart (docs/security.md, "Rotating the token"), end to end: a real
``elastic-master --token-file`` daemon and a real ``elastic-run`` agent training (a gloo worker of
scripts/train_script.py); the token file is replaced mid-run as Kubernetes replaces a Secret (a new file
renamed over it). The agent talks plain HTTP (``ELASTIC_MASTER_STREAM=0``: every call carries the token;
over the agent stream only the upgrade does, and an open stream lives on), so that its first call after
the grace is refused with 401 and it must re-read the file (the stream's upgrade meets the same path in
elastic.control.client). One agent keeps the test short; tests/unit/elastic/test_token_source.py covers
the rules. Then:

* the master records ``token_rotated`` (the event names no token) and accepts the new token at once, the
  previous one for one heartbeat timeout (``--heartbeat-timeout``), then refuses it;
* the agent keeps training: no restart, no new round;
* ``elastic-master status`` works with the new token file and, with the old one after the grace, exits 2
  (docs/cli.md: a refused token) with one line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import e2e
import httpx
import pytest
from e2e import base_env, elastic_master_argv, train_args, wait_until
from multinode_cluster import (
    HEARTBEAT_TIMEOUT_S,
    START_S,
    STEP_LINE,
    TOKEN,
    assert_no_survivors,
    remember_workers,
    start_cluster,
    starts,
    wait_for_any,
)

from elastic.control.protocol import API_PREFIX, JOB_HEADER

launch = e2e.launch  # the fixture: every process tree a test launches is killed at its teardown

pytestmark = pytest.mark.slow

#: The master's tick records an event at most this long after it saw the change (min(0.1, interval/4)),
#: with room for the loop's own delay; the grace is counted from the change.
TICK_SLACK_S = 0.5


@pytest.mark.timeout(240)
def test_a_rotated_token_file_is_followed_and_restarts_nothing(launch, tmp_path):
    cluster = start_cluster(launch, tmp_path, "1")
    old_file = tmp_path / "old-token"
    old_file.write_text(TOKEN + "\n")
    old_file.chmod(0o600)
    script = train_args(steps=100_000, step_time=0.05)  # trains until stopped: the test ends it
    agent = cluster.agent("node-a", script, env={"ELASTIC_MASTER_STREAM": "0"})  # plain HTTP: every call
    wait_for_any([agent], STEP_LINE.format(world=1), START_S)
    before = cluster.status()
    master_at, agent_at = len(cluster.master.output()), len(agent.output())

    new = secrets.token_urlsafe(32)
    staged = tmp_path / "tok.new"
    staged.write_text(new + "\n")
    staged.chmod(0o600)
    os.replace(staged, cluster.token_file)  # atomic, as the kubelet swaps a Secret volume's files

    url = f"http://{cluster.address}{API_PREFIX}/status"
    with httpx.Client(trust_env=False, timeout=30) as http:

        def status(token: str) -> httpx.Response:
            return http.get(url, headers={"Authorization": f"Bearer {token}", JOB_HEADER: cluster.job_id})

        sent = time.monotonic()
        reply = status(new)  # at once: a refused token has the master look at the changed file
        assert reply.status_code == 200, reply.text
        old = status(TOKEN)
        answered = time.monotonic()
        line = cluster.master.wait_for(r"token_rotated: (the job token in .*)$", START_S, after=master_at)
        assert new not in line.group(0) and TOKEN not in line.group(0)
        assert f"previous one for {HEARTBEAT_TIMEOUT_S:g}s more" in line.group(1)
        rotated = [e for e in status(new).json()["events"] if e["kind"] == "token_rotated"]
        assert len(rotated) == 1, rotated
        # The old token within the grace: only checked when the reply surely came within it (a loaded
        # machine may have taken longer), from the event's age as the master gave it.
        ages = [e["age_s"] for e in reply.json()["events"] if e["kind"] == "token_rotated"]
        if ages and ages[0] + (answered - sent) < HEARTBEAT_TIMEOUT_S - TICK_SLACK_S:
            assert old.status_code == 200, old.text

        # After one heartbeat timeout the old token is refused (polled: a deadline from the settings).
        wait_until(
            lambda: status(TOKEN).status_code == 401, HEARTBEAT_TIMEOUT_S + START_S, "the old token refused"
        )
    with status_cli(cluster, old_file, cluster.token_file) as results:  # run while the agent is watched
        # The agent met the 401, re-read its token file and went on with the new token.
        agent.wait_for(r"it accepts the new token of \S+: using it", START_S, after=agent_at)
        at = len(agent.output())
        agent.wait_for(STEP_LINE.format(world=1), START_S, after=at)  # it still trains, in the same world
        refused, accepted = results()
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert refused.stderr.count("\n") == 1 and "wrong bearer token" in refused.stderr, refused.stderr
    assert accepted.returncode == 0, accepted.stderr
    assert "node-a" in accepted.stdout
    with httpx.Client(trust_env=False, timeout=30) as http:
        after = http.get(url, headers={"Authorization": f"Bearer {new}", JOB_HEADER: cluster.job_id}).json()
    assert (after["round"], after["restart_count"]) == (before["round"], 0), after
    assert "round_opened" not in cluster.master.output()[master_at:]
    assert [s[:3] for s in starts(agent)] == [(0, 1, 0)], "no restart"

    remember_workers(agent)
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(START_S) == 128 + signal.SIGTERM, agent.output()[-3000:]
    assert_no_survivors(agent)


@contextlib.contextmanager
def status_cli(cluster, *token_files) -> Iterator[Callable[[], list[subprocess.CompletedProcess[str]]]]:
    """``elastic-master status`` with each token file, started at once, side by side (each is a Python
    start-up); yields what waits for their results. None outlives the block."""
    procs = [
        subprocess.Popen(
            elastic_master_argv(
                "status", "--master", cluster.address, "--job-id", cluster.job_id, "--token-file", str(path)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=base_env(),
        )
        for path in token_files
    ]

    def results() -> list[subprocess.CompletedProcess[str]]:
        done = []
        for proc in procs:
            out, err = proc.communicate(timeout=START_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done

    try:
        yield results
    finally:
        for proc in procs:
            if proc.poll() is None:  # the block failed before it waited: leave no process behind
                proc.kill()
                proc.communicate()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
