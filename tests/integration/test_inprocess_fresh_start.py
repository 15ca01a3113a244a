"""The agent's in-process start when nothing is kept (agent.executor.inprocess.InProcessSteps.start): the
workers left from the previous round are ended first, with real worker processes.

A chaos run found it (bench/chaos.py, in process, twice in 30 minutes): a worker SIGKILLed right after it
had left its step was no longer paused, so the next round kept nothing, and the start over a worker that
the group still counted as running (its exit not reaped yet) raised ``workers still running`` and ended
the agent with a traceback. Here the leftover worker is simply alive and not paused: without the stop the
start raises every time."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from e2e import gone

from agent.executor.inprocess import InProcessHub, InProcessSteps
from agent.observe.events import EventLog
from agent.workers.group import WorkerGroup, WorkerSpec

pytestmark = pytest.mark.timeout(60)

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_fresh_start_ends_the_workers_left_running_first(tmp_path: Path) -> None:
    hub = InProcessHub(tmp_path)
    spec = WorkerSpec(argv=SLEEPER, envs=[ENV], global_ranks=[0])
    with WorkerGroup(error_dir=tmp_path / "errors") as group:
        try:
            group.start(spec)
            (leftover,) = group.pids
            steps = InProcessSteps(hub, group, EventLog())
            assert steps.keepable(True) == [], "not paused: nothing to keep"
            pids, kept, _ = steps.start(spec, 2, lambda exit_: None, keep=True)
            assert kept == [] and pids != [leftover]
            assert gone(leftover), "the leftover worker was ended before the start"
        finally:
            group.stop(grace_s=0.0)
            hub.close()
