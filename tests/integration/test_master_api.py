"""Tests of the master's HTTP API with a real ``EmbeddedMaster`` (uvicorn in a thread) on 127.0.0.1.

Requests go through ``agent.client.MasterClient`` where it can express them, and through a raw
``httpx.Client`` for the malformed ones. Every bad request is followed by a check that ``GET /v1/status``
is unchanged. The fixture stops every master and closes every client, then checks that no thread the test
started is left.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from embedded_masters import EmbeddedMasters, no_thread_left

from elastic.control.client import MasterClient, MasterRejectedError
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    JOB_HEADER,
    LONG_POLL_CAP_S,
    MAX_BODY_BYTES,
    NODE_SECRET_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    Command,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    NodeState,
    WorkerFailure,
)
from master.http.serving import EmbeddedMaster
from master.service.service import MasterService
from master.service.settings import ServerSettings

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"
JOB_ID = "job-api"
AUTH = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: JOB_ID}
#: A long-poll that should wake at once must return well before this (it asks for LONG_POLL_S).
PROMPT_S = 2.0
LONG_POLL_S = 20.0


class Api(EmbeddedMasters):
    """Starts masters and opens clients for one test; :meth:`close` undoes all of it."""

    token = TOKEN
    job_id = JOB_ID
    http_timeout = httpx.Timeout(LONG_POLL_CAP_S + 10, connect=5.0)

    def client(self, master: EmbeddedMaster, token: str = TOKEN) -> MasterClient:
        return self.keep(MasterClient([master.address], JOB_ID, token, request_timeout=10.0))


@pytest.fixture
def api() -> Iterator[Api]:
    with no_thread_left(), Api() as helper:
        yield helper


def join_body(node_id: str = "b", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = dict(
        node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=2, max_nodes=2
    )
    body.update(overrides)
    return body


def join_req(node_id: str, **overrides: Any) -> JoinRequest:
    return JoinRequest(**join_body(node_id, **overrides))


def snapshot(http: httpx.Client) -> dict[str, Any]:
    """``GET /v1/status`` without the heartbeat ages and the badput seconds (they change with time alone)."""
    response = http.get("/v1/status", headers=AUTH)
    assert response.status_code == 200, response.text
    data = response.json()
    data.pop("badput_s")
    for row in data["nodes"]:
        row.pop("heartbeat_age_s")
    for event in data.get("events", []):
        event.pop("age_s")
    return data


def in_thread(client: MasterClient, call: Callable[[MasterClient], Any]) -> Any:
    """Run ``call(client)`` on a pool thread and close that thread's HTTP client afterwards."""
    try:
        return call(client)
    finally:
        client.close()


def spy(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> threading.Event:
    """Replace ``obj.name`` with a wrapper that sets the returned event whenever it is called."""
    called = threading.Event()
    original = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        called.set()
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return called


# -- bad requests ----------------------------------------------------------------------------------------
def _post_json(path: str, body: Any, headers: dict[str, str] | None = None):
    def send(http: httpx.Client) -> httpx.Response:
        return http.post(
            path,
            content=json.dumps(body),
            headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)},
        )

    return send


def _get(path: str, headers: dict[str, str] | None = None, **params: Any):
    def send(http: httpx.Client) -> httpx.Response:
        return http.get(path, params=params, headers=AUTH if headers is None else headers)

    return send


def _raw(path: str, content: Any, headers: dict[str, str] | None = None):
    def send(http: httpx.Client) -> httpx.Response:
        return http.post(
            path,
            content=content,
            headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)},
        )

    return send


WRONG_TOKEN = {"Authorization": "Bearer not-the-token", JOB_HEADER: JOB_ID}
NO_TOKEN = {JOB_HEADER: JOB_ID}
WRONG_JOB = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: "someone-elses-job"}
NO_JOB = {"Authorization": f"Bearer {TOKEN}"}
FAILURE = dict(rank=0, local_rank=0, exit_code=1)

