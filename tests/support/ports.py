"""Ports for the processes the tests start, such that two never meet.

A port a test picks is bound later by another process (a worker's TCPStore, an etcd server); until then
two things could take it. An outgoing connection: every connect() draws its local port from the kernel's
ephemeral range (32768-60999 by default), so picks come from below it. And a parallel pytest process
(pytest-xdist) picking the same port: each process gets a slice of its own, of the tests' range and of the
range its agents draw their workers' store ports from (``ELASTIC_STORE_PORTS``, set by conftest.py)."""

from __future__ import annotations

import itertools
import os
import random
import socket

#: Ports the tests pick themselves (free_port).
TEST_PORTS = range(10000, 20000)
#: Ports the agents the tests start draw their workers' store ports from; below the ephemeral range too.
AGENT_STORE_PORTS = range(20000, 32768)


def share(ports: range) -> range:
    """This pytest process's slice of ``ports``: one of PYTEST_XDIST_WORKER_COUNT, none shared."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    size = len(ports) // max(count, 1)
    return ports[index * size : (index + 1) * size]


_MINE = share(TEST_PORTS)
# From a random place, so that a rerun does not meet the previous run's sockets in TIME_WAIT.
_NEXT = itertools.count(random.randrange(len(_MINE)))


def free_port() -> int:
    """A port of this process's slice that was free a moment ago (for a process this test starts)."""
    for _ in range(len(_MINE)):
        port = _MINE[next(_NEXT) % len(_MINE)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_MINE}")


def agent_store_ports() -> str:
    """``ELASTIC_STORE_PORTS`` for the agents this process starts."""
    mine = share(AGENT_STORE_PORTS)
    return f"{mine.start}-{mine.stop - 1}"
