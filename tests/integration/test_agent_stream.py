"""The agent stream, master side (master/http/stream.py; docs/protocol.md, "The agent stream"), with a real
``EmbeddedMaster`` (the master in a thread) on 127.0.0.1 and the stream spoken from raw sockets
(tests/support/stream_socket.py): the upgrade and its refusals (the gate's 401/429/409, 503 from a
standby on a real etcd, no upgrade elsewhere than /v1/stream), every call answering as its HTTP route
does (a scenario played on twin masters, one over HTTP and one over the stream), multiplexing with
out-of-order replies, the frame limits, a closed stream as a closed long-poll, TLS, and the connection
guard's count."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from certs import LOCAL_NAMES, CertAuthority
from e2e import unique_job, wait_until
from embedded_masters import EmbeddedMasters, no_thread_left
from stream_socket import StreamSocket, upgrade_request

from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STREAM_MAX_FRAME_BYTES,
    STREAM_MAX_PENDING,
    STREAM_ROUTES,
)
from master.http.rate_limits import FAILURE_LIMIT
from master.http.serving import EmbeddedMaster

pytestmark = pytest.mark.timeout(60)

TOKEN = "stream-test-token-0123"
JOB_ID = "job-stream"
AUTH = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: JOB_ID}
#: A long-poll that must stay pending asks for this long; one that must wake returns well before it.
LONG_POLL_S = 20.0


def join_body(node_id: str, **overrides: Any) -> dict[str, Any]:
    return dict(node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=2, max_nodes=2) | (
        overrides
    )


def beat_body(node_id: str, round_: int = 0, state: str = "waiting", **fields: Any) -> dict[str, Any]:
    return dict(node_id=node_id, round=round_, state=state, **fields)


class Masters(EmbeddedMasters):
    """Starts masters for one test and opens streams and HTTP clients to them; :meth:`close` undoes it."""

    token = TOKEN
    job_id = JOB_ID

    def stream(
        self,
        master: EmbeddedMaster,
        token: str | None = TOKEN,
        job_id: str | None = JOB_ID,
        first: bytes = b"",
        tls: ssl.SSLContext | None = None,
        **request: Any,
    ) -> StreamSocket:
        """A stream to ``master`` (or its refusal: see ``.answer``)."""
        request_bytes = upgrade_request(token, job_id, **request)
        return self.keep(StreamSocket.open((master.host, master.port), request_bytes, first, tls=tls))


@pytest.fixture
def masters() -> Iterator[Masters]:
    with no_thread_left(), Masters() as helper:
        yield helper


def opened(stream: StreamSocket) -> StreamSocket:
    assert stream.answer is not None and stream.answer.status == 101, stream.answer
    assert stream.answer.headers["upgrade"] == "elastic-stream/1"
    assert stream.answer.headers["connection"].lower() == "upgrade"
    return stream


# -- the upgrade -----------------------------------------------------------------------------------------
def test_the_upgrade_switches_to_frames_and_serves_frames_sent_with_the_request(masters: Masters):
    """A client may send its first calls right behind the upgrade request (in the same packet): the
    master serves what its HTTP parser had read past the request."""
    master = masters.start()
    first = (
        b'{"id": 1, "op": "info"}\n{"id": 2, "op": "join", "body": %s}\n'
        % json.dumps(join_body("a")).encode()
    )
    stream = opened(masters.stream(master, first=first))
    replies = {r["id"]: r for r in (stream.reply(), stream.reply())}
    assert replies[1]["status"] == 200 and replies[1]["body"]["job_id"] == JOB_ID
    assert replies[2]["status"] == 200 and replies[2]["body"]["round"] == 1
    assert [n.node_id for n in master.service.job.nodes.values()] == ["a"]


def test_a_wrong_token_is_refused_401_and_429_once_repeated_counted_with_http(masters: Masters):
    """The gate's rule: 401 with the bearer challenge, the connection closed; wrong tokens from one
    address, over HTTP and the stream alike, count towards the 429; a valid token is never limited."""
    master = masters.start()
    http = masters.http(master)
    for _ in range(FAILURE_LIMIT // 2):
        assert http.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    for _ in range(FAILURE_LIMIT - FAILURE_LIMIT // 2):
        refused = masters.stream(master, token="nope")
        assert refused.answer.status == 401, refused.answer
        assert refused.answer.headers["www-authenticate"].startswith("Bearer")
        assert refused.answer.headers["connection"] == "close"
        assert refused.answer.json()["error"] == "unauthorized"
        assert refused.closed_by_peer(10)
    limited = masters.stream(master, token=None)
    assert limited.answer.status == 429 and limited.answer.headers["retry-after"], limited.answer
    assert limited.answer.json()["error"] == "unauthorized"
    assert http.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 429
    opened(masters.stream(master)).call(id=1, op="info")


def test_another_job_is_refused_409_and_only_v1_stream_upgrades(masters: Masters):
    master = masters.start()
    for job_id in ("someone-elses-job", None):
        refused = masters.stream(master, job_id=job_id)
        assert refused.answer.status == 409 and refused.answer.json()["error"] == "wrong_job"
        assert refused.closed_by_peer(10)
    for path in ("/v1/streams", "/v1/stream/x", "/stream"):
        other = masters.stream(master, path=path)
        assert other.answer.status == 404, (path, other.answer)
    other = masters.stream(master, upgrade="websocket")  # not ours: a plain request to the route
    assert other.answer.status == 426 and other.answer.json()["error"] == "upgrade_required"
    plain = masters.http(master).get("/v1/stream")
    assert plain.status_code == 426 and "Upgrade: elastic-stream/1" in plain.json()["message"]
    assert masters.http(master).get("/v1/stream", headers={"Authorization": "Bearer x"}).status_code == 401


ONE_NODE = dict(min_nodes=1, max_nodes=1)


def leader_and_standby(masters: Masters, etcd_endpoint: str) -> tuple[str, EmbeddedMaster, EmbeddedMaster]:
    """A new job's two masters on the real etcd: ``(job, leader, standby)``, the first one leading."""
    from master.store.etcd_store import EtcdStore  # imported only where etcd runs

    job = unique_job(JOB_ID)
    store_url = f"etcd://{etcd_endpoint}"
    leader = masters.start(
        store=EtcdStore(etcd_endpoint, job, lease_ttl_s=2), job_id=job, store_url=store_url, **ONE_NODE
    )
    wait_until(lambda: leader.service.job is not None, 20, "the first master to lead")
    standby = masters.start(
        store=EtcdStore(etcd_endpoint, job, lease_ttl_s=2), job_id=job, store_url=store_url, **ONE_NODE
    )
    return job, leader, standby