# (send, expected status, expected error code, words the message must contain)
BAD_REQUESTS = {
    "wrong-token": (_post_json("/v1/join", join_body(), WRONG_TOKEN), 401, "unauthorized", ["token"]),
    "no-token": (_post_json("/v1/join", join_body(), NO_TOKEN), 401, "unauthorized", []),
    "wrong-token-status": (_get("/v1/status", WRONG_TOKEN), 401, "unauthorized", []),
    "wrong-token-heartbeat": (
        _post_json("/v1/heartbeat", dict(node_id="a", round=0, state="failed", failure=FAILURE), WRONG_TOKEN),
        401,
        "unauthorized",
        [],
    ),
    "wrong-job": (_post_json("/v1/join", join_body(), WRONG_JOB), 409, "wrong_job", ["someone-elses-job"]),
    "no-job-header": (_post_json("/v1/join", join_body(), NO_JOB), 409, "wrong_job", []),
    "bad-field-type": (_post_json("/v1/join", join_body(nproc="many")), 422, "invalid_request", ["nproc"]),
    "field-out-of-range": (
        _post_json("/v1/join", join_body(store_port=70000)),
        422,
        "invalid_request",
        ["store_port"],
    ),
    "missing-field": (
        _post_json("/v1/join", {k: v for k, v in join_body().items() if k != "host"}),
        422,
        "invalid_request",
        ["host"],
    ),
    "bad-node-id": (_post_json("/v1/join", join_body(node_id="../etc")), 422, "invalid_request", ["node_id"]),
    "host-forging-a-log-line": (
        _post_json("/v1/join", join_body(host="x\nFAKE [elastic.master] succeeded")),
        422,
        "invalid_request",
        ["host"],
    ),
    "host-with-a-trailing-newline": (
        _post_json("/v1/join", join_body(host="node-b\n")),
        422,
        "invalid_request",
        ["host"],
    ),
    "bad-enum": (
        _post_json("/v1/heartbeat", dict(node_id="a", round=0, state="exploded")),
        422,
        "invalid_request",
        ["state"],
    ),
    "bad-nested-field": (
        _post_json(
            "/v1/heartbeat", dict(node_id="a", round=1, state="failed", failure=dict(FAILURE, rank=-1))
        ),
        422,
        "invalid_request",
        ["failure", "rank"],
    ),
    "not-json": (_raw("/v1/join", b'{"node_id": "b", nproc}'), 422, "invalid_request", []),
    "json-not-an-object": (_raw("/v1/join", b"[1, 2, 3]"), 422, "invalid_request", []),
    "unknown-field": (_post_json("/v1/join", join_body(gpus=8)), 422, "invalid_request", ["gpus"]),
    "unknown-nested-field": (
        _post_json(
            "/v1/heartbeat",
            dict(node_id="a", round=1, state="failed", failure=dict(FAILURE, core_dumped=True)),
        ),
        422,
        "invalid_request",
        ["core_dumped"],
    ),
    "oversize-body": (
        _raw("/v1/join", json.dumps(join_body(host="h" * MAX_BODY_BYTES)).encode()),
        413,
        "body_too_large",
        [str(MAX_BODY_BYTES)],
    ),
    "unknown-node-heartbeat": (
        _post_json("/v1/heartbeat", dict(node_id="ghost", round=0, state="waiting")),
        404,
        "unknown_node",
        ["ghost"],
    ),
    "unknown-node-leave": (_post_json("/v1/leave", dict(node_id="ghost")), 404, "unknown_node", ["ghost"]),
    "unknown-node-round": (_get("/v1/round", node_id="ghost", timeout=0), 404, "unknown_node", ["ghost"]),
    "nnodes-mismatch": (
        _post_json("/v1/join", join_body(min_nodes=1, max_nodes=4)),
        409,
        "settings_mismatch",
        ["1:4", "2:2"],
    ),
    "round-timeout-over-cap": (
        _get("/v1/round", node_id="a", timeout=LONG_POLL_CAP_S + 1),
        422,
        "invalid_request",
        ["timeout"],
    ),
    "watch-timeout-over-cap": (
        _get("/v1/watch", node_id="a", round=1, timeout=1000),
        422,
        "invalid_request",
        ["timeout"],
    ),
    "watch-without-round": (_get("/v1/watch", node_id="a"), 422, "invalid_request", ["round"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request_is_rejected_and_changes_nothing(api: Api, case: str):
    send, status, code, words = BAD_REQUESTS[case]
    master = api.start()
    api.client(master).join(join_req("a"))  # a waits for b: a join of b would close the round
    http = api.http(master, headers={})  # every request names its own headers
    before = snapshot(http)
    assert before["nodes"] and before["phase"] == "rendezvous"

    response = send(http)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "message"}, body
    assert body["error"] == code
    for word in words:
        assert word in body["message"], body

    assert snapshot(http) == before
    assert [e.kind for e in master.service.job.events] == ["job_started", "node_joined"]


def test_oversize_chunked_body_is_rejected_with_413(api: Api):
    master = api.start()
    http = api.http(master)
    before = snapshot(http)
    chunk = b" " * 16384
    response = http.post(
        "/v1/join", content=iter([b"{", *[chunk] * 5, b"}"]), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"] == "body_too_large"
    assert snapshot(http) == before


def test_wrong_token_wins_over_a_malformed_body(api: Api):
    master = api.start()
    http = api.http(master)
    response = http.post(
        "/v1/join", content=b"{not json", headers={"Content-Type": "application/json", **WRONG_TOKEN}
    )
    assert response.status_code == 401, response.text


def test_401_names_the_bearer_scheme_and_the_scheme_is_case_insensitive(api: Api):
    master = api.start()
    http = api.http(master, headers={})
    refused = http.get("/v1/status", headers=WRONG_TOKEN)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = http.get("/v1/status", headers={"Authorization": f"{scheme} {TOKEN}", JOB_HEADER: JOB_ID})
        assert response.status_code == 200, (scheme, response.text)
    for header in (f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}"):
        response = http.get("/v1/status", headers={"Authorization": header, JOB_HEADER: JOB_ID})
        assert response.status_code == 401, header


def test_client_raises_a_typed_rejection(api: Api):
    master = api.start()
    with pytest.raises(MasterRejectedError) as info:
        api.client(master, token="wrong").join(join_req("a"))
    assert (info.value.status, info.value.code) == (401, "unauthorized")
    client = api.client(master)
    with pytest.raises(MasterRejectedError) as info:
        client.heartbeat(HeartbeatRequest(node_id="ghost", round=0, state=NodeState.WAITING))
    assert (info.value.status, info.value.code) == (404, "unknown_node")
    with pytest.raises(MasterRejectedError) as info:
        client.next_round("a", 0, LONG_POLL_CAP_S + 5)
    assert info.value.status == 422 and "timeout" in info.value.message
    assert client.status().nodes == []


# -- the happy path through the client -------------------------------------------------------------------
def test_info_join_assign_heartbeat_leave_through_the_client(api: Api):
    master = api.start(min_nodes=1, max_nodes=2, max_restarts=5)
    client = api.client(master)
    info = client.info()
    assert (info.job_id, info.min_nodes, info.max_nodes, info.max_restarts) == (JOB_ID, 1, 2, 5)
    assert info.master_id == master.service.job.master_id

    assert client.join(join_req("a", min_nodes=1)).round == 1
    assert client.join(join_req("b", min_nodes=1, nproc=3, store_port=29502)).round == 1
    reply = client.next_round("b", 0, 5.0)
    assert reply.status == "assigned"
    assignment = reply.assignment
    assert (assignment.node_rank, assignment.rank_offset, assignment.world_size) == (1, 1, 4)
    assert (assignment.master_addr, assignment.master_port) == ("127.0.0.1", 29501)

    cmd = client.heartbeat(HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING))
    assert (cmd.command, cmd.round, cmd.master_id) == (Command.CONTINUE, 1, info.master_id)
    status = client.status()
    assert (status.phase, status.world_size, status.nnodes) == ("training", 4, 2)
    assert {row.node_id: row.state for row in status.nodes} == {"a": "running", "b": "starting"}

    client.leave(LeaveRequest(node_id="b", reason="preempted"))
    cmd = client.heartbeat(HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING))
    assert (cmd.command, cmd.round) == (Command.REJOIN, 2)
    assert client.status().restart_count == 0


def test_a_round_is_named_by_term_and_number_on_the_wire(api: Api):
    """The assignment names its term; a heartbeat or watch naming the same round number under another term
    is told to rejoin (another leader's world); one without a term (an older agent) is judged by the number
    alone. The client sends the term its assignment gave, and nothing a master of an older release would
    refuse when there is none."""
    master = api.start(min_nodes=1, max_nodes=1)
    client = api.client(master)
    client.join(join_req("a", min_nodes=1, max_nodes=1))
    assignment = client.next_round("a", 0, 5.0).assignment
    assert assignment is not None and assignment.term == master.service.store.term >= 1
    http = api.http(master)
    own = {**AUTH, NODE_SECRET_HEADER: client._secrets["a"], PROTOCOL_HEADER: str(PROTOCOL_VERSION)}

    def beat(**fields: Any) -> dict[str, Any]:
        body = dict(node_id="a", round=1, state="running", **fields)
        response = http.post("/v1/heartbeat", json=body, headers=own)
        assert response.status_code == 200, response.text
        return response.json()

    assert beat(term=assignment.term)["command"] == "continue"
    assert beat()["command"] == "continue", "no term: round numbers alone"
    stale = beat(term=assignment.term + 1)
    assert (stale["command"], stale["term"]) == ("rejoin", assignment.term)
    watch = dict(node_id="a", round=1, timeout=0)
    for term, command in ((assignment.term, "continue"), (assignment.term + 1, "rejoin")):
        reply = http.get("/v1/watch", params={**watch, "term": term}, headers=own)
        assert reply.json()["command"] == command, reply.text
    # A client of revision 1 (the previous release refuses unknown reply fields) gets replies without terms.
    old = {k: v for k, v in own.items() if k != PROTOCOL_HEADER}
    beat_v1 = http.post("/v1/heartbeat", json=dict(node_id="a", round=1, state="running"), headers=old)
    assert beat_v1.status_code == 200 and "term" not in beat_v1.json(), beat_v1.text
    round_v1 = http.get("/v1/round", params=dict(node_id="a", after=0, timeout=0), headers=old)
    assert round_v1.json()["assignment"]["round"] == 1 and "term" not in round_v1.json()["assignment"]
    status_v1 = http.get("/v1/status", headers=old).json()
    assert status_v1["nodes"] and "readmit_in_s" not in status_v1["nodes"][0]
    # Through the client: the remembered term travels with the heartbeat and the watch.
    assert client.heartbeat(HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING)).command is (
        Command.CONTINUE
    )
    master.service.job.round_term += 1  # as if a later leader had closed its own round 1
    assert client.heartbeat(HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING)).command is (
        Command.REJOIN
    )
    assert client.watch("a", 1, 0).command is Command.REJOIN


