"""An agent rides through 500/502/504 answers in front of its master (a proxy
or load balancer having a bad second) instead of stopping its workers at the first one.

A real ``elastic-master``, a real ``elastic-run`` agent and its gloo worker; between them a TCP relay of
this test that, for a window shorter than the heartbeat timeout, answers every request that arrives with
500, 502 or 504 (in turn) and closes that connection; a request already relayed (a long-poll) goes on. The
worker must keep its process and its steps: no restart, no repeated or skipped step, and the agent must have
met the errors (the relay counts them).

Both transports: plain HTTP (``ELASTIC_MASTER_STREAM=0``: every heartbeat is a request the relay can fail),
and the agent stream, which the relay treats as a proxy treats an upgraded connection: a tunnel it passes
through (a proxy cannot answer inside it); only new connections meet the 5xx. An agent whose stream is
up opens none, so it meets none: the test checks that it kept that one connection and its worker."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import socket
import sys
import threading

import e2e
import pytest
from e2e import train_args, wait_until
from multinode_cluster import (
    HEARTBEAT_TIMEOUT_S,
    START_LINE,
    START_S,
    STEP_LINE,
    assert_succeeded,
    start_cluster,
)

launch = e2e.launch

pytestmark = pytest.mark.slow

#: This test's heartbeat timeout: long enough that a loaded machine's slow heartbeats through the fault
#: never look like a dead node; the fault ends well within it.
TIMEOUT_S = 4 * HEARTBEAT_TIMEOUT_S
#: The fault lasts until the agent has met this many 5xx answers (over HTTP), or at most FAILING_S.
ERRORS_WANTED = 3
FAILING_S = TIMEOUT_S / 2


class FaultyRelay:
    """Relays TCP to ``target``; while :attr:`failing`, answers every request with a 5xx instead."""

    STATUSES = itertools.cycle(
        [(500, "Internal Server Error"), (502, "Bad Gateway"), (504, "Gateway Timeout")]
    )

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.failing = threading.Event()
        self.errors_sent = 0
        self._error_sent = threading.Condition()
        #: Open connections the master switched to the agent stream (101): tunnels, never failed.
        self.tunnels = 0
        self.connections = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def fail_until(self, errors: int, at_most_s: float) -> None:
        """Answer 5xx to every request until ``errors`` answers were sent, or for ``at_most_s`` seconds.

        Counted, not timed: a loaded machine's agent sends fewer requests a second, and a fixed window
        would then test the machine's speed rather than the agent."""
        self.failing.set()
        with self._error_sent:
            self._error_sent.wait_for(lambda: self.errors_sent >= errors, timeout=at_most_s)
        self.failing.clear()

    def close(self) -> None:
        self._closed = True
        _close(self.listener)
        with self._lock:
            for sock in list(self._open):
                _close(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.failing.is_set():
            self._refuse(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open.update((client, upstream))
            self.connections += 1
        tunnel = threading.Event()
        threading.Thread(target=self._answers, args=(upstream, client, tunnel), daemon=True).start()
        self._forward(client, upstream, tunnel)
        with self._lock:
            self._open.difference_update((client, upstream))

    def _answers(self, upstream: socket.socket, client: socket.socket, tunnel: threading.Event) -> None:
        """Master to client; a ``101`` first answer makes the connection a tunnel."""
        first = True
        try:
            while data := upstream.recv(65536):
                if first and data.startswith(b"HTTP/1.1 101 "):
                    tunnel.set()
                    with self._lock:
                        self.tunnels += 1
                first = False
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)
            _close(client)
            if tunnel.is_set():
                with self._lock:
                    self.tunnels -= 1

    def _forward(self, client: socket.socket, upstream: socket.socket, tunnel: threading.Event) -> None:
        """Client to master, request by request (a request's bytes come in one read here: they are small)."""
        try:
            while data := client.recv(65536):
                if self.failing.is_set() and not tunnel.is_set():
                    self._answer_error(client)
                    break
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)

    def _refuse(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            if client.recv(65536):
                self._answer_error(client)
        except OSError:
            pass
        finally:
            _close(client)

    def _answer_error(self, client: socket.socket) -> None:
        try:
            status, reason = next(self.STATUSES)
            client.sendall(
                f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()
            )
            with self._error_sent:
                self.errors_sent += 1
                self._error_sent.notify_all()
        except OSError:
            pass


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["http", "stream"])
def test_an_agent_rides_through_500_502_504_without_restarting_its_workers(launch, tmp_path, transport):
    cluster = start_cluster(launch, tmp_path, "1:1", "--heartbeat-timeout", str(TIMEOUT_S))
    relay = FaultyRelay(cluster.address)
    try:
        agent = dataclasses.replace(cluster, address=relay.address).agent(
            "node-a",
            train_args(steps=60, step_time=0.1),
            env={"ELASTIC_MASTER_STREAM": "0"} if transport == "http" else None,
        )
        agent.wait_for(r"^\[rank0\]:step=10 loss", START_S)
        pids = agent.worker_pids()
        assert pids, "the worker runs"
        connections = relay.connections
        relay.fail_until(ERRORS_WANTED if transport == "http" else sys.maxsize, FAILING_S)
        if transport == "http":
            assert relay.errors_sent >= ERRORS_WANTED, f"the agent met only {relay.errors_sent} 5xx answers"
        else:  # one stream, opened before the fault and kept through it: nothing for the proxy to fail
            assert relay.tunnels == 1 and relay.connections == connections, (relay.tunnels, connections)
        wait_until(lambda: agent.worker_pids() == pids and _last_step(agent) >= 20, START_S, "steps after")
        assert_succeeded(agent)
    finally:
        relay.close()
    output = agent.output()
    steps = [int(s) for s in re.findall(STEP_LINE.format(world=1), output, re.M)]
    assert steps == list(range(1, 61)), "each step exactly once: no restart, nothing repeated or skipped"
    starts = START_LINE.findall(output)
    assert [start[2] for start in starts] == ["0"], f"one start of the worker, restart 0: {output[-3000:]}"
    assert "round 2" not in cluster.master.output(), "no new round: the node was never declared dead"


def _last_step(agent) -> int:
    steps = re.findall(r"^\[rank0\]:step=(\d+) loss", agent.output(), re.M)
    return int(steps[-1]) if steps else 0