@pytest.mark.etcd
def test_a_standby_accepts_the_stream_and_answers_each_call_503_not_leader(
    masters: Masters, etcd_endpoint: str
):
    job, leader, standby = leader_and_standby(masters, etcd_endpoint)
    # Agents keep an idle stream to every standby; each call on it is refused until that master leads.
    spare = opened(masters.stream(standby, job_id=job))
    for call_id, op in enumerate(("info", "heartbeat"), start=1):
        refused = spare.call(id=call_id, op=op, body=beat_body("a") if op == "heartbeat" else None)
        assert (refused["status"], refused["body"]["error"]) == (503, "not_leader"), refused
    stream = opened(masters.stream(leader, job_id=job))
    # Write-ahead over the stream: a reply that reveals durable state (a node's secret, a restart) is
    # sent once etcd holds it; a steady heartbeat's needs no wait.
    secret = stream.call(id=1, op="join", body=join_body("a", **ONE_NODE))["body"]["node_secret"]
    beat = stream.call(id=2, op="heartbeat", secret=secret, body=beat_body("a"))
    assert beat["status"] == 200 and beat["body"]["command"] == "continue"
    failed = beat_body("a", 1, "failed", failure=FAILURE)
    beat = stream.call(id=3, op="heartbeat", secret=secret, body=failed)
    assert (beat["body"]["command"], beat["body"]["round"]) == ("rejoin", 2), beat
    assert stored_restarts(etcd_endpoint, job) == 1, "the reply revealed a restart etcd does not hold"


