"""The master's front door against descriptor exhaustion (master.http.conn_guard, master.http.rate_limits):
the pure limiters with a fake clock, then a real ``EmbeddedMaster`` on 127.0.0.1 over raw sockets: the
first-request timeout, a request in flight that outlives it, the connection cap, and the per-address 429 after
repeated
wrong tokens that never touches a valid token."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import socket
import time
from collections.abc import Iterator

import e2e
import httpx
import pytest
from certs import LOCAL_NAMES, CertAuthority
from embedded_masters import no_thread_left

from elastic.control.error_table import Disposition, ErrorCode, disposition
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import JOB_HEADER, NODE_SECRET_HEADER
from master.http.conn_guard import ResourceLogFilter, connection_cap, fleet_warning
from master.http.rate_limits import FAILURE_LIMIT, FAILURE_WINDOW_S, LogLimiter, PeerFailureLimiter
from master.http.serving import EmbeddedMaster
from master.service.settings import ServerSettings

TOKEN = "guard-token-0123456789"
JOB_ID = "job-guard"
AUTH = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: JOB_ID}
HEADER_TIMEOUT_S = 0.5
JOIN_A = dict(node_id="a", host="127.0.0.1", nproc=1, store_port=29501, min_nodes=2, max_nodes=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- pure parts ----------------------------------------------------------------------------------------
def test_an_address_is_blocked_after_the_limit_of_wrong_tokens_within_the_window_and_free_after() -> None:
    clock = FakeClock()
    limiter = PeerFailureLimiter(limit=3, window_s=10.0, clock=clock)
    for _ in range(2):
        limiter.record_failure("10.0.0.1")
    assert not limiter.blocked("10.0.0.1")
    limiter.record_failure("10.0.0.1")
    assert limiter.blocked("10.0.0.1")
    assert not limiter.blocked("10.0.0.2")  # per address
    clock.now += 10.0  # the window slid past every failure
    assert not limiter.blocked("10.0.0.1")


def test_failures_spread_wider_than_the_window_never_block() -> None:
    clock = FakeClock()
    limiter = PeerFailureLimiter(limit=3, window_s=10.0, clock=clock)
    for _ in range(10):
        limiter.record_failure("10.0.0.1")
        assert not limiter.blocked("10.0.0.1")
        clock.now += 5.0  # two per window at most


def test_the_limiter_tracks_a_bounded_number_of_addresses() -> None:
    limiter = PeerFailureLimiter(limit=1, window_s=10.0, clock=FakeClock(), max_peers=2)
    for peer in ("a", "b", "c"):
        limiter.record_failure(peer)
    assert not limiter.blocked("a")  # forgotten: the least recently failing
    assert limiter.blocked("b") and limiter.blocked("c")


def test_the_log_limiter_admits_one_line_per_interval_with_the_count_it_suppressed() -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=30.0, clock=clock)
    assert limiter.admit() == 0
    assert [limiter.admit() for _ in range(5)] == [None] * 5
    clock.now += 29.9
    assert limiter.admit() is None
    clock.now += 0.1
    assert limiter.admit() == 6
    assert limiter.admit() is None


def test_the_log_filter_passes_one_descriptor_error_per_interval_without_its_traceback() -> None:
    clock = FakeClock()
    log_filter = ResourceLogFilter(LogLimiter(interval_s=30.0, clock=clock))

    def record(exc: BaseException | None) -> logging.LogRecord:
        exc_info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "accept failed", None, exc_info)

    emfile = OSError(errno.EMFILE, "Too many open files")
    first = record(emfile)
    assert log_filter.filter(first) and first.exc_info is None
    assert "Too many open files" in first.getMessage()
    assert not any(log_filter.filter(record(emfile)) for _ in range(100))
    assert log_filter.filter(record(OSError(errno.ECONNRESET, "reset")))  # other errors pass
    assert log_filter.filter(record(None))
    clock.now += 30.0
    later = record(emfile)
    assert log_filter.filter(later)
    assert "100 more" in later.getMessage()


def test_the_cap_leaves_descriptors_for_the_master_itself() -> None:
    assert connection_cap(1024) == 1024 - 64 - 4 * 32  # the reserve, and four accept batches of 1/32
    assert connection_cap(1 << 20) == (1 << 20) - 64 - 4 * 2048
    assert connection_cap(20) == 16


def test_a_fleet_larger_than_the_descriptors_allow_is_named_at_start() -> None:
    cap = connection_cap(20000)  # 17436 connections: one per agent
    assert fleet_warning(cap, 2, 17436) is None
    grows = fleet_warning(cap, 2, 20000)
    assert grows is not None and "nodes beyond 17436 are refused" in grows and "ulimit -n" in grows
    never = fleet_warning(cap, 20000, 20000)
    assert never is not None and "the job cannot form" in never


def test_busy_and_a_repeated_wrong_token_are_in_the_error_table() -> None:
    assert disposition(503, ErrorCode.BUSY) is Disposition.RETRY
    assert disposition(429, ErrorCode.UNAUTHORIZED) is Disposition.FINAL  # retrying cannot fix the token


# -- a real master -------------------------------------------------------------------------------------
@pytest.fixture
def start_master() -> Iterator:
    masters: list[EmbeddedMaster] = []

    def start(**settings) -> EmbeddedMaster:
        job = JobSettings(job_id=JOB_ID, min_nodes=2, max_nodes=2)
        values = dict(header_timeout_s=HEADER_TIMEOUT_S) | settings
        master = EmbeddedMaster(ServerSettings(job=job, token=TOKEN, host="127.0.0.1", port=0, **values))
        masters.append(master.start())
        return master

    with no_thread_left():
        yield start
        for master in masters:
            master.stop()


def connect(master: EmbeddedMaster) -> socket.socket:
    return socket.create_connection((master.host, master.port), timeout=10)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout`` (EOF or a reset), reading whatever it sent."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def request(path: str, headers: dict[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"GET {path} HTTP/1.1\r\nHost: master\r\n{lines}\r\n".encode()


@pytest.mark.timeout(60)
def test_a_connection_that_sends_no_request_is_closed_after_the_header_timeout(start_master) -> None:
    master = start_master()
    with connect(master) as idle, connect(master) as partial:
        partial.sendall(b"GET /v1/status HTTP/1.1\r\nHost: ma")  # an incomplete head counts as none
        start = time.monotonic()
        assert closed_by_peer(idle, HEADER_TIMEOUT_S + 10)
        assert closed_by_peer(partial, HEADER_TIMEOUT_S + 10)
        assert time.monotonic() - start >= HEADER_TIMEOUT_S * 0.9
    metrics = httpx.get(f"http://{master.address}/metrics", headers=AUTH, timeout=10).text
    assert f'elastic_master_connections_closed_total{{job_id="{JOB_ID}",reason="timed_out"}} 2.0' in metrics
    assert f'elastic_master_connections{{job_id="{JOB_ID}"}} 1.0' in metrics  # this scrape's own


def read_reply(sock: socket.socket, timeout: float) -> bytes:
    """One whole HTTP reply (head and ``content-length`` body): a reply may arrive in several segments."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.timeout(60)
