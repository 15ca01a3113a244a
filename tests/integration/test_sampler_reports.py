"""elastic.ElasticSampler reports each step to the agent over the real progress socket (a datagram the
test receives in the agent's place)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import elastic


@pytest.mark.timeout(10)
def test_advance_reports_the_step_to_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(path)
        agent.settimeout(5)
        monkeypatch.setenv("ELASTIC_AGENT_SOCKET", path)
        sampler = elastic.ElasticSampler(10, num_replicas=1, rank=0, batch_size=2)
        assert sampler.advance(2) == 2
        message = json.loads(agent.recv(1024))
    assert (message["k"], message["step"]) == ("step", 2)