@pytest.mark.etcd
def test_a_standby_holds_a_nodes_heartbeat_and_watch_and_answers_them_once_it_leads(
    masters: Masters, etcd_endpoint: str
):
    """During a failover a node's calls wait at the standby for its election instead of a 503 each."""
    job, leader, standby = leader_and_standby(masters, etcd_endpoint)
    hold = standby.service.standby_hold
    hold.seconds = 30.0  # longer than any takeover, on any machine: a 503 now means the hold failed
    secret = masters.stream(leader, job_id=job).call(id=1, op="join", body=join_body("a", **ONE_NODE))
    secret = secret["body"]["node_secret"]
    spare = opened(masters.stream(standby, job_id=job))
    spare.send(id=1, op="heartbeat", secret=secret, body=beat_body("a"))
    spare.send(id=2, op="watch", secret=secret, query={"node_id": "a", "round": 0, "timeout": LONG_POLL_S})
    wait_until(lambda: hold.waiting == 2, 10, "the standby to hold both calls")
    assert spare.silent_for(0.2), "a held call was answered while the leader still led"
    leader.stop()  # steps down: the lease is revoked and the standby elected
    beat = spare.reply()
    assert (beat["id"], beat["status"], beat["body"]["command"]) == (1, 200, "continue"), beat
    # The watch went on as the new leader's long-poll (nothing to say: it stays pending), not a 503.
    health = standby.service.health
    wait_until(lambda: hold.waiting == 0 and health.long_polls_open == 1, 10, "the watch to be polled")
    assert spare.silent_for(0.2), "the held watch was answered, not polled"


@pytest.mark.etcd
def test_a_heartbeat_reply_that_reveals_a_restart_is_never_sent_before_the_store_holds_it(etcd_server):
    """etcd dies: a steady heartbeat is still answered (it reveals nothing durable), but a failure report
    whose reply would reveal the restart it causes is answered 503 not_leader (the master cannot store
    it and steps down), never 'rejoin'. (No thread check here: gRPC's poller thread outlives a client
    whose server died.)"""
    from master.store.etcd_store import EtcdStore

    job = unique_job(JOB_ID)
    helper = Masters()
    try:
        store = EtcdStore(etcd_server.endpoint, job, lease_ttl_s=2)
        url = f"etcd://{etcd_server.endpoint}"
        master = helper.start(store=store, job_id=job, store_url=url, **ONE_NODE)
        wait_until(lambda: master.service.job is not None, 20, "the master to lead")
        stream = opened(helper.stream(master, job_id=job))
        secret = stream.call(id=1, op="join", body=join_body("a", **ONE_NODE))["body"]["node_secret"]
        assigned = stream.call(id=2, op="round", secret=secret, query={"node_id": "a"})
        assert assigned["body"]["status"] == "assigned", assigned
        etcd_server.kill()
        running = stream.call(id=3, op="heartbeat", secret=secret, body=beat_body("a", 1, "running"))
        assert running["body"]["command"] == "continue", running
        report = beat_body("a", 1, "failed", failure=FAILURE)
        failed = stream.call(id=4, op="heartbeat", secret=secret, body=report)
        assert (failed["status"], failed["body"]["error"]) == (503, "not_leader"), failed
    finally:
        helper.close()


def stored_restarts(endpoint: str, job: str) -> int:
    """The restart count of ``job`` as etcd holds it (read by a client of its own)."""
    from master.store.etcd_store import EtcdStore

    async def read() -> int:
        reader = EtcdStore(endpoint, job)
        try:
            await reader.start()
            return (await reader.load())["restart_count"]
        finally:
            await reader.close()

    return asyncio.run(read())


