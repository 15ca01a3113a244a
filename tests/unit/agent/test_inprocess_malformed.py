"""Malformed input on the in-process control socket (elastic.inprocess.wire): the agent's real hub
(agent.executor.inprocess.InProcessHub) and the worker's real link (elastic.inprocess.link.AgentLink) over
Unix sockets answer a broken line with an ``error`` line and close that connection, log one line (no
traceback), and go on serving the others."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e import wait_until

from agent.executor.inprocess import InProcessHub
from elastic import contract
from elastic.inprocess import wire
from elastic.inprocess.link import AgentGone, AgentLink

pytestmark = pytest.mark.timeout(30)

WAIT_S = 10.0


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


#: What a confused or hostile worker may send the agent.
BROKEN_LINES = {
    "not-json": b"{hello",
    "not-utf8": b'{"op": "hello\xff"}',
    "nested-20000-deep": b'{"op": "hello", "x": ' + _deep(20_000) + b"}",
    "nested-past-the-limit": b'{"op": "broken", "error": "e", "x": ' + _deep(wire.MAX_DEPTH + 1) + b"}",
    "not-an-object": b'["hello"]',
    "unknown-op": b'{"op": "format_disk"}',
    "wrong-types": b'{"op": "hello", "local_rank": "0", "pid": [1]}',
    "missing-field": b'{"op": "paused", "round": 1}',
    "bool-for-int": b'{"op": "hello", "local_rank": true, "pid": 5}',
    "nan": b'{"op": "paused", "round": 1, "step": NaN}',
    "infinity": b'{"op": "paused", "round": 1, "step": Infinity}',
    "overflowing-number": b'{"op": "paused", "round": 1e999, "step": 1}',
    "huge-integer": b'{"op": "hello", "local_rank": ' + b"9" * 5000 + b", " + b'"pid": 5}',
    "agent-op-from-a-worker": b'{"op": "resume", "round": 1, "env": {}}',
}


@pytest.fixture
def hub() -> Iterator[InProcessHub]:
    with tempfile.TemporaryDirectory(prefix="hub-") as folder:
        h = InProcessHub(folder)
        yield h
        h.close()


@pytest.fixture
def thread_errors() -> Iterator[list[threading.ExceptHookArgs]]:
    """Exceptions that escape any thread during the test (a traceback in the log): none expected."""
    seen: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = seen.append
    try:
        yield seen
    finally:
        threading.excepthook = previous


def refusal(sock: socket.socket) -> dict:
    """The ``error`` line the other side answered, after which it closed the connection."""
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    lines = [line for line in data.split(b"\n") if line]
    assert len(lines) == 1, data
    return wire.decode(lines[0], wire.AGENT_OPS)


def connect_link(hub: InProcessHub, monkeypatch) -> AgentLink:
    monkeypatch.setenv(contract.INPROCESS_SOCKET, hub.path)
    monkeypatch.setenv(contract.LOCAL_RANK, "0")
    monkeypatch.delenv(contract.ELASTIC_LOCAL_RANK, raising=False)
    link = AgentLink.connect(0.05, lambda: None)
    assert link is not None
    return link


@pytest.mark.parametrize("name", sorted(BROKEN_LINES))
def test_a_broken_line_from_a_worker_is_refused_and_the_hub_serves_the_next_worker(
    hub: InProcessHub, monkeypatch, name: str, thread_errors, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(hub.path)
        # A good hello first: the bad line also ends that worker's registration.
        sock.sendall(wire.encode(wire.HELLO, local_rank=3, pid=4_000_000) + BROKEN_LINES[name] + b"\n")
        answer = refusal(sock)
    assert answer["op"] == wire.ERROR and answer["error"], answer
    wait_until(lambda: not hub.covers([4_000_000]), WAIT_S, "the broken worker to be dropped")

    link = connect_link(hub, monkeypatch)  # a well-formed worker is still served
    try:
        wait_until(lambda: hub.covers([os.getpid()]), WAIT_S, "the next worker's hello")
        assert hub.resume(os.getpid(), 2, {"RANK": "0"}) and link.wait_resume(WAIT_S)["round"] == 2
    finally:
        link.close()
    assert not thread_errors, "no exception escaped a hub thread"
    assert not [r for r in caplog.records if r.exc_info], "one line, no traceback"
    assert any("broke the protocol" in r.getMessage() for r in caplog.records)


def test_an_oversize_line_and_a_cut_line_are_refused_or_dropped(
    hub: InProcessHub, monkeypatch, thread_errors, caplog
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(hub.path)
        sent = 0
        try:
            while sent <= wire.MAX_LINE_BYTES + 65536:  # no newline, ever
                sent += sock.send(b"x" * 65536)
        except OSError:  # the hub closed the connection while this side still sent
            pass
        sock.shutdown(socket.SHUT_WR)
        assert refusal(sock)["error"].startswith("a line longer than")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(hub.path)
        sock.sendall(b'{"op": "hello", "local_ra')  # the worker died mid-line
    link = connect_link(hub, monkeypatch)
    try:
        wait_until(lambda: hub.covers([os.getpid()]), WAIT_S, "the next worker's hello")
    finally:
        link.close()
    assert not thread_errors and not [r for r in caplog.records if r.exc_info]


def test_a_broken_line_from_the_agent_ends_the_link_which_answers_why(
    tmp_path: Path, monkeypatch, thread_errors
) -> None:
    """The worker's side: an agent line it cannot read ends its link (AgentGone for the waiting loop: it
    falls back to a process restart) after it answered ``error``; nothing escapes its reader thread."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    monkeypatch.setenv(contract.INPROCESS_SOCKET, str(path))
    link = AgentLink.connect(0.05, lambda: None)
    assert link is not None
    conn, _ = server.accept()
    try:
        conn.settimeout(WAIT_S)
        reader = wire.LineReader(conn, wire.WORKER_OPS)
        assert wire.HELLO in [m["op"] for m in reader.read() or []]
        conn.sendall(b'{"op": "resume", "round": 2, "env": {"RANK": NaN}}\n')
        with pytest.raises(AgentGone):
            link.wait_resume(WAIT_S)
        answer = reader.read()
        assert answer and answer[0]["op"] == wire.ERROR and "NaN" in answer[0]["error"], answer
    finally:
        link.close()
        conn.close()
        server.close()
    assert not thread_errors
