"""A worker whose training is over but which never exits (torch 2.13's gloo can deadlock in the process
group's destructor, after elastic.destroy_process_group's report_done) is stopped by the agent's hang monitor
(agent.executor.health.HangMonitor) and counts as succeeded; a worker that reports no end is left alone. A
real worker process and the agent's real progress channel; before, such a job never ended."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from e2e import wait_until
from worker_exits import Exits

from agent.executor.health import HangMonitor
from agent.observe.channel import ProgressChannel
from agent.workers.group import WorkerGroup, WorkerSpec
from elastic import contract

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 0.5
SCRIPT = textwrap.dedent(
    """
    import os, threading
    from elastic.report import report, report_done
    report(1)
    if os.environ["ROLE"] == "done":
        report_done()
    print("ready", flush=True)
    threading.Event().wait()  # never exits by itself
    """
)


def test_a_done_worker_that_never_exits_is_stopped_and_succeeds_and_a_busy_one_is_left(
    tmp_path: Path,
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    channel = ProgressChannel()
    group = WorkerGroup(error_dir=tmp_path / "errors")
    try:
        channel.reset(2)
        env = {contract.AGENT_SOCKET: channel.path, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        spec = WorkerSpec(
            argv=[sys.executable, str(script)],
            envs=[
                {**env, "LOCAL_RANK": "0", "RANK": "0", "ROLE": "done"},
                {**env, "LOCAL_RANK": "1", "RANK": "1", "ROLE": "busy"},
            ],
            global_ranks=[0, 1],
        )
        exits = Exits(timeout_s=30.0)
        group.start(spec, exits)
        monitor = HangMonitor(0, group, channel, done_exit_grace_s=GRACE_S)
        wait_until(
            lambda: channel.snapshot().get(0) is not None and channel.snapshot()[0].done, 20, "rank 0 done"
        )
        done_pid = group.pids[0]
        wait_until(lambda: (monitor.check(0), group.running() == [1])[1], 20, "the done worker to be stopped")
        exit_ = exits.next()
        assert exit_.local_rank == 0 and exit_.returncode < 0, exit_
        assert exit_.pid in monitor.finished_pids == {done_pid}
        monitor.check(0)
        assert group.running() == [1], "a worker that did not say it is done is never stopped for it"
    finally:
        group.close()
        channel.close()
