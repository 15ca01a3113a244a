"""The agent's hang-watch thread (agent.executor.health.HangWatchThread) names a hung worker on its own
schedule, with no heartbeat thread and no master: a real worker process that stops stepping, the agent's
real progress channel and hang monitor. Before, hangs were checked only at each heartbeat, so a verdict came
up to a whole heartbeat interval after its bound (half a second late on average, for every hung or stopped
worker and, through its peers' stall, for every node cut off). And a worker found stopped as its node leaves
a round in process is continued (agent.executor.health.continue_stopped): before, when a peer's stall named
the hang first, the stopped worker could not leave its step and the node restarted its processes after
--stop-grace."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from agent_machine_fakes import assignment
from e2e import wait_until
from worker_exits import Exits

from agent.executor.health import HangMonitor, HangWatchThread, continue_stopped
from agent.executor.node_view import NodeView
from agent.machine.events import AgentEvent, HangSeen
from agent.observe.channel import ProgressChannel
from agent.workers.group import WorkerGroup, WorkerSpec
from elastic import contract
from elastic.control.protocol import NodeState

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
    import threading
    from elastic.report import report
    for step in (1, 2, 3):
        report(step)
    threading.Event().wait()  # alive, and never steps again
    """
)


class Unexpected:
    """A hang monitor that must not be asked (the node does not train)."""

    def check(self, generation: int) -> list[object]:
        raise AssertionError("checked while the node was not training")


@contextlib.contextmanager
def workers(tmp_path: Path, n: int) -> Iterator[tuple[WorkerGroup, ProgressChannel]]:
    """``n`` real workers of :data:`SCRIPT` (local ranks 0..n-1), their stack files under tmp_path/stacks."""
    script = tmp_path / "stops.py"
    script.write_text(SCRIPT)
    channel = ProgressChannel()
    group = WorkerGroup(error_dir=tmp_path / "errors")
    try:
        channel.reset(n)
        env = {contract.AGENT_SOCKET: channel.path, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        envs = [
            {**env, "LOCAL_RANK": str(r), "RANK": str(r), contract.STACK_FILE: str(stack_file(tmp_path, r))}
            for r in range(n)
        ]
        group.start(
            WorkerSpec(argv=[sys.executable, str(script)], envs=envs, global_ranks=list(range(n))),
            Exits(30.0),
        )
        yield group, channel
    finally:
        group.close()
        channel.close()


def stack_file(tmp_path: Path, rank: int) -> Path:
    return tmp_path / "stacks" / "round1" / f"rank{rank}" / "stack.txt"


def test_a_worker_that_stops_stepping_is_named_hung_by_the_watch_thread_alone(tmp_path: Path) -> None:
    closing = threading.Event()
    posted: queue.Queue[AgentEvent] = queue.Queue()
    with workers(tmp_path, 1) as (group, channel):
        try:
            monitor = HangMonitor(0.5, group, channel)
            view = NodeView(state=NodeState.RUNNING, pids=list(group.pids))
            HangWatchThread(monitor, lambda: view, posted.put, lambda: 7, closing, interval_s=0.05).start()
            event = posted.get(timeout=30)  # no heartbeat thread runs: the watch thread alone posts it
        finally:
            closing.set()
        assert isinstance(event, HangSeen) and event.generation == 7, event
        (hang,) = event.hangs
        assert hang.local_rank == 0 and "no step for" in hang.reason, hang
        assert hang.stalled_s >= 0.5, "never before the bound"
        assert monitor.check(7) == [], "reported once per worker generation"


def test_the_watch_thread_asks_nothing_while_the_node_does_not_train() -> None:
    posted: list[AgentEvent] = []
    for state in (NodeState.WAITING, NodeState.SUCCEEDED):
        watch = HangWatchThread(
            Unexpected(),  # type: ignore[arg-type]
            lambda: NodeView(state=state),  # noqa: B023 - called at once, in this iteration
            posted.append,
            lambda: 1,
            threading.Event(),
        )
        watch.check_once()
    assert posted == []


def test_a_stopped_worker_is_continued_with_its_stack_recorded_as_its_node_leaves_the_round(
    tmp_path: Path,
) -> None:
    with workers(tmp_path, 2) as (group, channel):
        wait_until(lambda: all((p := channel.snapshot().get(r)) and p.step == 3 for r in (0, 1)), 20, "steps")
        pids = list(group.pids)
        os.kill(pids[1], signal.SIGSTOP)
        wait_until(lambda: psutil.Process(pids[1]).status() == psutil.STATUS_STOPPED, 10, "the stop")
        round1 = assignment(1)
        found = continue_stopped((0, 1), pids, round1, tmp_path / "stacks", "round1")
        assert found == [1], "only the stopped worker"
        assert psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED, "continued"
        assert list(stack_file(tmp_path, 1).parent.glob("stack*.txt")), "its stack was recorded"
        assert continue_stopped((0, 1), pids, round1, tmp_path / "stacks", "round1") == []