# -- the calls answer as their HTTP routes ---------------------------------------------------------------
FAILURE = dict(rank=0, local_rank=0, exit_code=1)

#: (op, node whose secret the call carries ("" none, "?" a wrong one), query, body): info, join, round,
#: heartbeat, watch and leave through successes and refusals, over the life of a two-node round.
SCENARIO: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]] = [
    ("info", "", None, None),
    ("join", "", None, join_body("a")),
    ("join", "", None, join_body("b", nproc=0)),
    ("join", "", None, join_body("b", min_nodes=1, max_nodes=4)),
    ("join", "", None, join_body("a", host="10.0.0.9")),
    ("join", "a", None, join_body("a")),
    ("join", "", None, {k: v for k, v in join_body("b").items() if k != "host"}),
    ("round", "a", {"node_id": "a", "after": 0, "timeout": 0}, None),
    ("round", "a", {"node_id": "a", "timeout": 31}, None),
    ("round", "?", {"node_id": "a", "timeout": 0}, None),
    ("heartbeat", "a", None, beat_body("a")),
    ("heartbeat", "?", None, beat_body("a")),
    ("heartbeat", "", None, beat_body("ghost")),
    ("heartbeat", "a", None, beat_body("a", state="exploded")),
    ("heartbeat", "a", None, beat_body("a", failure=dict(FAILURE, core_dumped=True))),
    ("join", "", None, join_body("b", store_port=29502)),
    ("round", "a", {"node_id": "a", "after": 0, "timeout": 5}, None),
    ("round", "b", {"node_id": "b", "after": 0, "timeout": 5}, None),
    ("watch", "a", {"node_id": "a", "round": 1, "timeout": 0}, None),
    ("watch", "a", {"node_id": "a", "timeout": 0}, None),
    ("watch", "a", {"node_id": "a", "round": 1, "timeout": 0, "term": 99}, None),
    ("heartbeat", "a", None, beat_body("a", 1, "running")),
    ("heartbeat", "b", None, beat_body("b", 1, "running", replicas=1)),
    ("heartbeat", "b", None, beat_body("b", 1, "failed", failure=FAILURE)),
    ("watch", "a", {"node_id": "a", "round": 1, "timeout": 5}, None),
    ("leave", "a", None, {"node_id": "a", "reason": "preempted"}),
    ("leave", "", None, {"node_id": "ghost"}),
    ("leave", "b", None, {"node_id": "b", "extra": 1}),
    ("leave", "b", None, {"node_id": "b"}),
    ("info", "", None, None),
]
ROUTES = {op: (method, API_PREFIX + path) for op, (method, path) in STREAM_ROUTES.items()}


def play(call: Callable[[str, str | None, dict | None, dict | None], tuple[int, Any]]) -> list:
    """Play :data:`SCENARIO` through ``call(op, secret, query, body) -> (status, reply body)``; the replies
    with what differs between two masters (their ids, the random secrets) masked."""
    secrets: dict[str, str] = {}
    out = []
    for op, owner, query, body in SCENARIO:
        secret = "not-the-secret" if owner == "?" else secrets.get(owner)
        status, reply = call(op, secret, query, body)
        if isinstance(reply, dict) and reply.get("node_secret"):
            secrets[body["node_id"]] = reply["node_secret"]
            reply = {**reply, "node_secret": "<secret>"}
        if isinstance(reply, dict) and "master_id" in reply:
            reply = {**reply, "master_id": "<master>"}
        out.append((op, status, _masked_incarnation(reply)))
    return out


