"""A master that cannot raise its open-file limit (soft and hard lowered to 1,024 in its own process) under
a flood of idle TCP connections without a token (1,100 at once, each reopened as the master closes it for
sending no request) still lets a real agent join, heartbeat and train; it closes every idle connection
within its first-request timeout; its log stays small (docs/operations.md, "Open files and connections").
"""

from __future__ import annotations

import errno
import re
import resource
import selectors
import socket
import sys
import threading
import time

import e2e
import httpx
import pytest
from e2e import base_env, elastic_run_argv, train_args, unique_job, wait_until

from elastic.control.protocol import API_PREFIX, JOB_HEADER
from master.http.conn_guard import connection_cap
from master.service.settings import DEFAULT_HEADER_TIMEOUT_S

launch, jobs = e2e.launch, e2e.jobs  # fixtures: process trees killed, shm folders removed at teardown

pytestmark = pytest.mark.slow

TOKEN = "fd-limits-test-token"
FD_LIMIT = 1024
IDLE_CONNECTIONS = 1100
#: A connection the master closed this long after it opened was closed by the first-request timeout
#: (earlier ones were evicted to make room for a newer connection).
TIMED_OUT_AFTER_S = DEFAULT_HEADER_TIMEOUT_S * 0.8
#: Slack on a loaded 2-core machine for the timeout to be noticed and the close to arrive.
MARGIN_S = 15.0
START_S = 90.0
MAX_LOG_BYTES = 1 << 20
STEP_LINE = re.compile(r"^\[rank0\]:step=(\d+) ", re.M)

#: Lowers both limits, then runs the master: the master cannot raise them again.
LIMITED_MASTER = (
    "import os, resource, sys\n"
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT}))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'master', *sys.argv[1:]])\n"
)


