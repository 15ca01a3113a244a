"""The master's OpenAPI document (master/http/openapi.py): every operation lists every status it can return,
each refusal with the error body and its codes, and the bearer scheme; the live ``/openapi.json`` (public,
as before) is that document; and each refusal the document lists for the node API is one a real master
(uvicorn on 127.0.0.1) really gives. That no master answers a status the document lacks is the fuzzer's
job (tests/e2e/test_api_fuzz.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e import wait_until
from fastapi import FastAPI
from fastapi.routing import APIRoute

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import API_PREFIX, JOB_HEADER, MAX_BODY_BYTES, NODE_SECRET_HEADER
from master.http.app import create_app
from master.http.openapi import BEARER, ERROR_SCHEMA, OPERATIONS, complete, describe, gated, uncovered
from master.http.serving import EmbeddedMaster
from master.service.service import MasterService
from master.service.settings import ServerSettings

pytestmark = pytest.mark.timeout(60)

TOKEN = "openapi-token"
JOB = "job-openapi"
AUTH = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: JOB}


def settings() -> ServerSettings:
    job = JobSettings(
        job_id=JOB, min_nodes=1, max_nodes=2, last_call_s=0.0, heartbeat_timeout_s=600.0, flap_limit=1
    )
    return ServerSettings(job=job, token=TOKEN, host="127.0.0.1", port=0)


def app() -> FastAPI:
    return create_app(MasterService(settings()))


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield method, path, operation


def test_every_route_of_the_master_has_a_row():
    """A new route fails here until master/http/openapi.py says what it can answer."""
    application = app()
    routes = {
        (method.lower(), route.path)
        for route in application.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    }
    assert routes - set(OPERATIONS) == set(), "add these routes to master/http/openapi.py OPERATIONS"
    assert uncovered(application.openapi()) == []
    assert set(OPERATIONS) - routes == set(), "OPERATIONS lists routes the master no longer has"


def test_every_operation_lists_every_status_with_the_error_body_and_the_bearer_scheme():
    document = app().openapi()
    assert document["components"]["securitySchemes"][BEARER] == {
        **document["components"]["securitySchemes"][BEARER],
        "type": "http",
        "scheme": "bearer",
    }
    assert document["security"] == [{BEARER: []}]
    assert ERROR_SCHEMA in document["components"]["schemas"]
    assert "HTTPValidationError" not in document["components"]["schemas"]  # FastAPI's, never sent
    for method, path, operation in operations(document):
        row = describe(method, path)
        responses = operation["responses"]
        expected = {str(r.status) for r in row.refusals} | {str(a.status) for a in row.answers}
        expected |= {"200"} if row.ok else set()
        assert set(responses) == expected, f"{method} {path}"
        for refusal in row.refusals:
            schema = responses[str(refusal.status)]["content"]["application/json"]["schema"]
            assert {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"} in schema["allOf"], f"{method} {path}"
            codes = [part["properties"]["error"]["enum"] for part in schema["allOf"] if "properties" in part]
            assert refusal.code in codes[0], f"{method} {path} {refusal.status}"
            if refusal.challenge:
                assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True
        names = {p["name"].lower() for p in operation.get("parameters", []) if p["in"] == "header"}
        assert "authorization" not in names  # the security scheme describes it
        if gated(path):
            assert "security" not in operation  # the document's bearer scheme applies
            job = next(p for p in operation["parameters"] if p["name"] == JOB_HEADER)
            assert job["required"] is True
            assert {"401", "409", "413", "429", "503"} <= set(responses), f"{method} {path}"
        else:
            assert JOB_HEADER.lower() not in names  # only the gate reads it
    node_api = {"round": "get", "heartbeat": "post", "watch": "get", "leave": "post"}
    for name, method in node_api.items():
        operation = document["paths"][f"{API_PREFIX}/{name}"][method]
        assert {"200", "401", "403", "404", "409", "413", "422", "429", "503"} == set(
            operation["responses"]
        ), name
        assert NODE_SECRET_HEADER in {p["name"] for p in operation["parameters"]}
    join = document["paths"][f"{API_PREFIX}/join"]["post"]["responses"]["409"]["content"]["application/json"]
    assert join["schema"]["allOf"][1]["properties"]["error"]["enum"] == [
        "wrong_job",
        "settings_mismatch",
        "node_excluded",
        "duplicate_node",
    ]


@pytest.fixture
def master() -> Iterator[EmbeddedMaster]:
    server = EmbeddedMaster(settings()).start()
    try:
        yield server
    finally:
        server.stop()


def test_the_live_document_is_the_completed_one_and_needs_no_token(master: EmbeddedMaster):
    with httpx.Client(base_url=f"http://{master.address}", trust_env=False) as http:
        served = http.get("/openapi.json")  # public, as before: it holds no job data
    assert served.status_code == 200
    assert served.json() == json.loads(json.dumps(complete(FastAPI.openapi(app()))))


def test_each_refusal_the_document_lists_for_the_node_api_is_real(master: EmbeddedMaster):
    """Provoke every (status, code) the document lists for /v1 (but 503 not_leader, which needs a standby,
    see tests/e2e/test_master_failover_e2e.py, and 429 after 20 wrong tokens,
    tests/integration/test_conn_guard.py) and check the reply's code is one the document lists for that
    status. node_excluded: a node that flaps (--flap-limit 1) out of the job."""
    document = FastAPI.openapi(app())
    document = complete(document)
    seen: dict[tuple[str, str], set[tuple[int, str]]] = {}
    with httpx.Client(base_url=f"http://{master.address}", trust_env=False, timeout=30.0) as http:

        def call(method: str, name: str, headers: dict[str, str] | None = None, **kwargs: Any):
            response = http.request(method, f"{API_PREFIX}/{name}", headers=headers or AUTH, **kwargs)
            name = "nodes/{node_id}/readmit" if name.startswith("nodes/") else name  # the path's template
            doc = document["paths"][f"{API_PREFIX}/{name}"][method.lower()]["responses"]
            assert str(response.status_code) in doc, (name, response.status_code, response.text)
            if response.status_code != 200:
                schema = doc[str(response.status_code)]["content"]["application/json"]["schema"]
                assert response.json()["error"] in schema["allOf"][1]["properties"]["error"]["enum"]
            key = (method.lower(), f"{API_PREFIX}/{name}")
            seen.setdefault(key, set()).add((response.status_code, response.json().get("error", "")))
            return response

        join = {"node_id": "a", "host": "127.0.0.1", "nproc": 1, "store_port": 29500, "min_nodes": 1,
                "max_nodes": 2}  # fmt: skip
        secret = call("POST", "join", json=join).json()["node_secret"]
        mine = {**AUTH, NODE_SECRET_HEADER: secret}
        wrong = {**AUTH, NODE_SECRET_HEADER: "x" + secret}
        beat = {"node_id": "a", "round": 0, "state": "waiting"}
        poll = {"node_id": "a", "timeout": 0}
        requests = {  # name: (method, a request that succeeds, one the model refuses)
            "info": ("GET", {}, None),
            "status": ("GET", {}, None),
            "join": ("POST", {"json": join}, {"json": {**join, "nproc": 0}}),
            "round": ("GET", {"params": poll}, {"params": {**poll, "timeout": -1}}),
            "heartbeat": ("POST", {"json": beat}, {"json": {**beat, "state": "dancing"}}),
            "watch": ("GET", {"params": {**poll, "round": 0}}, {"params": {"node_id": "a"}}),
            "leave": ("POST", {"json": {"node_id": "a"}}, {"json": {"node_id": "a", "extra": 1}}),
            # The agent stream: 426 without the upgrade (its 101: tests/integration/test_agent_stream.py).
            "stream": ("GET", {}, None),
        }
        for name, (method, good, bad) in requests.items():
            call(method, name, {"Authorization": "Bearer nope", JOB_HEADER: JOB}, **good)
            call(method, name, {**AUTH, JOB_HEADER: "another-job"}, **good)
            call(method, name, mine, content=b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}")
            if bad is not None:
                call(method, name, mine, **bad)
            if method == "POST":  # JSON that is not UTF-8 text: FastAPI's bare 400 before the fix
                call(method, name, mine, content=b'{"node_id": "\xff"}')
            if name in ("info", "status", "stream"):
                call(method, name, AUTH, **good)
            if name in ("round", "heartbeat", "watch"):
                call(method, name, wrong, **good)
                ghost = json.loads(json.dumps(good).replace('"a"', '"ghost"'))
                call(method, name, mine, **ghost)
                call(method, name, mine, **good)
        call("POST", "join", AUTH, json={**join, "max_nodes": 3})  # settings_mismatch
        call("POST", "join", AUTH, json=join)  # node a is alive and this join lacks its secret
        call("POST", "leave", AUTH, json={"node_id": "ghost"})
        call("POST", "leave", wrong, json={"node_id": "a"})
        call("POST", "leave", mine, json={"node_id": "a"})

        def agent_dies(node_secret: str) -> None:
            """The agent holding ``node_secret`` for node f dies: its long-poll's connection closes."""
            before = suspects()
            with pytest.raises(httpx.ReadTimeout):
                http.get(f"{API_PREFIX}/round", params={"node_id": "f", "after": 10**6, "timeout": 30},
                         headers={**AUTH, NODE_SECRET_HEADER: node_secret}, timeout=0.5)  # fmt: skip
            wait_until(lambda: suspects() > before, 20.0, "the master never noticed the closed long-poll")

        def suspects() -> int:
            events = http.get(f"{API_PREFIX}/status", headers=AUTH).json()["events"]
            return sum(
                1 for e in events if e["kind"] == "node_suspect" and e["message"].startswith("node f ")
            )

        flappy = {**join, "node_id": "f"}
        agent_dies(call("POST", "join", AUTH, json=flappy).json()["node_secret"])
        agent_dies(call("POST", "join", AUTH, json=flappy).json()["node_secret"])  # a restart: one flap
        excluded = call("POST", "join", AUTH, json=flappy)  # a second: more than --flap-limit 1
        assert excluded.json()["error"] == "node_excluded" and "for flapping" in excluded.json()["message"]
        readmit = "nodes/f/readmit"
        call("POST", readmit, {"Authorization": "Bearer nope", JOB_HEADER: JOB})
        call("POST", readmit, {**AUTH, JOB_HEADER: "another-job"})
        call("POST", readmit, AUTH, content=b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}")
        call("POST", f"nodes/{'x' * 129}/readmit", AUTH)  # over the 128 characters of a node id
        call("POST", "nodes/ghost/readmit", AUTH)
        call("POST", readmit, AUTH)
        call("POST", "join", AUTH, json=flappy)  # accepted again
    for method, path, _ in operations(document):
        if not gated(path):
            continue
        row = describe(method, path)
        listed = {(r.status, r.code) for r in row.refusals} - {(503, "not_leader"), (429, "unauthorized")}
        got = {(status, code) for status, code in seen[(method, path)] if status != 200}
        assert got == listed, f"{method} {path}: provoked {sorted(got)}, the document lists {sorted(listed)}"
        if row.ok:  # the stream's success is its 101 (no 200): tests/integration/test_agent_stream.py
            assert (200, "") in seen[(method, path)], f"{method} {path} never succeeded"
