"""A pause that reaches a worker while its group forms (elastic.inprocess): it leaves the formation in
process, with real worker processes under elastic.run, real gloo groups and the agent's real
InProcessHub (the test plays the rest of the agent: which round, which ranks, which store).

A chaos run found it (bench/chaos.py, in process, 30 minutes): a node admitted to a round never formed
its group (its agent had been cut off and rejoined, opening another round), so the other members waited
on the rendezvous store; the next round's pause could not get them out (the release only knew a formed
group's connections), the agents fell back to restarting the processes after their grace, and what the
processes held in memory was gone (with the agreement's old rule, 80 steps were lost). Here rank 1 is
never told of round 2: rank 0 waits in its formation until round 3's pause, which it must answer in
process, and both ranks then form round 3 with their processes and state kept."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e import REPO, alive
from ports import free_port

from agent.executor.inprocess import InProcessHub
from elastic import contract

pytestmark = pytest.mark.timeout(120)

WORKER = REPO / "tests" / "support" / "forming_rank.py"
#: Far below the reform timeout (60 s), far above a released formation's exit (well under a second).
LEAVE_WITHIN_S = 20.0


def round_env(round_number: int, rank: int, port: int) -> dict[str, str]:
    return {
        contract.ROUND: str(round_number),
        contract.RANK: str(rank),
        contract.WORLD_SIZE: "2",
        contract.MASTER_ADDR: "127.0.0.1",
        contract.MASTER_PORT: str(port),
    }


class Worker:
    """A rank's process and the lines it prints, read by a thread."""

    def __init__(self, hub: InProcessHub, rank: int, port: int, folder: Path) -> None:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "TORCHELASTIC_"))},
            **round_env(1, rank, port),
            contract.LOCAL_RANK: "0",
            contract.INPROCESS_SOCKET: hub.path,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(folder),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put("")

    def wait_line(self, prefix: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {timeout_s}s:\n{''.join(self.output)}") from None
            assert line, f"the worker ended before {prefix!r}:\n{''.join(self.output)}"
            if line.startswith(prefix):
                return line.strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("when", ["while_forming", "right_behind_the_resume"])
def test_a_pause_during_the_formation_is_answered_in_process(tmp_path: Path, when: str) -> None:
    """``while_forming``: the pause comes once rank 0 hosts round 2's store (its formation began);
    ``right_behind_the_resume``: on the heels of round 2's resume, possibly before the worker read it
    (the resume used to clear that pause, and the formation then waited for the reform timeout)."""
    hub = InProcessHub(tmp_path)
    port = free_port()
    workers = [Worker(hub, rank, port, tmp_path) for rank in (0, 1)]
    pids = [w.proc.pid for w in workers]
    try:
        for w in workers:
            w.wait_line("formed round=1")
        hub.send_pause(pids, 2)
        assert hub.wait_paused(pids, 60, alive) == [], "round 1's ranks left their steps"
        port2 = free_port()
        assert hub.resume(pids[0], 2, round_env(2, 0, port2)), "rank 0 forms round 2 ..."
        # ... and waits there for rank 1, which is never told of round 2 (as a member that never came).
        if when == "while_forming":
            deadline = time.monotonic() + 60
            while not listening(port2):
                assert time.monotonic() < deadline and workers[0].proc.poll() is None, "no store"
        hub.send_pause([pids[0]], 3)
        waiting = hub.wait_paused([pids[0]], LEAVE_WITHIN_S, alive)
        assert waiting == [], f"rank 0 did not leave its formation in process:\n{''.join(workers[0].output)}"
        port3 = free_port()
        for rank, pid in enumerate(pids):
            assert hub.resume(pid, 3, round_env(3, rank, port3))
        formed = [w.wait_line("formed round=3") for w in workers]
        assert all(f"pid={pid}" in line for line, pid in zip(formed, pids, strict=True)), formed
        steps = {line.split("step=")[1].split()[0] for line in formed}
        assert len(steps) == 1, f"both ranks resumed from one step: {formed}"
        for w in workers:
            assert w.proc.wait(60) == 0, "".join(w.output)
            assert "round=2" not in "".join(w.output), "round 2 never formed"
    finally:
        for w in workers:
            w.kill()
        hub.close()
