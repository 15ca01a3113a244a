"""End-to-end tests of the adaptive hang bound (no ``--hang-timeout``) with an unmodified DDP script: real
``elastic-run`` agents, real gloo workers that never import elastic (tests/support/plain_ddp.py, 50 ms
steps). Progress comes only from the hooks elastic-run installs (elastic.autoprogress).

1. A SIGSTOPped worker is declared hung within its adaptive bound (read from the verdict) + one heartbeat
   + slack, named as stopped; the world restarts and the job succeeds.
2. A worker in a pure-Python busy loop (in the second round: a worker started after a restart) likewise.
3. Evaluation pauses of 10 x the step time, and ones longer than the bound (forward passes, no optimizer
   step), are no verdict.

Every wait is a poll of the agent's log with a deadline; the ``launch`` fixture kills every process tree.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import e2e
import pytest
from e2e import Proc, alive, elastic_run_argv, wait_until, worker_pid
from multinode_cluster import START_S, assert_no_survivors
from multinode_cluster import agent_env as env

from agent.observe.hang_policy import DEFAULT_POLICY

launch = e2e.launch  # the fixture

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "plain_ddp.py"
HEARTBEAT_INTERVAL_S = 0.5
#: Slack for reading the agent's log on a loaded machine, on top of "bound + one heartbeat".
DETECTION_SLACK_S = 1.5
EXIT_S = 120.0
VERDICT = r"\[agent\.[\w.]+\] rank 1 \(local rank 1, pid {pid}\) is hung: (.*)$"
BOUND = re.compile(r"adaptive bound ([\d.]+)s = max\(3 x p99 step [\d.e-]+s, floor 2s\)")


def agent(launch, tmp_path: Path, *script_args: str) -> Proc:
    argv = elastic_run_argv(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--heartbeat-interval",
        str(HEARTBEAT_INTERVAL_S),
        "--log-dir",
        str(tmp_path / "logs"),
        "--stop-grace",
        "2",
        str(SCRIPT),
        *script_args,
    )
    return launch(argv, name="agent", env=env())


def bound_of(reason: str) -> float:
    match = BOUND.search(reason)
    assert match, reason
    bound = float(match.group(1))
    assert bound >= DEFAULT_POLICY.floor_s
    return bound


@pytest.mark.timeout(300)
def test_a_sigstopped_worker_of_an_unmodified_script_is_hung_within_its_adaptive_bound(launch, tmp_path):
    proc = agent(launch, tmp_path, "200")
    proc.wait_for(r"^\[rank1\]:step=60 rank=1 restart=0$", START_S)  # past the warm-up (10 steps)
    victim = worker_pid(proc, 1, "plain_ddp.py")
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    reason = proc.wait_for(VERDICT.format(pid=victim), 60).group(1)
    detected_s = time.monotonic() - stopped_at
    bound = bound_of(reason)
    print(f"\nSIGSTOP: hang declared {detected_s:.2f}s after the stop ({reason})")
    assert detected_s <= bound + HEARTBEAT_INTERVAL_S + DETECTION_SLACK_S
    assert reason.startswith("no progress for ") and "its process has been stopped" in reason
    proc.wait_for(r"^\[rank1\]:start rank=1 restart=1$", START_S)
    wait_until(lambda: not alive(victim), 20, "the stopped worker to be gone")
    proc.descendants()  # remember the new workers, for the survivor check
    assert proc.wait(EXIT_S) == 0, proc.output()[-4000:]
    assert "job succeeded" in proc.output()
    assert_no_survivors(proc)


@pytest.mark.timeout(300)
def test_a_worker_in_a_python_loop_is_hung_within_its_adaptive_bound(launch, tmp_path):
    # The loop comes in the second round, whose workers start after a restart (forked from the warm-start
    # zygote when it is ready): the first round's SIGSTOP makes the restart.
    proc = agent(launch, tmp_path, "120", "--loop-at", "60", "--loop-restart", "1")
    proc.wait_for(r"^\[rank1\]:step=40 rank=1 restart=0$", START_S)
    first = worker_pid(proc, 1, "plain_ddp.py")
    os.kill(first, signal.SIGSTOP)
    proc.wait_for(VERDICT.format(pid=first), 60)
    proc.wait_for(r"^\[rank1\]:looping rank=1$", START_S)
    looping_at = time.monotonic()  # its last optimizer step came just before this line
    victim = worker_pid(proc, 1, "plain_ddp.py")
    reason = proc.wait_for(VERDICT.format(pid=victim), 60).group(1)
    detected_s = time.monotonic() - looping_at
    bound = bound_of(reason)
    print(f"\nPython loop: hang declared {detected_s:.2f}s after its last step ({reason})")
    assert detected_s <= bound + HEARTBEAT_INTERVAL_S + DETECTION_SLACK_S
    assert reason.startswith("no progress for ") and "stopped" not in reason
    proc.wait_for(r"^\[rank1\]:done rank=1 restart=2$", START_S)
    proc.descendants()
    assert proc.wait(EXIT_S) == 0, proc.output()[-4000:]
    assert_no_survivors(proc)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("eval_s", [0.5, 2 * DEFAULT_POLICY.floor_s + 2 * HEARTBEAT_INTERVAL_S])
def test_evaluation_pauses_are_not_a_hang(launch, tmp_path, eval_s):
    # 0.5 s: 10 x the step time; the other is longer than the bound: only its forward passes show life.
    proc = agent(launch, tmp_path, "160", "--eval-every", "40", "--eval-s", str(eval_s))
    assert proc.wait(EXIT_S + START_S) == 0, proc.output()[-4000:]
    output = proc.output()
    assert re.search(r"^\[rank1\]:done rank=1 restart=0$", output, re.M), output[-4000:]
    assert "is hung" not in output and "restart=1" not in output
    assert_no_survivors(proc)
