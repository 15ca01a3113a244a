"""elastic.inprocess.wire: one JSON message per line, split however the stream delivers it."""

from __future__ import annotations

import socket

import pytest

from elastic.inprocess import wire


def test_messages_split_across_chunks_are_read_whole_and_in_order() -> None:
    a, b = socket.socketpair()
    data = wire.encode(wire.HELLO, local_rank=1, pid=42) + wire.encode(wire.PAUSED, round=3, step=9)
    a.sendall(data[:7])
    reader = wire.LineReader(b, wire.WORKER_OPS)
    assert reader.read() == []
    a.sendall(data[7:])
    assert reader.read() == [
        {"op": "hello", "local_rank": 1, "pid": 42},
        {"op": "paused", "round": 3, "step": 9},
    ]
    a.close()
    assert reader.read() is None, "end of stream"
    b.close()


@pytest.mark.parametrize("line", [b"not json", b'{"op": "resume"}', b"[1, 2]"])
def test_a_line_that_is_no_message_of_the_side_is_an_error(line: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(line, wire.WORKER_OPS)
