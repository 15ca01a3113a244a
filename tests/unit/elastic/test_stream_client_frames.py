"""The agent stream's client connection (elastic.control.stream_client) without a master: a socket pair whose
far end the test speaks frames on, so that the order of replies, late replies and a lost connection are the
test's
to choose. The real master's side of the same conversation: tests/integration/test_stream_client.py."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic.control.protocol import STREAM_MAX_FRAME_BYTES
from elastic.control.stream_client import (
    StreamConnection,
    StreamFrameTooLarge,
    StreamLost,
    StreamTimeout,
    encode_call,
    stream_wanted,
)
from elastic.control.stream_transport import _Plain

pytestmark = pytest.mark.timeout(30)


class Peer:
    """The far end: reads the client's frames, writes replies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rb")

    def frame(self) -> dict:
        line = self.file.readline()
        assert line.endswith(b"\n"), line
        return json.loads(line)

    def reply(self, call_id: int, status: int = 200, body: object = None) -> None:
        self.sock.sendall(json.dumps({"id": call_id, "status": status, "body": body}).encode() + b"\n")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def pair() -> Iterator[tuple[StreamConnection, Peer]]:
    before = set(threading.enumerate())
    mine, theirs = socket.socketpair()
    conn = StreamConnection("peer:1", _Plain(mine))
    peer = Peer(theirs)
    try:
        yield conn, peer
    finally:
        conn.close()
        peer.close()
    assert set(threading.enumerate()) <= before, "the reader thread is joined by close()"
    assert mine.fileno() == -1, "close() closes the socket"


def test_a_call_is_one_compact_json_line_with_its_id_op_secret_query_and_body():
    frame = encode_call(7, "watch", secret="s", query={"node_id": "a", "round": 2}, body_json=None)
    assert frame == b'{"id":7,"op":"watch","secret":"s","query":{"node_id":"a","round":2}}\n'
    frame = encode_call(8, "heartbeat", secret=None, query=None, body_json='{"node_id":"a"}')
    assert frame == b'{"id":8,"op":"heartbeat","body":{"node_id":"a"}}\n'
    with pytest.raises(ValueError, match="newline"):
        encode_call(9, "join", secret=None, query=None, body_json='{\n"node_id":"a"}')


def test_replies_reach_their_callers_whatever_their_order(pair):
    conn, peer = pair
    with ThreadPoolExecutor(2) as pool:
        watch = pool.submit(conn.call, "watch", timeout=10, query={"node_id": "a"})
        first = peer.frame()
        heartbeat = pool.submit(conn.call, "heartbeat", timeout=10, body_json='{"node_id":"a"}')
        second = peer.frame()
        assert {first["op"], second["op"]} == {"watch", "heartbeat"}
        ids = {first["op"]: first["id"], second["op"]: second["id"]}
        # The heartbeat is answered while the watch waits on the same connection.
        peer.reply(ids["heartbeat"], 200, {"command": "continue"})
        assert heartbeat.result(10) == (200, {"command": "continue"})
        assert not watch.done()
        peer.reply(ids["watch"], 404, {"error": "unknown_node", "message": "gone"})
        assert watch.result(10) == (404, {"error": "unknown_node", "message": "gone"})


def test_a_reply_after_its_call_timed_out_is_dropped_and_the_connection_serves_on(pair):
    conn, peer = pair
    with pytest.raises(StreamTimeout):
        conn.call("info", timeout=0.2)
    late = peer.frame()
    peer.reply(late["id"], 200, {"late": True})  # nobody waits for it any more
    with ThreadPoolExecutor(1) as pool:
        nxt = pool.submit(conn.call, "info", timeout=10)
        frame = peer.frame()
        assert frame["id"] != late["id"], "ids are never reused on a connection"
        peer.reply(frame["id"], 200, {"late": False})
        assert nxt.result(10) == (200, {"late": False})
    assert not conn.closed


def test_losing_the_connection_fails_every_pending_call_at_once(pair):
    conn, peer = pair
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(conn.call, op, timeout=60) for op in ("watch", "round", "heartbeat")]
        for _ in calls:
            peer.frame()
        peer.close()  # the master's end goes away
        for call in calls:
            with pytest.raises(StreamLost, match="ended"):
                call.result(10)  # far sooner than their 60 s
    assert conn.closed
    with pytest.raises(StreamLost):
        conn.call("info", timeout=10)  # and so does every later one: a lost connection is never reused


def test_close_fails_the_pending_calls_and_ends_the_reader(pair):
    conn, peer = pair
    with ThreadPoolExecutor(1) as pool:
        watch = pool.submit(conn.call, "watch", timeout=60)
        peer.frame()
        conn.close()
        with pytest.raises(StreamLost, match="closed by the client"):
            watch.result(10)
    assert peer.file.readline() == b"", "the peer sees the connection end"


def test_a_call_over_the_frame_limit_is_refused_before_anything_is_sent(pair):
    conn, peer = pair
    body = json.dumps({"message": "x" * STREAM_MAX_FRAME_BYTES})
    with pytest.raises(StreamFrameTooLarge):
        conn.call("heartbeat", timeout=10, body_json=body)
    with ThreadPoolExecutor(1) as pool:
        small = pool.submit(conn.call, "info", timeout=10)
        frame = peer.frame()
        assert frame["op"] == "info", "nothing of the large call reached the wire"
        peer.reply(frame["id"])
        assert small.result(10) == (200, None)


def test_a_line_that_breaks_the_protocol_ends_the_connection(pair):
    conn, peer = pair
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(conn.call, "info", timeout=60)
        peer.frame()
        peer.sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\n")  # e.g. a proxy writing into the stream
        with pytest.raises(StreamLost):
            call.result(10)
    assert conn.closed


def test_a_refused_frame_reported_with_id_0_leaves_the_pending_calls_waiting(pair):
    conn, peer = pair
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(conn.call, "info", timeout=10)
        frame = peer.frame()
        peer.reply(0, 422, {"error": "invalid_request", "message": "frame is not valid JSON"})
        peer.reply(frame["id"], 200, {"ok": 1})
        assert call.result(10) == (200, {"ok": 1})


@pytest.mark.parametrize(
    ("value", "wanted"),
    [(None, True), ("1", True), ("", True), ("0", False), ("false", False), ("OFF", False), ("no", False)],
)
def test_elastic_master_stream_0_turns_the_stream_off(value, wanted):
    environ = {} if value is None else {"ELASTIC_MASTER_STREAM": value}
    assert stream_wanted(environ) is wanted