def test_an_assignment_lists_the_members_only_for_clients_of_revision_2_or_older(api: Api):
    """Revision 3 leaves the member list out of assignments (N ids to each of N nodes: O(N^2) bytes per
    round); agents of revisions 1 and 2 require it and still get it, over HTTP as over the stream."""
    master = api.start(min_nodes=2, max_nodes=2)
    client = api.client(master)
    for node in ("a", "b"):
        client.join(join_req(node))
    assert client.next_round("a", 0, 5.0).assignment.members == [], "this release's client: no list"
    http = api.http(master)
    secret = {NODE_SECRET_HEADER: client._secrets["b"]}
    query = dict(node_id="b", after=0, timeout=0)
    for revision, members in ((PROTOCOL_VERSION, None), (2, ["a", "b"]), (1, ["a", "b"])):
        headers = {**AUTH, **secret, **({PROTOCOL_HEADER: str(revision)} if revision > 1 else {})}
        assignment = http.get("/v1/round", params=query, headers=headers).json()["assignment"]
        assert assignment.get("members") == members, (revision, assignment)
        assert assignment["nnodes"] == 2 and assignment["node_rank"] == 1


def test_requests_for_a_node_need_the_secret_its_join_returned(api: Api):
    """The X-Elastic-Node-Secret header over HTTP: 403 bad_node_secret without it (nothing changes), 409
    duplicate_node for a second join under the id, and the same secret on a rejoin that carries it."""
    master = api.start()
    http = api.http(master)
    joined = http.post("/v1/join", json=join_body("a"))
    assert joined.status_code == 200, joined.text
    secret = joined.json()["node_secret"]
    assert len(secret) >= 43
    before, version = snapshot(http), master.service.job.version

    forged = dict(node_id="a", round=0, state="failed", failure=FAILURE)
    for headers in ({}, {NODE_SECRET_HEADER: "a-guess"}):
        for response in (
            http.post("/v1/heartbeat", json=forged, headers=headers),
            http.post("/v1/leave", json=dict(node_id="a", reason="forged"), headers=headers),
            http.get("/v1/round", params=dict(node_id="a", timeout=0), headers=headers),
            http.get("/v1/watch", params=dict(node_id="a", round=1, timeout=0), headers=headers),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"] == "bad_node_secret" and "node a" in response.json()["message"]
    duplicate = http.post("/v1/join", json=join_body("a", host="10.1.1.1"))
    assert duplicate.status_code == 409, duplicate.text
    assert duplicate.json()["error"] == "duplicate_node" and "node id a" in duplicate.json()["message"]
    assert snapshot(http) == before and master.service.job.version == version

    own = {NODE_SECRET_HEADER: secret}
    beat = http.post("/v1/heartbeat", json=dict(node_id="a", round=0, state="waiting"), headers=own)
    assert beat.status_code == 200, beat.text
    rejoined = http.post("/v1/join", json=join_body("a"), headers=own)
    assert rejoined.status_code == 200 and rejoined.json()["node_secret"] == secret


# -- long-polls ------------------------------------------------------------------------------------------
def test_round_long_poll_returns_as_soon_as_a_join_closes_the_round(
    api: Api, monkeypatch: pytest.MonkeyPatch
):
    master = api.start(min_nodes=2, max_nodes=2)
    client = api.client(master)
    client.join(join_req("a"))
    probed = spy(monkeypatch, master.service.job, "next_round")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(in_thread, client, lambda c: c.next_round("a", 0, LONG_POLL_S))
        assert probed.wait(10), "the long-poll never reached the master"
        assert not future.done(), "a round of one node of two cannot be assigned"
        start = time.monotonic()
        client.join(join_req("b", store_port=29502))
        reply = future.result(timeout=LONG_POLL_S + 10)
        elapsed = time.monotonic() - start
    assert reply.status == "assigned" and reply.assignment.node_rank == 0
    assert elapsed < PROMPT_S, f"the long-poll returned {elapsed:.2f}s after the round closed"


def test_round_long_poll_returns_as_soon_as_the_last_call_closes_the_round(api: Api):
    master = api.start(min_nodes=1, max_nodes=2, last_call_s=1.0)
    client = api.client(master)
    client.join(join_req("a", min_nodes=1))
    start = time.monotonic()
    reply = client.next_round("a", 0, LONG_POLL_S)
    elapsed = time.monotonic() - start
    assert reply.status == "assigned"
    assert elapsed < 1.0 + PROMPT_S, f"closed after a 1 s last call, but the poll took {elapsed:.2f}s"


def test_round_long_poll_says_waiting_after_a_short_timeout(api: Api):
    master = api.start(min_nodes=2, max_nodes=2)
    client = api.client(master)
    client.join(join_req("a"))
    start = time.monotonic()
    reply = client.next_round("a", 0, 0.5)
    elapsed = time.monotonic() - start
    assert (reply.status, reply.round, reply.assignment) == ("waiting", 1, None)
    assert 0.45 <= elapsed < 0.5 + PROMPT_S


def test_a_long_poll_at_the_cap_is_accepted(api: Api):
    master = api.start(min_nodes=1, max_nodes=1)
    client = api.client(master)
    client.join(join_req("a", min_nodes=1, max_nodes=1))
    reply = client.next_round("a", 0, LONG_POLL_CAP_S)  # already assigned: returns at once
    assert reply.status == "assigned"


def test_watch_returns_rejoin_as_soon_as_another_nodes_failure_opens_a_round(
    api: Api, monkeypatch: pytest.MonkeyPatch
):
    master = api.start(min_nodes=2, max_nodes=2)
    client = api.client(master)
    client.join(join_req("a"))
    client.join(join_req("b", store_port=29502))
    for node_id in ("a", "b"):
        reply = client.heartbeat(HeartbeatRequest(node_id=node_id, round=1, state=NodeState.RUNNING))
        assert reply.command is Command.CONTINUE
    assert client.watch("a", 1, 0.2).command is Command.CONTINUE, "nothing happened: continue at the timeout"

    probed = spy(monkeypatch, master.service.job, "command_for")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(in_thread, client, lambda c: c.watch("a", 1, LONG_POLL_S))
        assert probed.wait(10), "the watch never reached the master"
        assert not future.done()
        start = time.monotonic()
        failure = WorkerFailure(rank=1, local_rank=0, exit_code=1, message="boom")
        report = HeartbeatRequest(node_id="b", round=1, state=NodeState.FAILED, failure=failure)
        reply = client.heartbeat(report)
        assert (reply.command, reply.round) == (Command.REJOIN, 2)
        watched = future.result(timeout=LONG_POLL_S + 10)
        elapsed = time.monotonic() - start
    assert (watched.command, watched.round) == (Command.REJOIN, 2)
    assert elapsed < PROMPT_S, f"the watch returned {elapsed:.2f}s after the failure"
    assert client.status().restart_count == 1


def open_watch(master: EmbeddedMaster, node_id: str, round_: int, secret: str) -> socket.socket:
    """Send a watch long-poll on a raw socket and leave it pending (closing the socket drops it)."""
    host, port = master.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    headers = "".join(f"{k}: {v}\r\n" for k, v in {**AUTH, NODE_SECRET_HEADER: secret}.items())
    target = f"/v1/watch?node_id={node_id}&round={round_}&timeout={LONG_POLL_S}"
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {master.address}\r\n{headers}\r\n".encode())
    return sock


def test_a_node_whose_long_poll_connection_closes_is_dead_after_two_heartbeat_intervals(
    api: Api, monkeypatch: pytest.MonkeyPatch
):
    """An agent that dies closes its connections: the master declares its node dead after two heartbeat
    intervals without a heartbeat, not after the whole heartbeat timeout. A live node whose connection
    closes keeps heartbeating and stays."""
    interval = 0.5
    master = api.start(min_nodes=2, max_nodes=2, heartbeat_interval_s=interval, heartbeat_timeout_s=60.0)
    client = api.client(master)
    secrets = {"a": client.join(join_req("a")).node_secret}
    secrets["b"] = client.join(join_req("b", store_port=29502)).node_secret
    for node_id in ("a", "b"):
        client.heartbeat(HeartbeatRequest(node_id=node_id, round=1, state=NodeState.RUNNING))
    probed = spy(monkeypatch, master.service.job, "command_for")
    for node_id in ("a", "b"):
        probed.clear()
        sock = open_watch(master, node_id, 1, secrets[node_id])
        assert probed.wait(10), "the watch never reached the master"
        sock.close()
    dropped_at = time.monotonic()

    def kinds() -> list[str]:
        return [e.kind for e in master.service.job.events]

    # "a" lives on (heartbeats); "b" died with its connection.
    while "node_dead" not in kinds():
        client.heartbeat(HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING))
        assert time.monotonic() - dropped_at < 20, f"no node declared dead; events {kinds()}"
        time.sleep(interval / 2)
    dead = [e.message for e in master.service.job.events if e.kind == "node_dead"]
    assert len(dead) == 1 and dead[0].startswith("node b declared dead"), dead
    assert "after closing its connection" in dead[0]
    assert kinds().count("node_suspect") == 2
    status = client.status()
    assert [n.node_id for n in status.nodes] == ["a"], status