def _masked_incarnation(reply: Any) -> Any:
    """``reply`` with every ``job_incarnation`` and replication key (each master picks its own when it
    creates the job) masked."""
    if isinstance(reply, dict):
        return {
            k: f"<{k}>"
            if k in ("job_incarnation", "peer_keys", "replication_key")
            else _masked_incarnation(v)
            for k, v in reply.items()
        }
    if isinstance(reply, list):
        return [_masked_incarnation(v) for v in reply]
    return reply


@pytest.mark.parametrize("revision", [PROTOCOL_VERSION, 1])
def test_every_call_answers_over_the_stream_as_over_http(masters: Masters, revision: int):
    """Twin masters in the same state, one driven over HTTP and one over the stream: every reply, success
    or refusal (status, error code and message naming the field), is the same, also for a client of the
    previous protocol revision (replies without the fields it does not know)."""
    over_http, over_stream = masters.start(), masters.start()
    http = masters.http(over_http)
    version = {PROTOCOL_HEADER: str(revision)} if revision > 1 else {}

    def by_http(op: str, secret: str | None, query: dict | None, body: dict | None) -> tuple[int, Any]:
        method, path = ROUTES[op]
        headers = {**version, **({NODE_SECRET_HEADER: secret} if secret else {})}
        response = http.request(method, path, params=query, json=body, headers=headers)
        return response.status_code, response.json()

    stream = opened(masters.stream(over_stream, revision=revision if revision > 1 else None))
    ids = iter(range(1, 1000))

    def by_stream(op: str, secret: str | None, query: dict | None, body: dict | None) -> tuple[int, Any]:
        frame = {"id": next(ids), "op": op, "secret": secret, "query": query, "body": body}
        reply = stream.call(**{k: v for k, v in frame.items() if v is not None})
        return reply["status"], reply["body"]

    expected = play(by_http)
    assert play(by_stream) == expected
    statuses = {status for _, status, _ in expected}
    assert statuses == {200, 403, 404, 409, 422}, statuses  # the scenario reaches each kind of answer
    terms = [("term" in r) for op, s, r in expected if op == "heartbeat" and s == 200]
    assert terms and all(terms) == (revision > 1) and any(terms) == (revision > 1)
    kinds = [e.kind for e in over_stream.service.job.events]
    assert kinds == [e.kind for e in over_http.service.job.events] and "node_left" in kinds


def test_malformed_frames_are_refused_and_the_stream_goes_on(masters: Masters):
    master = masters.start()
    stream = opened(masters.stream(master))
    for raw in (b"not json\n", b"[1, 2]\n", b'{"op": "info"}\n', b'{"id": "7", "op": "info"}\n', b"\xff\n"):
        stream.send_raw(raw)
        reply = stream.reply()
        assert (reply["id"], reply["status"], reply["body"]["error"]) == (0, 422, "invalid_request"), raw
    unknown = stream.call(id=3, op="status")
    assert (unknown["status"], unknown["body"]["error"]) == (404, "not_found")
    secret = stream.call(id=4, op="join", secret=7, body=join_body("a"))
    assert secret["status"] == 422 and secret["body"]["message"].startswith("secret:")
    missing = stream.call(id=5, op="heartbeat")
    assert (missing["status"], missing["body"]["message"]) == (422, "body: Field required")
    assert stream.call(id=6, op="info")["status"] == 200


#: A JSON document nested this deep overflows Python's parser (its recursion limit is 1,000).
DEEP = 20_000


