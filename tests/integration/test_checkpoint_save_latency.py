"""A worker's checkpoint report carries its save's duration over the real progress channel (a Unix
datagram socket); the agent counts it into ``elastic_agent_checkpoint_save_seconds``. Reports without
it (a worker library that predates it) and malformed ones count nothing and still count as checkpoints.
The real job's figure: tests/e2e/test_agent_metrics.py."""

from __future__ import annotations

import importlib
import json
import socket

import pytest
from e2e import wait_until

from agent.observe.channel import LatencyHistogram, ProgressChannel

pytestmark = pytest.mark.timeout(30)

# ``elastic.report`` is the function (``elastic`` re-exports it); the module is looked up by name.
report_module = importlib.import_module("elastic.report")


def test_the_histogram_counts_into_cumulative_buckets() -> None:
    histogram = LatencyHistogram((0.01, 0.1, 1.0))
    for seconds in (0.005, 0.01, 0.05, 3.0, -1.0):
        histogram.observe(seconds)
    sample = histogram.sample()
    assert sample.buckets == (("0.01", 3), ("0.1", 4), ("1.0", 4), ("+Inf", 5))
    assert sample.count == 5 and sample.total == pytest.approx(3.065)


def test_a_checkpoint_report_carries_the_save_duration_to_the_agent(monkeypatch) -> None:
    channel = ProgressChannel()
    monkeypatch.setenv(report_module.SOCKET_ENV, channel.path)
    monkeypatch.setenv("ELASTIC_LOCAL_RANK", "0")
    monkeypatch.delenv(report_module.STACK_FILE_ENV, raising=False)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        channel.reset(1)
        report_module.report_checkpoint(5, save_s=0.02)
        wait_until(lambda: channel.save_latency.sample().count == 1, 10, "the save's duration", interval=0.01)
        # A report of an older worker library (no duration) and malformed durations: checkpoints, no save.
        for message in (
            {"r": 0, "k": "ckpt", "step": 10, "loc": ""},
            {"r": 0, "k": "ckpt", "step": 15, "loc": "", "sv": -1},
            {"r": 0, "k": "ckpt", "step": 20, "loc": "", "sv": float("nan")},
            {"r": 0, "k": "ckpt", "step": 25, "loc": "", "sv": "soon"},  # dropped whole
        ):
            sock.sendto(json.dumps(message).encode(), channel.path)
        report_module.report_checkpoint(30, save_s=0.3)
        wait_until(lambda: channel.checkpointed_step() == 30, 10, "the last checkpoint report", interval=0.01)
        sample = channel.save_latency.sample()
        assert sample.count == 2 and sample.total == pytest.approx(0.32)
        assert dict(sample.buckets)["0.025"] == 1 and dict(sample.buckets)["0.5"] == 2
    finally:
        sock.close()
        channel.close()
        for name in ("_sock", "_reliable_sock"):
            opened = getattr(report_module, name)
            if opened is not None:
                opened.close()
            monkeypatch.setattr(report_module, name, None)
