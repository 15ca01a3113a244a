"""agent.executor.inprocess.InProcessHub against the worker's real end (elastic.inprocess.link) over a
socket."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from agent.executor.inprocess import InProcessHub
from elastic import contract
from elastic.inprocess.link import AgentGone, AgentLink

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def hub() -> Iterator[InProcessHub]:
    with tempfile.TemporaryDirectory(prefix="hub-") as folder:
        broken: list[tuple[int, int, str]] = []
        h = InProcessHub(folder, lambda *a: broken.append(a))
        h.broken = broken  # type: ignore[attr-defined]
        yield h
        h.close()


def connect(
    hub: InProcessHub, monkeypatch, local_rank: int, stuck: threading.Event | None = None
) -> AgentLink:
    monkeypatch.setenv(contract.INPROCESS_SOCKET, hub.path)
    monkeypatch.setenv(contract.LOCAL_RANK, str(local_rank))
    monkeypatch.delenv(contract.ELASTIC_LOCAL_RANK, raising=False)
    link = AgentLink.connect(0.05, stuck.set if stuck else lambda: None)
    assert link is not None
    return link


def wait_covers(hub: InProcessHub, pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not hub.covers(pids):
        assert time.monotonic() < deadline, "hello not seen"
        time.sleep(0.01)


def test_a_worker_that_said_hello_pauses_and_resumes_with_the_new_environment(hub, monkeypatch) -> None:
    stuck = threading.Event()
    link = connect(hub, monkeypatch, 0, stuck)
    wait_covers(hub, [os.getpid()])
    assert not hub.covers([os.getpid(), 999_999]), "a worker without the API: no in-process recovery"

    def worker() -> None:  # the training loop: it sees the pause, leaves, reports paused
        link.pausing.wait(10)
        link.left_step()
        link.send("paused", round=1, step=12)

    t = threading.Thread(target=worker)
    t.start()
    hub.send_pause([os.getpid()], 1)
    assert hub.wait_paused([os.getpid()], 5.0, lambda pid: True) == []
    t.join(5)
    assert not stuck.is_set(), "it left in time: the group was not released"
    assert hub.paused_pids() == [os.getpid()]
    assert hub.resume(os.getpid(), 2, {"RANK": "3", "WORLD_SIZE": "4"})
    resume = link.wait_resume(5)
    assert resume["env"] == {"RANK": "3", "WORLD_SIZE": "4"} and resume["round"] == 2
    assert hub.paused_pids() == [] and not link.pausing.is_set()
    link.close()


def test_a_worker_stuck_in_a_collective_is_released_and_a_silent_one_times_out(hub, monkeypatch) -> None:
    stuck = threading.Event()
    link = connect(hub, monkeypatch, 1, stuck)
    wait_covers(hub, [os.getpid()])
    hub.send_pause([os.getpid()], 1)
    waiting = hub.wait_paused([os.getpid()], 0.3, lambda pid: True)
    assert stuck.wait(5), "not out of its step within the grace: the group is released"
    assert waiting == [1], "local rank 1 did not leave its step within 0.3s"
    link.close()


def test_a_broken_report_reaches_the_agent_and_a_closed_agent_ends_the_wait(hub, monkeypatch) -> None:
    link = connect(hub, monkeypatch, 0)
    wait_covers(hub, [os.getpid()])
    link.send("broken", error="Connection closed by peer")
    deadline = time.monotonic() + 5
    while not hub.broken:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert hub.broken == [(0, os.getpid(), "Connection closed by peer")]  # type: ignore[attr-defined]
    hub.close()
    with pytest.raises(AgentGone):
        link.wait_resume(5)
    assert link.pausing.is_set(), "a loop that waits for the agent's word learns it is not coming"
    link.close()


def test_no_agent_socket_means_no_link(monkeypatch) -> None:
    monkeypatch.delenv(contract.INPROCESS_SOCKET, raising=False)
    assert AgentLink.connect(0.1, lambda: None) is None


def test_the_leave_grace_follows_the_step_time_within_bounds(hub, monkeypatch) -> None:
    link = connect(hub, monkeypatch, 0)
    assert link.leave_grace_s() == 0.05, "no step yet: the configured grace"
    link._last_commit = time.monotonic() - 0.2  # a step of 0.2 s just ended
    link.committed()
    assert 0.29 <= link.leave_grace_s() <= 0.4, "a healthy step finishes instead of being wasted"
    now = time.monotonic()
    assert link.leave_grace_s(now + 0.1) == pytest.approx(link.leave_grace_s(now) - 0.1), "what is left of it"
    assert link.leave_grace_s(now + 0.29) == 0.05, "late, not yet blocked: the configured grace"
    assert link.leave_grace_s(now + 2.0) == 0.0, "a step seconds late is blocked: released at once"
    link._last_commit = time.monotonic() - 30
    link.committed()
    assert link.leave_grace_s(link._last_commit) == 0.8, (
        "a blocked collective is still released within a second"
    )
    link.close()
