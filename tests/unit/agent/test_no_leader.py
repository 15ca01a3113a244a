"""Masters that answer only ``503 not_leader`` are standbys, not absent ones: the client says what each
address answered (elastic.control.client.NoLeaderError), the agent says once that every master stands by
(agent.executor.master_link), ``--master-timeout`` still ends the wait when none leads for that long, and
the final line names each address's answer. The client talks to real sockets: two tiny HTTP servers that
answer as a standby master does, and a port where nothing listens."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from master_link_fakes import MASTER_TIMEOUT, FakeClient, FakeClock, link_for, thread_policy

from agent.executor.master_link import CallFailed
from agent.machine import events as ev
from elastic.control.client import MasterClient, NoLeaderError
from elastic.control.error_table import ErrorCode

pytestmark = pytest.mark.timeout(20)


class Standby(BaseHTTPRequestHandler):
    """What a standby master answers every call (master.http.errors: 503 with an ErrorBody)."""

    def do_GET(self) -> None:
        body = json.dumps({"error": ErrorCode.NOT_LEADER.value, "message": "master x is a standby"}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def standbys() -> Iterator[list[str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Standby) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(5)


def closed_port() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Standby)
    address = f"127.0.0.1:{server.server_address[1]}"
    server.server_close()  # nothing listens there now: connection refused
    return address


def test_every_master_a_standby_is_not_an_absent_master(standbys: list[str]) -> None:
    client = MasterClient(standbys, "j", "t" * 16, stream=False, request_timeout=2.0)
    try:
        with pytest.raises(NoLeaderError) as raised:
            client.info()
    finally:
        client.close()
    assert raised.value.answers == {a: "503 not_leader" for a in standbys}
    assert raised.value.only_standbys
    first, second = standbys
    assert str(raised.value) == f"no job master leads: {first}: 503 not_leader; {second}: 503 not_leader"


def test_a_missing_master_is_named_with_what_it_did_not_answer(standbys: list[str]) -> None:
    gone = closed_port()
    client = MasterClient([gone, standbys[0]], "j", "t" * 16, stream=False, request_timeout=2.0)
    try:
        with pytest.raises(NoLeaderError) as raised:
            client.info()
    finally:
        client.close()
    assert raised.value.answers == {gone: "no answer (ConnectError)", standbys[0]: "503 not_leader"}
    assert not raised.value.only_standbys


STANDBYS = NoLeaderError({"m:1": "503 not_leader", "m:2": "503 not_leader"})


def test_the_agent_says_once_that_every_master_stands_by(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(close_after=6)
    link, posted = link_for(FakeClient(STANDBYS), clock)
    with caplog.at_level(logging.WARNING, logger="agent.executor.master_link"):
        link.poll(link.client.next, thread_policy(), lambda reply: reply)
    said = [r.getMessage() for r in caplog.records if "503 not_leader" in r.getMessage()]
    assert len(said) == 1 and "none leads yet" in said[0] and "m:1, m:2" in said[0]
    unreachable = [e for e in posted if isinstance(e, ev.MasterUnreachable)]
    assert unreachable and "last answers: m:1: 503 not_leader; m:2: 503 not_leader" in unreachable[-1].message


def test_the_master_timeout_still_ends_a_wait_on_standbys_and_names_each_answer() -> None:
    clock = FakeClock()
    link, _ = link_for(FakeClient(STANDBYS), clock)
    with pytest.raises(CallFailed) as failed:
        link.call(link.client.next, "join")
    event = failed.value.event
    assert isinstance(event, ev.MasterUnreachable) and event.silent_s > MASTER_TIMEOUT
    assert "m:1: 503 not_leader; m:2: 503 not_leader" in event.message