def test_a_long_poll_in_flight_is_not_cut_by_the_deadlines(start_master) -> None:
    """A request whose head and body arrived is in flight: a long-poll waits well past the header timeout
    and is answered on the same connection."""
    master = start_master()
    with httpx.Client(base_url=f"http://{master.address}", headers=AUTH, timeout=30) as client:
        joined = client.post("/v1/join", json=JOIN_A)
        assert joined.status_code == 200, joined.text
        secret = {NODE_SECRET_HEADER: joined.json()["node_secret"]}
        wait_s = HEADER_TIMEOUT_S * 4  # a second node never comes: the poll waits its whole timeout
        query = {"node_id": "a", "after": 0, "timeout": wait_s}
        polled = client.get("/v1/round", params=query, headers=secret)
    assert polled.status_code == 200, polled.text


def post_head(path: str, headers: dict[str, str], length: int, kind: str = "application/json") -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: master\r\ncontent-type: {kind}\r\n{lines}"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def timed_out_count(master: EmbeddedMaster) -> float:
    metrics = httpx.get(f"http://{master.address}/metrics", headers=AUTH, timeout=10).text
    prefix = f'elastic_master_connections_closed_total{{job_id="{JOB_ID}",reason="timed_out"}} '
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/v1/nodes/a/readmit", "/ui/login"])
def test_a_trickled_body_is_closed_at_its_deadline(start_master, path: str, caplog) -> None:
    """A body that does not arrive within the header timeout of its head closes the connection, with a
    valid token (``/v1``) or none (the login form); before, a trickled body held it forever. The app that
    was reading it logs no error (a client gone is no failure of the master)."""
    caplog.set_level(logging.DEBUG, logger="master.http.connection")
    master = start_master()
    with connect(master) as sock:
        kind = "application/json" if path.startswith("/v1") else "application/x-www-form-urlencoded"
        sock.sendall(post_head(path, AUTH, 4096, kind) + b"{")
        for _ in range(3):  # a byte now and then: each arrives, the body never completes
            assert not closed_by_peer(sock, HEADER_TIMEOUT_S / 4)
            sock.sendall(b" ")
        assert closed_by_peer(sock, 10)
    assert timed_out_count(master) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("path", "status"),
    [("/openapi.json", 200), ("/ui/login", 200), ("/no-such-page", 404), ("/metrics", 401)],
)
def test_one_byte_of_a_next_head_after_a_request_outside_v1_is_closed_at_its_deadline(
    start_master, path: str, status: int
) -> None:
    """The slowloris of the issue: one unauthenticated request outside ``/v1`` keeps the connection alive,
    then one byte of a next request head held it until the keep-alive timeout (minutes), or forever when
    trickled. Now the next head has the header timeout from its first byte."""
    master = start_master(header_timeout_s=1.0)
    with connect(master) as sock:
        sock.sendall(request(path, {}))
        reply = read_reply(sock, 10)
        assert reply.startswith(f"HTTP/1.1 {status}".encode()), reply[:200]
        assert b"connection: close" not in reply.lower()  # kept alive: the case at hand
        sock.sendall(b"G")
        assert closed_by_peer(sock, 10)