def test_a_20000_deep_frame_is_refused_and_every_stream_goes_on(masters: Masters):
    """Nesting deeper than the JSON parser's recursion limit is a malformed frame like any other: 422 on
    the frame's stream, which goes on, and no other stream notices (before: an uncaught RecursionError)."""
    master = masters.start()
    stream, other = opened(masters.stream(master)), opened(masters.stream(master))
    stream.send_raw(b'{"id": 1, "op": "info", "body": ' + b"[" * DEEP + b"]" * DEEP + b"}\n")
    reply = stream.reply()
    assert (reply["id"], reply["status"], reply["body"]["error"]) == (0, 422, "invalid_request")
    assert "nested too deeply" in reply["body"]["message"]
    assert stream.call(id=2, op="info")["status"] == 200
    assert other.call(id=1, op="info")["status"] == 200


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_in_a_heartbeat_is_refused_on_the_stream_and_over_http(masters: Masters, value):
    """Python's JSON parser accepts NaN and infinities: a heartbeat carrying one is refused 422 naming the
    field, over the stream (the call's reply; the stream goes on) and over HTTP alike."""
    master = masters.start()
    stream = opened(masters.stream(master))
    joined = stream.call(id=1, op="join", body=join_body("a"))
    assert joined["status"] == 200
    secret = joined["body"]["node_secret"]
    body = beat_body("a", workers=[{"local_rank": 0, "step": 3, "step_time_s": value}])
    frame = {"id": 2, "op": "heartbeat", "secret": secret, "body": body}
    stream.send_raw(json.dumps(frame).encode() + b"\n")  # NaN, Infinity or -Infinity in the JSON text
    reply = stream.reply()
    assert (reply["id"], reply["status"], reply["body"]["error"]) == (2, 422, "invalid_request"), reply
    assert "workers.0.step_time_s" in reply["body"]["message"], reply
    beat = stream.call(id=3, op="heartbeat", secret=secret, body=beat_body("a"))
    assert beat["status"] == 200, beat
    over_http = masters.http(master).post(
        f"{API_PREFIX}/heartbeat",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", NODE_SECRET_HEADER: secret},
    )
    assert over_http.status_code == 422 and "step_time_s" in over_http.json()["message"], over_http.text


def test_a_20000_deep_body_over_http_is_refused_422_saying_why(masters: Masters):
    """FastAPI's bare 400 for a body its parser failed on became a 422 that said "not UTF-8" whatever the
    cause: it names the cause now."""
    master = masters.start()
    client = masters.http(master)
    deep = client.post(
        f"{API_PREFIX}/heartbeat",
        content=b"[" * DEEP + b"]" * DEEP,
        headers={"content-type": "application/json"},
    )
    assert deep.status_code == 422 and deep.json()["error"] == "invalid_request", deep.text
    assert "nested too deeply" in deep.json()["message"] and "UTF-8" not in deep.json()["message"]
    json_type = {"content-type": "application/json"}
    binary = client.post(f"{API_PREFIX}/heartbeat", content=b'{"node_id": "\xff"}', headers=json_type)
    assert binary.status_code == 422 and "not UTF-8" in binary.json()["message"], binary.text
    assert client.get(f"{API_PREFIX}/status").status_code == 200


def test_a_frame_over_the_limit_is_answered_413_and_the_stream_closed(masters: Masters):
    master = masters.start()
    stream = opened(masters.stream(master))
    assert stream.call(id=1, op="info")["status"] == 200
    stream.send_raw(b'{"id": 2, "op": "join", "body": {"host": "' + b"h" * STREAM_MAX_FRAME_BYTES)
    reply = stream.reply()
    assert (reply["id"], reply["status"], reply["body"]["error"]) == (0, 413, "body_too_large")
    assert str(STREAM_MAX_FRAME_BYTES) in reply["body"]["message"]
    assert stream.closed_by_peer(10)


