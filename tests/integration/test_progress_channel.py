"""The agent's progress channel (agent.observe.channel) over its real datagram socket: compute times and the
done
flag of a worker's reports."""

from __future__ import annotations

import json
import os
import socket

import pytest
from e2e import wait_until

from agent.observe.channel import ProgressChannel

pytestmark = pytest.mark.timeout(30)


def test_the_channel_keeps_compute_times_and_the_done_flag():
    channel = ProgressChannel()
    try:
        channel.reset(1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for message in (
            {"r": 0, "k": "step", "step": 1},
            {"r": 0, "k": "step", "step": 2, "b": 0.25},
            {"r": 0, "k": "step", "step": 3, "b": 0.75},
            {"r": 0, "k": "done", "step": 3},
        ):
            sock.sendto(json.dumps(message).encode(), channel.path)
        wait_until(lambda: channel.snapshot()[0].done, 5.0, "the done report")
        progress = channel.snapshot()[0]
        assert progress.step == 3 and progress.compute_time_s == 0.5
        sock.close()
    finally:
        channel.close()


def test_a_tmpdir_too_deep_for_a_unix_socket_puts_the_channel_in_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile caches its folder: read TMPDIR again
    channel = ProgressChannel()
    try:
        assert channel.path.startswith("/tmp/elastic-agent-") and len(channel.path.encode()) <= 107
        assert list(deep.iterdir()) == [], "the folder made under TMPDIR first was removed"
        channel.reset(1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendto(json.dumps({"r": 0, "k": "step", "step": 1}).encode(), channel.path)
        wait_until(lambda: channel.snapshot()[0].step == 1, 5.0, "the step report")
        sock.close()
    finally:
        channel.close()
    assert not os.path.exists(channel.folder)