@pytest.mark.timeout(60)
def test_an_unauthenticated_connection_that_sent_requests_is_evicted_before_an_authenticated_one(
    start_master,
) -> None:
    """At the cap the oldest connection without a valid token makes room, even one that sent requests
    (outside ``/v1``); connections that presented the token are never evicted."""
    master = start_master(max_connections=3, header_timeout_s=30.0)
    agent, browser = connect(master), connect(master)
    try:
        agent.sendall(request("/v1/status", AUTH))
        assert read_reply(agent, 10).startswith(b"HTTP/1.1 200")
        browser.sendall(request("/openapi.json", {}))
        assert read_reply(browser, 10).startswith(b"HTTP/1.1 200")
        with connect(master) as third, connect(master) as fourth:
            third.sendall(request("/v1/status", AUTH))
            assert read_reply(third, 10).startswith(b"HTTP/1.1 200")
            assert closed_by_peer(browser, 10)  # the fourth's room
            fourth.sendall(request("/v1/status", AUTH))
            assert read_reply(fourth, 10).startswith(b"HTTP/1.1 200")
            agent.sendall(request("/v1/status", AUTH))  # the agent's connection is still served
            assert read_reply(agent, 10).startswith(b"HTTP/1.1 200")
    finally:
        agent.close()
        browser.close()


def connect_from(master: EmbeddedMaster, source: str) -> socket.socket:
    return socket.create_connection((master.host, master.port), timeout=10, source_address=(source, 0))