# -- multiplexing ----------------------------------------------------------------------------------------
def test_long_polls_and_heartbeats_share_one_stream_and_are_answered_out_of_order(masters: Masters):
    """Node a's round long-poll and later its watch wait on the stream while its heartbeats are answered at
    once; each long-poll is answered when node b (over HTTP) closes the round, then fails."""
    master = masters.start()
    http = masters.http(master)
    stream = opened(masters.stream(master))
    secret = stream.call(id=1, op="join", body=join_body("a"))["body"]["node_secret"]
    stream.send(id=2, op="round", secret=secret, query={"node_id": "a", "timeout": LONG_POLL_S})
    for call_id in (3, 4):
        beat = stream.call(id=call_id, op="heartbeat", secret=secret, body=beat_body("a"))
        assert beat["body"]["command"] == "continue"
    b = http.post("/v1/join", json=join_body("b", store_port=29502)).json()["node_secret"]
    assigned = stream.reply()
    assert assigned["id"] == 2 and assigned["body"]["status"] == "assigned", assigned
    stream.send(id=5, op="watch", secret=secret, query={"node_id": "a", "round": 1, "timeout": LONG_POLL_S})
    stream.send(id=6, op="watch", secret=secret, query={"node_id": "a", "round": 1, "timeout": LONG_POLL_S})
    running = beat_body("a", 1, "running")
    assert stream.call(id=7, op="heartbeat", secret=secret, body=running)["body"]["command"] == "continue"
    failed = beat_body("b", 1, "failed", failure=FAILURE)
    reply = http.post("/v1/heartbeat", json=failed, headers={NODE_SECRET_HEADER: b}).json()
    assert reply["command"] == "rejoin"
    woken = {r["id"]: r["body"] for r in (stream.reply(), stream.reply())}
    assert {i: (r["command"], r["round"]) for i, r in woken.items()} == {5: ("rejoin", 2), 6: ("rejoin", 2)}
    assert stream.call(id=8, op="join", secret=secret, body=join_body("a"))["status"] == 200
    stream.send(id=9, op="round", secret=secret, query={"node_id": "a", "after": 1, "timeout": LONG_POLL_S})
    assert stream.call(id=10, op="heartbeat", secret=secret, body=beat_body("a", 1, "waiting"))["id"] == 10
    http.post("/v1/join", json=join_body("b", store_port=29502), headers={NODE_SECRET_HEADER: b})
    assigned = stream.reply()
    assert assigned["id"] == 9 and assigned["body"]["assignment"]["round"] == 2, assigned


def test_calls_beyond_the_pending_cap_are_answered_429_busy(masters: Masters):
    master = masters.start()
    stream = opened(masters.stream(master))
    secret = stream.call(id=1, op="join", body=join_body("a"))["body"]["node_secret"]
    poll = {"node_id": "a", "after": 10**6, "timeout": LONG_POLL_S}  # no such round: they all wait
    for call_id in range(10, 10 + STREAM_MAX_PENDING):
        stream.send(id=call_id, op="round", secret=secret, query=poll)
    wait_until(lambda: master.service.health.long_polls_open == STREAM_MAX_PENDING, 10, "the long-polls")
    busy = stream.call(id=2, op="heartbeat", secret=secret, body=beat_body("a"))
    assert (busy["status"], busy["body"]["error"]) == (429, "busy")
    stream.send(id=10, op="info")  # the id of a pending call: answered as a malformed frame (id 0)
    again = stream.reply()
    assert (again["id"], again["status"]) == (0, 422) and "already pending" in again["body"]["message"]
    stream.close()
    wait_until(lambda: master.service.health.long_polls_open == 0, 10, "the long-polls to be cancelled")


