"""The integrity guard's findings reach the operator: a worker process's reports (``elastic.report.
report_integrity``, over the real progress socket) go through the agent's channel and keeper into a
heartbeat, and a real master records one ``integrity_detected`` and one ``integrity_rolled_back`` event for
them; a spike that recurs at the same step after the rollback ends the job for good (exit 3), naming the
step and its samples."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from e2e import wait_until
from embedded_masters import EmbeddedMasters

from agent.checkpoints.keeper import CheckpointKeeper
from agent.executor.heartbeats import heartbeat_request
from agent.executor.node_view import NodeView
from agent.observe.channel import ProgressChannel
from elastic.control.protocol import Command, NodeState

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]

# A worker of rank 0 in a world of 3 reports what its guard found (a Verdict's fields), as elastic.run does.
WORKER = """
import sys, types
from elastic.report import report_integrity
kind, step, recurring, rolled = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
verdict = types.SimpleNamespace(kind=kind, step=step, ranks=(), recurring=recurring)
report_integrity(verdict, rank=0, world_size=3, rolled_back_to=int(rolled) if rolled else None,
                 samples=[5, 17, 2] if recurring else ())
"""


class Masters(EmbeddedMasters):
    token = "integrity-token"
    job_id = "job-integrity"
    job: ClassVar[dict[str, Any]] = dict(EmbeddedMasters.job, min_nodes=1, max_nodes=1, last_call_s=0.1)


@pytest.fixture
def masters() -> Iterator[Masters]:
    # Not no_thread_left(): the progress channel's receiving thread (a daemon) ends at its next datagram.
    with Masters() as helper:
        yield helper


def test_guard_reports_become_master_events_and_a_recurring_spike_stops_the_job_with_exit_3(
    masters: Masters, tmp_path: Path
) -> None:
    master, client = masters.running_node("a")
    (tmp_path / "shm").mkdir()
    keeper = CheckpointKeeper(masters.job_id, "a", ckpt_dir=tmp_path / "ckpt", root=tmp_path / "shm").start()
    channel = ProgressChannel(on_checkpoint=keeper.on_checkpoint)
    env = {"ELASTIC_AGENT_SOCKET": channel.path, "ELASTIC_LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    view = NodeView(state=NodeState.RUNNING, round=1, pids=[1])

    def worker(*args: str) -> None:
        subprocess.run([sys.executable, "-c", WORKER, *args], env=env, cwd=REPO, check=True, timeout=30)

    def beat() -> Command:
        request = heartbeat_request("a", view, channel, keeper)
        reply = client.heartbeat(request)
        keeper.findings.delivered(f.id for f in request.ckpt_corrupt)
        return reply.command

    try:
        channel.reset(1)
        worker("spike", "7", "0", "")  # detected at step 7...
        worker("spike", "7", "0", "5")  # ...and rolled back to step 5
        wait_until(lambda: keeper.findings.total == 2, 10, "the channel to pass the reports on")
        assert beat() is Command.CONTINUE
        events = [e.kind for e in client.status().events]
        assert events[-2:] == ["integrity_detected", "integrity_rolled_back"], events

        worker("spike", "7", "1", "")  # the replay spiked at step 7 again: data, not hardware
        wait_until(lambda: keeper.findings.total == 3, 10, "the channel to pass the report on")
        assert beat() is Command.STOP
        status = client.status()
        assert status.outcome is not None and status.outcome.exit_code == 3
        assert "step 7" in status.outcome.summary and "samples [5, 17, 2]" in status.outcome.summary
        assert [e.kind for e in status.events][-2:] == ["integrity_detected", "job_failed"]
    finally:
        channel.close()
        keeper.stop()
