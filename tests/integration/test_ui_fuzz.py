"""The status page (``/ui``) against hostile input (docs/security.md, "Slow and hostile clients"): a short
run of the wire fuzzer (bench/fuzz_wire.py: login posts of every shape, forged cookies, odd paths and
methods, against a real ``elastic-master`` process, with a node heartbeating on its own stream throughout),
and what it found, each on a real master over a raw socket."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from embedded_masters import no_thread_left

from bench import common as c
from bench.fuzz_wire import WireConfig, run_wire_fuzz
from elastic.control.job_settings import JobSettings
from master.http.serving import EmbeddedMaster
from master.http.ui import SESSION_COOKIE
from master.service.settings import ServerSettings

TOKEN = "ui-fuzz-token-0123456789"
CASES = 300


@pytest.fixture
def master() -> Iterator[EmbeddedMaster]:
    with no_thread_left():
        job = JobSettings(job_id="job-ui-fuzz", min_nodes=1, max_nodes=1)
        started = EmbeddedMaster(ServerSettings(job=job, token=TOKEN, host="127.0.0.1", port=0)).start()
        try:
            yield started
        finally:
            started.stop()


def ask(master: EmbeddedMaster, request: bytes) -> bytes:
    """Send a whole request (``Connection: close``); everything the master answered."""
    with socket.create_connection((master.host, master.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "value",
    [
        b"1700000000.deadbeef\xff\xfe",  # bytes past ASCII in the signature: hmac refused to compare them
        b"\xb2\xb3.abc",  # superscript digits (latin-1): str.isdigit() says yes, int() says no
        b"9" * 5000 + b".abc",  # more digits than int() converts
    ],
    ids=["non-ascii-mac", "superscript-expiry", "5000-digit-expiry"],
)
def test_a_forged_session_cookie_of_any_bytes_is_no_session_not_a_500(
    master: EmbeddedMaster, value: bytes, caplog
) -> None:
    """Found by bench/fuzz_wire.py: such a cookie made ``/ui`` and ``/ui/status`` answer 500 with a
    traceback in the master's log. It is no session: the page redirects to the form, its data is 401."""
    caplog.set_level(logging.ERROR)
    cookie = b"Cookie: " + SESSION_COOKIE.encode() + b"=" + value + b"\r\n"
    for path, status in ((b"/ui", b"303"), (b"/ui/status", b"401")):
        answer = ask(
            master, b"GET " + path + b" HTTP/1.1\r\nHost: m\r\nConnection: close\r\n" + cookie + b"\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:300]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.timeout(240)
def test_fuzzing_the_status_page_finds_no_5xx_no_traceback_and_no_change(tmp_path: Path) -> None:
    tally = run_wire_fuzz(WireConfig(cases=CASES, seed=11, surfaces=("ui",)), tmp_path)
    assert (tally.server_errors, dict(tally.failures)) == (0, {}), "\n".join(tally.examples)
    assert sum(tally.cases.values()) == CASES and tally.sentinel_beats >= CASES and tally.state_checks >= 1
    # every kind of login post was tried, and the address's wrong tokens reached the 429
    assert {k for k in tally.cases if k.startswith("login_")} >= {"login_oversize", "login_no_csrf"}
    assert any(429 in statuses for statuses in tally.statuses.values()), dict(tally.statuses)
    assert not c.tagged_processes(), "the fuzz left a master running"