# -- the connection --------------------------------------------------------------------------------------
def test_a_stream_closed_during_a_watch_counts_as_a_closed_long_poll(masters: Masters):
    """As over HTTP (test_master_api: dead after two heartbeat intervals): node b's agent dies with its
    stream while its watch waits; b is suspected at once and declared dead after two intervals without a
    heartbeat, while node a heartbeats on."""
    interval = 0.5
    master = masters.start(heartbeat_interval_s=interval)
    http = masters.http(master)
    a = http.post("/v1/join", json=join_body("a")).json()["node_secret"]
    stream = opened(masters.stream(master))
    b = stream.call(id=1, op="join", body=join_body("b", store_port=29502))["body"]["node_secret"]
    stream.call(id=2, op="heartbeat", secret=b, body=beat_body("b", 1, "running"))
    stream.send(id=3, op="watch", secret=b, query={"node_id": "b", "round": 1, "timeout": LONG_POLL_S})
    stream.send(id=4, op="round", secret=b, query={"node_id": "b", "after": 1, "timeout": LONG_POLL_S})
    wait_until(lambda: master.service.health.long_polls_open == 2, 10, "the long-polls to wait")
    stream.close()

    def kinds() -> list[str]:
        return [e.kind for e in master.service.job.events]

    deadline = time.monotonic() + 20
    while "node_dead" not in kinds():
        http.post("/v1/heartbeat", json=beat_body("a", 1, "running"), headers={NODE_SECRET_HEADER: a})
        assert time.monotonic() < deadline, f"no node declared dead; events {kinds()}"
        time.sleep(interval / 2)
    dead = [e.message for e in master.service.job.events if e.kind == "node_dead"]
    assert len(dead) == 1 and dead[0].startswith("node b declared dead"), dead
    assert "after closing its connection" in dead[0]
    assert master.service.health.long_polls_open == 0


def test_a_closed_stream_without_long_polls_is_no_verdict(masters: Masters):
    master = masters.start()
    stream = opened(masters.stream(master))
    secret = stream.call(id=1, op="join", body=join_body("a"))["body"]["node_secret"]
    stream.call(id=2, op="heartbeat", secret=secret, body=beat_body("a"))
    stream.close()
    guard = master.service.connection_guard
    wait_until(lambda: guard.open == 0, 10, "the stream's connection to be released")
    assert "node_suspect" not in [e.kind for e in master.service.job.events]


def test_the_guard_counts_a_stream_once_never_closes_it_as_idle_and_releases_it(masters: Masters):
    """At the cap of 2, an idle connection makes room for a new one, never the stream (which sent its
    request, however long ago: also past the first-request timeout)."""
    header_timeout = 0.5
    master = masters.start(max_connections=2, header_timeout_s=header_timeout)
    guard = master.service.connection_guard
    stream = opened(masters.stream(master))
    assert guard.open == 1
    assert stream.silent_for(header_timeout * 3)  # past the first-request timeout: still open
    assert stream.call(id=1, op="info")["status"] == 200
    with socket.create_connection((master.host, master.port), timeout=10) as waiting:
        wait_until(lambda: guard.open == 2, 10, "the idle connection to be counted")
        with socket.create_connection((master.host, master.port), timeout=10) as third:
            waiting.settimeout(10)
            assert waiting.recv(1) == b""  # the idle one was evicted for the newcomer, not the stream
            third.sendall(b"GET /v1/info HTTP/1.1\r\nHost: m\r\n" + _auth_lines() + b"\r\n")
            third.settimeout(10)
            assert third.recv(4096).startswith(b"HTTP/1.1 200")
        assert guard.closed["evicted"] == 1
    assert stream.call(id=2, op="info")["status"] == 200
    stream.close()
    wait_until(lambda: guard.open == 0, 10, "every connection to be released")


def _auth_lines() -> bytes:
    return "".join(f"{k}: {v}\r\n" for k, v in AUTH.items()).encode()


def test_the_stream_runs_over_tls(masters: Masters, tmp_path):
    authority = CertAuthority.create("stream CA")
    cert, key = authority.issue_files(tmp_path, "server", "elastic-master", LOCAL_NAMES)
    master = masters.start(tls_cert=str(cert), tls_key=str(key))
    context = ssl.create_default_context(cafile=str(authority.write(tmp_path / "ca.pem")))
    stream = opened(masters.stream(master, tls=context, first=b'{"id": 1, "op": "info"}\n'))
    assert stream.reply()["body"]["job_id"] == JOB_ID
    secret = stream.call(id=2, op="join", body=join_body("a"))["body"]["node_secret"]
    assert stream.call(id=3, op="heartbeat", secret=secret, body=beat_body("a"))["status"] == 200
    refused = masters.stream(master, token="nope", tls=context)
    assert refused.answer.status == 401