# -- OpenAPI ---------------------------------------------------------------------------------------------
def test_openapi_document_is_served(api: Api):
    master = api.start()
    response = api.http(master).get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    for name in ("info", "join", "round", "heartbeat", "watch", "leave", "status"):
        assert f"/v1/{name}" in document["paths"], name
    assert {"JoinRequest", "HeartbeatRequest", "CommandReply"} <= set(document["components"]["schemas"])


def test_a_change_right_after_a_long_polls_check_wakes_it():
    """The lost wake-up: the state changes (and waiters are notified) after a long-poll checked the state
    but before its wait began. The poll must see it at once, not at the end of its timeout."""
    settings = ServerSettings(job=JobSettings(job_id=JOB_ID), token=TOKEN)
    service = MasterService(settings)

    async def scenario() -> tuple[str | None, float]:
        first_check = True

        def probe() -> str | None:
            nonlocal first_check
            if first_check:
                first_check = False
                # The notify runs on the next loop iteration: after this check, before the poll's wait.
                asyncio.get_running_loop().call_soon(service.notifier.notify)
                return None
            return "changed"

        started = time.monotonic()
        result = await service.long_poll(probe, LONG_POLL_S)
        return result, time.monotonic() - started

    result, took = asyncio.run(asyncio.wait_for(scenario(), LONG_POLL_S + 5))
    assert result == "changed" and took < PROMPT_S, f"woke after {took:.1f}s: the notify was lost"