@pytest.mark.timeout(60)
def test_unauthenticated_connections_are_capped_per_address_authenticated_ones_never(start_master) -> None:
    """Beyond ``unauthenticated_per_address`` connections without a token from one address, the next is
    answered 503 busy; an authenticated agent's connections (more than the cap, from the same address) are
    never counted and keep being answered; another address is not affected."""
    cap = 4
    master = start_master(unauthenticated_per_address=cap, header_timeout_s=30.0)
    agents: list[socket.socket] = []
    slow: list[socket.socket] = []
    try:
        for _ in range(cap + 2):  # each authenticated in turn: then no longer counted against 127.0.0.1
            agents.append(connect(master))
            agents[-1].sendall(request("/v1/status", AUTH))
            assert read_reply(agents[-1], 10).startswith(b"HTTP/1.1 200")
        slow = [connect(master) for _ in range(cap)]
        for sock in slow:
            sock.sendall(b"GET / HTTP/1.1\r\nHo")  # a slowloris' start
        with connect(master) as one_more:
            reply = read_reply(one_more, 10)
        assert reply.startswith(b"HTTP/1.1 503") and b'"busy"' in reply, reply
        assert b"--max-unauthenticated-per-address" in reply
        for agent in agents:
            agent.sendall(request("/v1/status", AUTH))
            assert read_reply(agent, 10).startswith(b"HTTP/1.1 200")
        with connect_from(master, "127.0.0.2") as elsewhere:
            elsewhere.sendall(request("/v1/status", AUTH))
            assert read_reply(elsewhere, 10).startswith(b"HTTP/1.1 200")
        slow.pop().close()  # one closes: its address has room again
        with connect(master) as again:
            again.sendall(request("/v1/status", AUTH))
            assert read_reply(again, 10).startswith(b"HTTP/1.1 200")
    finally:
        for sock in agents + slow:
            sock.close()