class IdleFlood:
    """Holds ``count`` idle connections (no byte sent) to ``address`` in a thread; while flooding, each
    one the master closes by its timeout is reopened. Records each connection's life until the master
    closed it, and any connection still open past ``timeout_s + MARGIN_S``."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address, self.count = address, count
        self.selector = selectors.DefaultSelector()
        self.flooding = True
        self.opened = self.closed = self.timed_out = 0
        self.overdue: list[float] = []
        self.stopped = threading.Event()
        self.abandon = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="idle-flood", daemon=True)

    def start(self) -> IdleFlood:
        """Open ``count`` connections, then watch them in the thread."""
        try:
            for _ in range(self.count):
                self._open()
        except BaseException:
            self.__exit__()
            raise
        self.thread.start()
        return self

    def _open(self) -> None:
        sock = socket.create_connection(self.address, timeout=10)
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, time.monotonic())
        self.opened += 1

    def _run(self) -> None:
        try:
            while self.selector.get_map() and not self.abandon.is_set():
                for key, _ in self.selector.select(timeout=0.2):
                    self._closed(key)
                now = time.monotonic()
                self.overdue += [
                    now - key.data
                    for key in list(self.selector.get_map().values())
                    if now - key.data > DEFAULT_HEADER_TIMEOUT_S + MARGIN_S
                ]
                if self.overdue:
                    return
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            self.stopped.set()

    def _closed(self, key: selectors.SelectorKey) -> None:
        sock = key.fileobj
        try:
            if sock.recv(4096):  # type: ignore[union-attr]
                return  # the master sent something (it never should to an idle connection): read on
        except BlockingIOError:
            return
        except ConnectionResetError:
            pass
        life = time.monotonic() - key.data
        self.selector.unregister(sock)
        sock.close()  # type: ignore[union-attr]
        self.closed += 1
        if life >= TIMED_OUT_AFTER_S:
            self.timed_out += 1
            if self.flooding:
                self._open()

    def __enter__(self) -> IdleFlood:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        """Stop the thread and close what is still open (all of it, should the test fail early)."""
        self.flooding = False
        self.abandon.set()
        if self.thread.is_alive():
            self.stopped.wait(30)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


@pytest.fixture
def enough_files():
    """This test process holds the flood: its soft open-file limit goes up within its hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE_CONNECTIONS * 2 + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-file limit {hard} is below the {need} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def status(address: str, job_id: str) -> dict:
    headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job_id}
    response = httpx.get(f"http://{address}{API_PREFIX}/status", headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()


def steps(agent) -> int:
    found = STEP_LINE.findall(agent.output())
    return int(found[-1]) if found else -1


@pytest.mark.timeout(300)
def test_an_agent_joins_and_heartbeats_through_a_flood_of_idle_connections_at_a_low_fd_limit(
    launch, jobs, tmp_path, enough_files
) -> None:
    job_id = unique_job("fd")
    jobs.append(job_id)
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN + "\n")
    master_args = ["--host", "127.0.0.1", "--port", "0", "--job-id", job_id, "--nnodes", "1"]
    master_args += [
        "--token-file",
        str(token_file),
        "--heartbeat-interval",
        "0.5",
        "--heartbeat-timeout",
        "3",
        # The flood comes from the agent's own address: the per-address cap of connections without a token
        # (default 256) would refuse it before the descriptor cap this test is about is reached.
        "--max-unauthenticated-per-address",
        str(IDLE_CONNECTIONS * 2),
    ]
    master = launch([sys.executable, "-c", LIMITED_MASTER, *master_args], name="master")
    port = int(master.wait_for(r"listening on 127\.0\.0\.1:(\d+)", START_S).group(1))
    master.wait_for(r"leads job", START_S)
    cap = connection_cap(FD_LIMIT)
    assert f"open-file limit {FD_LIMIT}, hard limit {FD_LIMIT}: at most {cap} connections" in master.output()
    address = f"127.0.0.1:{port}"

    with IdleFlood(("127.0.0.1", port), IDLE_CONNECTIONS) as flood:
        assert status(address, job_id)["nodes"] == []  # answered at once, with the flood held
        agent = launch(
            elastic_run_argv(
                *("--nnodes", "1", "--nproc-per-node", "1", "--master", address, "--job-id", job_id),
                *("--token-file", str(token_file), "--node-id", "n0", "--ckpt-dir", str(tmp_path / "ckpt")),
                *train_args(steps=100_000, step_time=0.05, ckpt_every=100_000),
            ),
            name="agent",
            env=base_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        )
        agent.wait_for(r"^\[rank0\]:step=\d+ ", START_S)
        # Through a whole generation of the flood (its connections closed by the timeout and reopened),
        # the agent keeps heartbeating (its node stays alive, with a fresh heartbeat) and its worker steps.
        generation = flood.timed_out + IDLE_CONNECTIONS // 2
        wait_until(
            lambda: flood.timed_out >= generation or flood.stopped.is_set(), 60, "idle ones timing out"
        )
        before = steps(agent)
        [node] = status(address, job_id)["nodes"]
        assert node["node_id"] == "n0" and node["state"] not in ("dead", "left"), node
        assert node["heartbeat_age_s"] is not None and node["heartbeat_age_s"] < 3, node
        wait_until(lambda: steps(agent) > before, 60, "the worker to step on")
        assert flood.failure is None and not flood.overdue
        # The last generation: every idle connection closed by the master within the timeout (+ margin).
        flood.flooding = False
        assert flood.stopped.wait(DEFAULT_HEADER_TIMEOUT_S + MARGIN_S * 2), "idle connections still open"
    assert flood.failure is None and not flood.overdue, f"open for {max(flood.overdue, default=0):.1f}s"
    assert flood.closed == flood.opened > IDLE_CONNECTIONS
    output = master.output()
    assert "Traceback" not in output
    assert not re.search(rf"\[Errno {errno.EMFILE}\]", output)
    assert master.log.stat().st_size < MAX_LOG_BYTES
