"""A damaged checkpoint copy is reported where the operator looks: a worker's restore report reaches the
agent's progress channel, the keeper refuses to persist a damaged file (a persist failure saying why), and
the heartbeat carries both to a real master, which records event ``checkpoint_corrupt`` once per report,
counts it in its stats and exports ``elastic_checkpoint_corrupt_total``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from e2e import wait_until
from embedded_masters import EmbeddedMasters

from agent.checkpoints.keeper import CheckpointKeeper
from agent.executor.heartbeats import heartbeat_request
from agent.executor.node_view import NodeView
from agent.observe.channel import ProgressChannel
from elastic.checkpoint import flash, layout
from elastic.control.protocol import NodeState

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


class Masters(EmbeddedMasters):
    token = "digest-token"
    job_id = "job-digest"
    job: ClassVar[dict[str, Any]] = dict(EmbeddedMasters.job, min_nodes=1, max_nodes=1, last_call_s=0.1)


@pytest.fixture
def masters() -> Iterator[Masters]:
    # Not no_thread_left(): the progress channel's receiving thread (a daemon) ends at its next datagram.
    with Masters() as helper:
        yield helper


def damaged_flash_file(folder: Path, step: int) -> Path:
    """A flash file of ``step`` in ``folder`` with one bit flipped in its tensor bytes after the save."""
    plan = flash.plan({"w": torch.arange(256.0)})
    buffer = bytearray(plan.size)
    flash.write_frame(buffer, plan, step, flash.new_content_id())
    slot = plan.storages[0]
    torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset).copy_(slot.source)
    flash.seal(buffer, plan)
    buffer[slot.offset + 10] ^= 0x04
    path = folder / layout.step_file_name(step)
    path.write_bytes(bytes(buffer))
    return path


def test_damage_found_at_restore_and_at_persist_becomes_master_events_and_a_metric(
    masters: Masters, tmp_path: Path
) -> None:
    master, client = masters.running_node("a")

    (tmp_path / "shm").mkdir()
    keeper = CheckpointKeeper(masters.job_id, "a", ckpt_dir=tmp_path / "ckpt", root=tmp_path / "shm").start()
    channel = ProgressChannel(on_checkpoint=keeper.on_checkpoint)
    try:
        channel.reset(1)
        # A worker process's restore found step 6 damaged: it reports it over the real socket.
        victim = keeper.folder / layout.step_file_name(6)
        report = "from elastic.report import report_corrupt; import sys; report_corrupt(6, sys.argv[1])"
        env = {"ELASTIC_AGENT_SOCKET": channel.path, "ELASTIC_LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
        subprocess.run([sys.executable, "-c", report, str(victim)], env=env, cwd=REPO, check=True, timeout=30)
        wait_until(lambda: keeper.findings.total == 1, 10, "the channel to pass the report on")

        # The keeper is asked to persist a damaged step 7: a failure saying why, nothing on disk.
        damaged = damaged_flash_file(keeper.folder, 7)
        keeper.on_checkpoint(0, 7, str(damaged), round_number=1)
        assert keeper.wait_idle(10)
        step, error = keeper.persist_status()
        assert step is None and "failed its digest check" in error and str(damaged) in error
        assert not (tmp_path / "ckpt" / damaged.name).exists()
        assert [c.found_by for c in keeper.findings.pending()] == ["restore", "persist"]

        view = NodeView(state=NodeState.RUNNING, round=1, pids=[1])
        request = heartbeat_request("a", view, channel, keeper)
        assert [c.step for c in request.ckpt_corrupt] == [6, 7]
        client.heartbeat(request)
        client.heartbeat(request)  # its reply was lost, say: the same reports again are no news
        keeper.findings.delivered(c.id for c in request.ckpt_corrupt)
        assert "ckpt_corrupt" not in heartbeat_request("a", view, channel, keeper).model_dump(
            exclude_unset=True
        )
        client.heartbeat(heartbeat_request("a", view, channel, keeper))
    finally:
        channel.close()
        keeper.stop()

    events = [e for e in client.status().events if e.kind == "checkpoint_corrupt"]
    assert len(events) == 2, events
    assert (
        "step 6" in events[0].message and str(victim) in events[0].message and "restore" in events[0].message
    )
    assert "step 7" in events[1].message and "persist" in events[1].message
    metrics = masters.http(master).get("/metrics").text
    assert 'elastic_checkpoint_corrupt_total{job_id="job-digest"} 2.0' in metrics