@pytest.mark.timeout(60)
def test_wrong_tokens_on_metrics_and_the_login_form_share_the_v1_limit(start_master) -> None:
    """``/metrics`` and ``/ui/login`` count wrong tokens with ``/v1``: after 20 from one address, each
    answers 429 (before, both allowed any number of guesses); a valid token is never limited."""
    master = start_master()
    base = f"http://{master.address}"
    wrong = {"Authorization": "Bearer " + "w" * 20, JOB_HEADER: JOB_ID}
    with httpx.Client(base_url=base, timeout=10) as browser:
        assert browser.get("/ui/login").status_code == 200

        def login(token: str) -> httpx.Response:  # each answer sets a new CSRF value
            form = {"token": token, "csrf": browser.cookies["elastic_ui_csrf"]}
            return browser.post("/ui/login", data=form)

        codes = [login("w" * 20).status_code for _ in range(20)]
        assert codes == [401] * 20, codes
        limited = login("w" * 20)
        assert limited.status_code == 429 and "Too many wrong tokens" in limited.text
        assert limited.headers["retry-after"]
        assert httpx.get(f"{base}/metrics", headers=wrong, timeout=10).status_code == 429  # shared count
        assert httpx.get(f"{base}/v1/status", headers=wrong, timeout=10).status_code == 429
        assert login(TOKEN).status_code == 303  # the right token: signed in
    assert httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_twenty_wrong_tokens_on_metrics_answer_429(start_master) -> None:
    master = start_master()
    url = f"http://{master.address}/metrics"
    wrong = {"Authorization": "Bearer " + "w" * 20}
    codes = [httpx.get(url, headers=wrong, timeout=10).status_code for _ in range(21)]
    assert codes == [401] * 20 + [429], codes
    assert httpx.get(url, headers=AUTH, timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_beyond_the_cap_the_oldest_idle_connection_makes_room_and_busy_ones_get_503(start_master) -> None:
    master = start_master(max_connections=2, header_timeout_s=30.0)
    first = connect(master)
    second = connect(master)
    first.sendall(request("/v1/status", AUTH))
    first.settimeout(10)
    assert first.recv(4096).startswith(b"HTTP/1.1 200")  # served, then held open (keep-alive): busy
    with connect(master) as third:  # the cap: second, which sent nothing, is closed for it
        assert closed_by_peer(second, 10)
        third.sendall(request("/v1/status", AUTH))
        third.settimeout(10)
        assert third.recv(4096).startswith(b"HTTP/1.1 200")
        with connect(master) as fourth:  # every connection has had a request: no room
            reply = read_reply(fourth, 10)
            assert reply.startswith(b"HTTP/1.1 503") and b'"busy"' in reply
    first.close()
    second.close()


@pytest.mark.timeout(60)
def test_repeated_wrong_tokens_from_an_address_get_429_but_a_valid_token_is_never_limited(
    start_master,
) -> None:
    master = start_master()
    wrong = {"Authorization": "Bearer nope", JOB_HEADER: JOB_ID}
    base = f"http://{master.address}"
    started = time.monotonic()
    statuses = [httpx.get(f"{base}/v1/status", headers=wrong, timeout=10) for _ in range(FAILURE_LIMIT)]
    within_window = time.monotonic() - started < FAILURE_WINDOW_S
    statuses += [httpx.get(f"{base}/v1/status", headers=wrong, timeout=10) for _ in range(5)]
    codes = [r.status_code for r in statuses]
    assert codes[:FAILURE_LIMIT] == [401] * FAILURE_LIMIT, codes
    # The limit counts within a sliding window: on a machine too busy to send them all within it, the
    # earliest have expired (the rule itself is checked on a fake clock in tests/unit).
    if within_window:
        assert codes[FAILURE_LIMIT:] == [429] * 5, codes
    assert statuses[-1].json()["error"] == "unauthorized"
    assert all(r.headers["connection"] == "close" for r in statuses)
    assert httpx.get(f"{base}/v1/status", headers=AUTH, timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_under_tls_a_connection_that_never_shakes_hands_is_closed_after_the_header_timeout(
    start_master, tmp_path
) -> None:
    """A TLS connection still in its handshake has no HTTP protocol yet: the handshake gets the same time."""
    cert, key = CertAuthority.create("guard CA").issue_files(
        tmp_path, "server", "elastic-master", LOCAL_NAMES
    )
    master = start_master(tls_cert=str(cert), tls_key=str(key))
    with connect(master) as silent:
        assert closed_by_peer(silent, HEADER_TIMEOUT_S + 10)


@pytest.mark.timeout(60)
def test_a_closed_connection_is_freed_without_the_cyclic_collector(start_master) -> None:
    """The daemon collects cyclic garbage every 10 minutes only (master.service.gc_pacing): a closed
    connection must be freed by reference counting, or a flood of short-lived connections piles up in
    memory (before, its exchange and its scope's authentication callback held it in cycles)."""
    from master.http.connection import HttpConnection

    def live() -> int:
        return sum(isinstance(o, HttpConnection) for o in gc.get_objects())

    master = start_master(header_timeout_s=30.0)
    gc.collect()
    gc.disable()
    try:
        before = live()
        for _ in range(20):
            with connect(master) as sock:
                sock.sendall(request("/v1/status", AUTH))
                assert read_reply(sock, 10).startswith(b"HTTP/1.1 200")
        guard = master._server.guard  # noqa: SLF001 - the test reads the server's count of connections
        e2e.wait_until(lambda: not guard.connections, 10, "the master saw every connection close")
        assert live() - before <= 1, live() - before  # at most one whose close is still being processed
    finally:
        gc.enable()


@pytest.mark.timeout(60)
def test_closed_refused_and_timed_out_connections_and_their_transports_are_freed_without_the_collector(
    start_master,
) -> None:
    """Every kind of short connection of a flood (answered, answered 404 then idle, refused 503 at its
    address's cap, closed at its deadline) is freed by reference counting, its asyncio transport too. Before,
    each transport kept itself alive through its own read callback (CPython gh-100348, until Python 3.12):
    ~2.5 KiB per connection waited for the daemon's 10-minute full collection, most of the +178 MiB a
    20,000-connection flood over 16 addresses cost (bench/slow_clients.py)."""
    from master.http.connection import HttpConnection

    def live() -> tuple[int, int]:
        objects = gc.get_objects()
        return (
            sum(isinstance(o, HttpConnection) for o in objects),
            sum(isinstance(o, asyncio.Transport) for o in objects),
        )

    master = start_master(header_timeout_s=HEADER_TIMEOUT_S, unauthenticated_per_address=2)
    guard = master._server.guard  # noqa: SLF001 - the test reads the server's count of connections
    gc.collect()
    gc.disable()
    try:
        before = live()
        for _ in range(10):
            with connect(master) as agent:
                agent.sendall(request("/v1/status", AUTH))
                assert read_reply(agent, 10).startswith(b"HTTP/1.1 200")
            with connect(master) as browser, connect(master) as idle, connect(master) as refused:
                assert read_reply(refused, 10).startswith(b"HTTP/1.1 503")  # the address's third
                browser.sendall(request("/no-such-page", {}))
                assert read_reply(browser, 10).startswith(b"HTTP/1.1 404")
                browser.sendall(b"G")  # one byte of a next head: closed at its deadline
                assert closed_by_peer(idle, 10) and closed_by_peer(browser, 10)
        e2e.wait_until(lambda: not guard.connections, 10, "the master saw every connection close")
        after = live()
        # at most one of each whose close is still being processed
        assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
    finally:
        gc.enable()


@pytest.mark.timeout(60)
def test_unauthenticated_connections_are_capped_in_all_whatever_their_addresses(start_master) -> None:
    """``max_unauthenticated`` bounds the connections without a token from all addresses together: one
    more closes the oldest of them (before, each address could hold ``unauthenticated_per_address``, so
    a flood's cost grew with its addresses: 16 of them held 4,096 connections). Connections that presented
    the token are never counted nor closed, and the newcomer is served."""
    cap = 3
    master = start_master(max_unauthenticated=cap, header_timeout_s=30.0)
    agents: list[socket.socket] = []
    slow: list[socket.socket] = []
    try:
        for i in range(cap + 1):  # each authenticated in turn: then no longer counted
            agents.append(connect_from(master, f"127.0.0.{i + 2}"))
            agents[-1].sendall(request("/v1/status", AUTH))
            assert read_reply(agents[-1], 10).startswith(b"HTTP/1.1 200")
        for i in range(cap):  # one slowloris per address: no address is at its own cap
            slow.append(connect_from(master, f"127.0.0.{i + 2}"))
            slow[-1].sendall(b"GET / HTTP/1.1\r\nHo")
        guard = master._server.guard  # noqa: SLF001 - the test reads the server's count of connections
        e2e.wait_until(lambda: guard.unauthenticated == cap, 10, "the slow connections admitted")
        with connect_from(master, "127.0.0.9") as newcomer:
            assert closed_by_peer(slow[0], 10)  # the oldest made room
            newcomer.sendall(request("/v1/status", AUTH))
            assert read_reply(newcomer, 10).startswith(b"HTTP/1.1 200")
        assert not any(closed_by_peer(sock, 0.2) for sock in slow[1:])  # the others are still open
        for agent in agents:
            agent.sendall(request("/v1/status", AUTH))
            assert read_reply(agent, 10).startswith(b"HTTP/1.1 200")
        metrics = httpx.get(f"http://{master.address}/metrics", headers=AUTH, timeout=10).text
        assert f'elastic_master_connections_closed_total{{job_id="{JOB_ID}",reason="evicted"}} 1.0' in metrics
    finally:
        for sock in agents + slow:
            sock.close()
