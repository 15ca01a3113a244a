"""Stateful, schema-driven fuzzing of a real ``elastic-master`` process over a real socket (issue 16).

Every request comes from the master's own OpenAPI document (``/openapi.json``): schemathesis turns each
operation into a hypothesis strategy, positive (valid by the schema) or negative (invalid). A hypothesis
rule-based state machine (:class:`ApiMachine`) plays a fleet of nodes with them: a join that succeeds puts
its node id and ``node_secret`` in a bundle, and later requests for that node (round, heartbeat, watch,
leave, rejoin) carry the secret in ``X-Elastic-Node-Secret``, so that the requests reach the job's logic
instead of stopping at 404. Other rules send generated requests of any operation, and batches of requests
the master must refuse (no or a wrong token, another job, an oversized or malformed body, a wrong or
missing node secret, a duplicate join, data the schema forbids).

Every response goes through schemathesis' conformance checks against the document (no 5xx, a documented
status, a documented content type, headers and body schema), and every refusal must have the expected
status. A batch of refusals runs while no valid request does, between two *quiet* snapshots of
``GET /v1/status``; every snapshot taken during and after the batch must equal the one before (see
:func:`stable_view` for the fields left out). A master that dies or drops a connection is a crash; it is
restarted, and so is a master whose job ended (nothing but "the job is over" would be left to reach).
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import http.cookies
import json
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from bench import common as c
from elastic.protocol import API_PREFIX, JOB_HEADER, LONG_POLL_CAP_S, MAX_BODY_BYTES, NODE_SECRET_HEADER
from master.job import AGGREGATE_PERIOD_S
from master.ui import CSRF_COOKIE, SESSION_COOKIE

#: The fuzzed job: nodes join 1 to 3 at a time, a round closes at once (no last call), nobody is declared
#: dead and the rendezvous never times out while the fuzz runs (those are time-driven transitions: one
#: that fell into a batch of refusals would look like a refusal that changed the state), and the restart
#: budget is never spent (failures keep reopening rounds instead of ending the job).
MIN_NODES, MAX_NODES = 1, 3
MASTER_ARGS = (
    "--nnodes", f"{MIN_NODES}:{MAX_NODES}",
    "--last-call", "0",
    "--heartbeat-interval", "1",
    "--heartbeat-timeout", "3600",
    "--join-timeout", "3600",
    "--max-restarts", "1000000",
)  # fmt: skip
#: Long-poll timeouts the fuzz asks for (seconds): small, so that the run is fast.
POLL_TIMEOUTS = (0.0, 0.001, 0.01, 0.05)
#: A snapshot of the status is quiet once it held this long: past the master's periodic recomputation of
#: the committed step and the straggler flags (master.job.AGGREGATE_PERIOD_S), plus a tick.
QUIET_S = AGGREGATE_PERIOD_S + 0.25
#: Status fields that move with time alone: heartbeat and event ages, and the goodput ratio (training time
#: over wall time). They are left out when two snapshots are compared.
TIME_FIELDS = frozenset({"heartbeat_age_s", "age_s", "goodput_ratio"})
REQUEST_TIMEOUT_S = LONG_POLL_CAP_S + 10
START_TIMEOUT_S = 60.0
#: Kinds of requests in a batch of refusals.
REFUSAL_KINDS = (
    "no_token",
    "wrong_token",
    "wrong_job",
    "too_large",
    "malformed_body",
    "negative",
    "settings_mismatch",
    "unknown_node",
    "wrong_secret",
    "duplicate_join",
    "no_session",
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
NODE_OPS = ("round", "heartbeat", "watch", "leave")
#: The node and script API: what the gate guards.
API_OPS = ("info", "join", *NODE_OPS, "status")
METRICS = "GET /metrics"
UI_READS = ("GET /ui", "GET /ui/login", "GET /ui/status", "GET /ui/{name}")
UI_LOGIN = "POST /ui/login"
FAILURES_KEPT = 20


def stable_view(status: dict[str, Any]) -> Any:
    """``status`` without :data:`TIME_FIELDS`, at any depth."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIME_FIELDS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(status)


# -- what a run found ---------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Counts of one fuzz run and the first few failures, described."""

    requests: int = 0
    authorized: int = 0  # with the right token and job id
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    server_errors: int = 0
    crashes: int = 0
    failures: Counter = field(default_factory=Counter)  # by kind
    examples: list[str] = field(default_factory=list)
    masters: int = 0
    refusal_batches: int = 0
    refusals: Counter = field(default_factory=Counter)  # by kind
    state_checks: int = 0  # quiet snapshots compared with the one before a batch
    skipped_batches: int = 0
    flaky_runs: int = 0  # hypothesis runs ended early (see run_fuzz)

    def note(self, operation: str, status: int, authorized: bool) -> None:
        self.requests += 1
        self.authorized += authorized
        self.statuses[operation][status] += 1
        if status >= 500:
            self.server_errors += 1

    def fail(self, kind: str, text: str) -> None:
        self.failures[kind] += 1
        if len(self.examples) < FAILURES_KEPT:
            self.examples.append(f"[{kind}] {text}")

    def successes(self, operation: str) -> int:
        """Answers that did what was asked: 2xx (and the login's redirect, its only success)."""
        return sum(
            n
            for status, n in self.statuses[operation].items()
            if 200 <= status < 300 or (operation == UI_LOGIN and status == 303)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "authorized": self.authorized,
            "unauthorized": self.requests - self.authorized,
            "statuses": {op: {str(s): n for s, n in sorted(c.items())} for op, c in self.statuses.items()},
            "server_errors": self.server_errors,
            "crashes": self.crashes,
            "failures": dict(self.failures),
            "examples": self.examples,
            "masters": self.masters,
            "refusal_batches": self.refusal_batches,
            "refusals": dict(self.refusals),
            "state_checks": self.state_checks,
            "skipped_batches": self.skipped_batches,
            "flaky_runs": self.flaky_runs,
        }


@dataclass
class NodeBook:
    """What the fleet knows about one node id it joined."""

    secret: str | None
    round: int = 0  # the newest round it was assigned


# -- the master under test ----------------------------------------------------------------------------------
class Target:
    """One ``elastic-master`` process at a time (restarted when it crashed or its job ended), the HTTP
    session to it, the operations of its document, what the fleet knows, and the tally."""

    def __init__(self, folder: Path, group: c.Group, tally: Tally) -> None:
        self.folder, self.group, self.tally = folder, group, tally
        self.job = f"fuzz-{uuid.uuid4().hex[:8]}"
        self.token_file = folder / "token"
        self.master: c.Launched | None = None
        self.base_url = ""
        self.token = ""
        self.session = requests.Session()
        self.session.trust_env = False  # never a proxy for 127.0.0.1
        # No cookie is kept between requests: each request says which it sends (the status page's).
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        self.ui_session: str | None = None  # the status page's session cookie, once logged in
        self.nodes: dict[str, NodeBook] = {}
        self.over = False  # the job has an outcome: restart the master before the next example
        self._ids = 0
        self.start()
        self.document = self.session.get(self.base_url + "/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
        self.schema = schemathesis.openapi.from_dict(self.document)
        self.operations = {
            _name(method, path): self.schema[path][method.upper()]
            for path, item in self.document["paths"].items()
            for method in item
        }
        self.credentials = (
            bool(NODE_SECRET_HEADER)
            and "node_secret" in (self.document["components"]["schemas"]["JoinReply"]["properties"])
        )
        self._strategies: dict[tuple[str, GenerationMode], st.SearchStrategy] = {}

    # -- the process ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start a master (a fresh job) and wait until it listens."""
        if self.master is not None:
            self.master.kill()
        self.tally.masters += 1
        argv = c.master_argv() + [
            "--host", "127.0.0.1", "--port", "0", "--job-id", self.job,
            "--token-file", str(self.token_file), *MASTER_ARGS,
        ]  # fmt: skip
        master = self.group.launch(argv, f"master-{self.tally.masters}")
        self.master = master
        found = c.wait_until(
            lambda: re.search(r"listening on 127\.0\.0\.1:(\d+)", master.output()) or not master.alive(),
            START_TIMEOUT_S,
            interval=0.05,
        )
        if not isinstance(found, re.Match):
            raise RuntimeError(f"elastic-master did not start: {master.output()[-2000:]}")
        self.base_url = f"http://127.0.0.1:{found.group(1)}"
        self.token = self.token_file.read_text().strip()
        self.nodes.clear()
        self.over = False
        self.ui_session = None
        # The job exists once the master leads (at once with the memory store): wait for a status.
        c.wait_until(lambda: self._status_code() == 200, START_TIMEOUT_S, interval=0.05)

    def _status_code(self) -> int:
        with contextlib.suppress(requests.RequestException):
            return self.session.get(
                self.base_url + "/v1/status", headers=self.headers(), timeout=REQUEST_TIMEOUT_S
            ).status_code
        return 0

    def crashed(self, what: str, exc: Exception) -> None:
        alive = self.master is not None and self.master.alive()
        self.tally.crashes += 1
        tail = "" if alive else f"; master exited, its output ends: {self.master.output()[-1500:]}"
        self.tally.fail("crash", f"{what}: {type(exc).__name__}: {exc}{tail}")
        self.start()

    # -- requests -------------------------------------------------------------------------------------------
    def headers(self, *, token: str | None = "", job: str | None = "", secret: str | None = None) -> dict:
        """Request headers: ``""`` means the right token/job, None leaves the header out."""
        out = {}
        if token is not None:
            out["Authorization"] = f"Bearer {token or self.token}"
        if job is not None:
            out[JOB_HEADER] = job or self.job
        if secret is not None:
            out[NODE_SECRET_HEADER] = secret
        return out

    def fresh_id(self) -> str:
        self._ids += 1
        return f"n{self._ids}"

    def strategy(self, name: str, mode: GenerationMode = GenerationMode.POSITIVE) -> st.SearchStrategy:
        """Cases of operation ``name`` from the document. The headers are fixed (each request sets its own),
        so that a negative case is wrong in its query or body, which the gate does not look at."""
        key = (name, mode)
        if key not in self._strategies:
            fixed = {JOB_HEADER: self.job} | ({NODE_SECRET_HEADER: "s"} if self.credentials else {})
            self._strategies[key] = self.operations[name].as_strategy(generation_mode=mode, headers=fixed)
        return self._strategies[key]

    def send(
        self,
        case: schemathesis.Case,
        headers: dict[str, str],
        *,
        expect: Callable[[int], bool] | None = None,
        raw: bytes | None = None,
        content_type: str = "application/json",
        cookies: dict[str, str] | None = None,
        negative: bool = False,
    ) -> schemathesis.Response | None:
        """Send ``case`` (with exactly ``headers`` and ``cookies``; ``raw`` replaces its body), check the
        response against the document and ``expect``; None when the connection failed (a crash)."""
        operation = f"{case.method.upper()} {case.path}"
        case.headers = dict(headers)
        try:
            if raw is None:
                response = case.call(
                    base_url=self.base_url, session=self.session, cookies=cookies, timeout=REQUEST_TIMEOUT_S
                )
            else:
                sent = self.session.request(
                    case.method,
                    self.base_url + case.formatted_path,
                    params=case.query,
                    headers={**headers, "Content-Type": content_type},
                    cookies=cookies,
                    data=raw,
                    timeout=REQUEST_TIMEOUT_S,
                    allow_redirects=False,
                )
                response = schemathesis.Response.from_requests(sent, verify=True)
        except requests.RequestException as exc:
            self.crashed(operation, exc)
            return None
        if operation.startswith("GET /ui") or operation.startswith("POST /ui"):
            authorized = bool(cookies) and cookies.get(SESSION_COOKIE) == self.ui_session
        else:
            authorized = headers.get("Authorization") == f"Bearer {self.token}" and (
                headers.get(JOB_HEADER) == self.job or not case.path.startswith(API_PREFIX)
            )
        self.tally.note(operation, response.status_code, authorized)
        checks = CHECKS + ([negative_data_rejection] if negative else [])
        try:
            case.validate_response(response, checks=checks, headers=headers)
        except (AssertionError, FailureGroup) as exc:
            self.tally.fail(
                "conformance",
                f"{operation} -> {response.status_code}: {_first_line(exc)}; "
                f"request {_describe(case, raw)}; reply {response.text[:300]}",
            )
        if expect is not None and not expect(response.status_code):
            self.tally.fail(
                "refusal",
                f"{operation} -> {response.status_code} {response.text[:300]}; "
                f"request {_describe(case, raw)} headers {sorted(headers)}",
            )
        return response

    def ui_login(self, how: str) -> None:
        """The status page's login: get the form, post it (``how``: ``ok``, ``wrong_token``, ``wrong_csrf``,
        ``too_large`` or ``too_many_fields``); a good login keeps the session cookie for later requests."""
        form = self.send(self.operations["GET /ui/login"].Case(), {})
        if form is None or form.status_code != 200:
            return
        found = re.search(r'name="csrf" value="([^"]+)"', form.text)
        csrf_cookie = _cookie(form, CSRF_COOKIE) or ""
        fields = {"csrf": found.group(1) if found else "", "token": self.token}
        if how == "wrong_token":
            fields["token"] = "x" + self.token
        elif how == "wrong_csrf":
            fields["csrf"] = "x" + fields["csrf"]
        elif how == "too_large":
            fields["pad"] = "x" * 5000
        elif how == "too_many_fields":
            fields.update({f"f{i}": "1" for i in range(4)})
        expect = 303 if how == "ok" else {"wrong_token": 401, "wrong_csrf": 403}.get(how, 413)
        response = self.send(
            self.operations[UI_LOGIN].Case(),
            {},
            raw=urlencode(fields).encode(),
            content_type="application/x-www-form-urlencoded",
            cookies={CSRF_COOKIE: csrf_cookie},
            expect=lambda s: s == expect,
        )
        if response is not None and response.status_code == 303:
            self.ui_session = _cookie(response, SESSION_COOKIE) or self.ui_session

    def status(self) -> dict[str, Any] | None:
        """``GET /v1/status`` (counted and checked like any request)."""
        case = self.operations["status"].Case()
        response = self.send(case, self.headers())
        if response is None or response.status_code != 200:
            return None
        data = response.json()
        self.over = data.get("outcome") is not None
        return data

    def quiet_status(self, before: Any | None = None) -> tuple[Any | None, list[str]]:
        """Poll the status until it held still for :data:`QUIET_S`; return that view and, with ``before``,
        how every snapshot on the way differed from it."""
        deadline = time.monotonic() + 30.0
        diffs: list[str] = []
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            data = self.status()
            view = stable_view(data) if data is not None else None
            if before is not None and view != before:
                diffs.append(_diff(before, view))
            if view != last:
                last, since = view, time.monotonic()
            elif time.monotonic() - since >= QUIET_S:
                return view, diffs
            time.sleep(0.05)  # a quiet period is what is measured here: there is nothing to wait on
        return None, diffs


def _cookie(response: schemathesis.Response, name: str) -> str | None:
    """The value of cookie ``name`` that ``response`` sets, if any."""
    for header in response.headers.get("set-cookie", []):
        jar = http.cookies.SimpleCookie(header)
        if name in jar:
            return jar[name].value
    return None


def _name(method: str, path: str) -> str:
    """A short name for an operation: ``join`` for ``POST /v1/join``, ``GET /ui/status`` for the rest."""
    if path.startswith(API_PREFIX + "/"):
        return path.removeprefix(API_PREFIX + "/")
    return f"{method.upper()} {path}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(lines[:4])[:400]


def _describe(case: schemathesis.Case, raw: bytes | None) -> str:
    body = raw[:120] if raw is not None else json.dumps(case.body, default=str)[:300] if case.body else ""
    return f"query={case.query} body={body!r}"


def _diff(before: Any, after: Any) -> str:
    if not isinstance(before, dict) or not isinstance(after, dict):
        return f"{before!r} -> {after!r}"[:400]
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys)[:600]


# -- the state machine --------------------------------------------------------------------------------------
VALID_HOSTS = st.sampled_from(["127.0.0.1", "10.0.0.7", "::1", "node-3.cluster.local", "gpu12"])
#: Operations whose request has a body or query parameters: what negative (schema-violating) data targets.
WITH_INPUT = ("join", *NODE_OPS)
MALFORMED_BODIES = (
    b"", b"{", b"null", b"[]", b"42", b'"text"', b"\xff\xfe\x00garbage", b"{'node_id': 1}", b"[" * 20000,
    b'{"node_id": "a", "node_id": ', b"\x00",
)  # fmt: skip
EDGE_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 40)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True once in ``n`` draws (on average)."""
    return st.integers(0, n - 1).map(lambda i: i == 0)


class ApiMachine(RuleBasedStateMachine):
    """A fleet of nodes speaking to the master, plus batches of requests the master must refuse."""

    target: Target  # set by :func:`machine_for`, with the two below
    batch_gap = 30  # valid steps between two batches of refusals
    batch_size = 40
    nodes = Bundle("nodes")

    def __init__(self) -> None:
        super().__init__()
        self.steps_since_batch = 0

    # -- the fleet ------------------------------------------------------------------------------------------
    @initialize(target=nodes)
    def fleet(self):
        """Nodes that joined in earlier examples are still in the master: start from them (or from a new
        master if the job ended)."""
        t = self.target
        if t.over or t.master is None or not t.master.alive():
            t.start()
        return multiple(*t.nodes)

    def _draw(self, data, name: str) -> schemathesis.Case:
        self.steps_since_batch += 1
        return data.draw(self.target.strategy(name), label=name)

    @rule(target=nodes, data=st.data())
    def join(self, data):
        """A new node (mostly), with the job's --nnodes and a host name (mostly)."""
        t = self.target
        case = self._draw(data, "join")
        body = dict(case.body)
        if not data.draw(one_in(5)):
            body["node_id"] = t.fresh_id()
        if not data.draw(one_in(10)):
            body["min_nodes"], body["max_nodes"] = MIN_NODES, MAX_NODES
        if not data.draw(one_in(10)):
            body["host"] = data.draw(VALID_HOSTS)
        case.body = body
        return self._joined(body["node_id"], t.send(case, t.headers()))

    @rule(target=nodes, node=nodes, data=st.data())
    def rejoin(self, node, data):
        """A node's agent joins again with its secret (after its workers failed, or told to rejoin)."""
        t = self.target
        case = self._draw(data, "join")
        case.body = dict(case.body, node_id=node, min_nodes=MIN_NODES, max_nodes=MAX_NODES)
        case.body["host"] = data.draw(VALID_HOSTS)
        book = t.nodes.get(node)
        return self._joined(node, t.send(case, t.headers(secret=book.secret if book else None)))

    def _joined(self, node: str, response: schemathesis.Response | None):
        if response is None or response.status_code != 200:
            return multiple()
        secret = response.json().get("node_secret") or None
        book = self.target.nodes.get(node)
        if book is None or secret != book.secret:
            self.target.nodes[node] = NodeBook(secret)
        return node

    def _node_headers(self, node: str, data) -> dict[str, str]:
        """The node's own secret, nearly always; now and then a wrong or no secret (refused with 403)."""
        book = self.target.nodes.get(node)
        secret = book.secret if book else None
        choice = data.draw(st.integers(0, 19), label="secret")
        if choice == 0:
            secret = None
        elif choice == 1:
            secret = "wrong-" + (secret or "secret")
        return self.target.headers(secret=secret)

    @rule(node=nodes, data=st.data())
    def next_round(self, node, data):
        """The round long-poll, mostly for a round newer than the node's last assignment."""
        t = self.target
        case = self._draw(data, "round")
        book = t.nodes.get(node)
        after = case.query.get("after", 0)
        if book is not None and not data.draw(one_in(4)):
            after = book.round
        case.query = {"node_id": node, "after": after, "timeout": data.draw(st.sampled_from(POLL_TIMEOUTS))}
        response = t.send(case, self._node_headers(node, data))
        if response is not None and response.status_code == 200:
            reply = response.json()
            if reply.get("assignment") and book is not None:
                book.round = reply["assignment"]["round"]
            t.over = t.over or reply.get("status") == "finished"

    @rule(node=nodes, data=st.data())
    def heartbeat(self, node, data):
        """A heartbeat with generated content for the node's round (mostly). A success is rare (the job
        ends once every member reported one), and so is a failure (it reopens the round)."""
        t = self.target
        case = self._draw(data, "heartbeat")
        body = dict(case.body, node_id=node)
        book = t.nodes.get(node)
        if book is not None and not data.draw(one_in(5)):
            body["round"] = book.round
        if body.get("state") == "succeeded" and not data.draw(one_in(20)):
            body["state"] = "running"
        if body.get("state") == "failed" and not data.draw(one_in(3)):
            body["state"] = "running"
        case.body = body
        response = t.send(case, self._node_headers(node, data))
        if response is not None and response.status_code == 200 and response.json().get("command") == "stop":
            t.over = True

    @rule(node=nodes, data=st.data())
    def heartbeat_edge_numbers(self, node, data):
        """Numbers that JSON parsers disagree on (NaN, Infinity, 1e999, a 41-digit integer) where the model
        takes a number: Python's json module reads them all, so the master must cope."""
        self.steps_since_batch += 1
        t = self.target
        book = t.nodes.get(node)
        edge = data.draw(st.sampled_from(EDGE_NUMBERS), label="number")
        where = data.draw(st.sampled_from(["step_time_s", "compute_time_s", "step", "ckpt_step", "round"]))
        worker = {"local_rank": 0, "step": 1, "step_time_s": 0.1}
        body = {"node_id": node, "round": book.round if book else 0, "state": "running", "workers": [worker]}
        (worker if where in worker or where == "compute_time_s" else body)[where] = "@EDGE@"
        raw = json.dumps(body).replace('"@EDGE@"', edge).encode()
        t.send(t.operations["heartbeat"].Case(), self._node_headers(node, data), raw=raw)

    @rule(node=nodes, data=st.data())
    def watch(self, node, data):
        t = self.target
        case = self._draw(data, "watch")
        book = t.nodes.get(node)
        node_round = case.query["round"]
        if book is not None and not data.draw(one_in(4)):
            node_round = book.round
        timeout = data.draw(st.sampled_from(POLL_TIMEOUTS))
        case.query = {"node_id": node, "round": node_round, "timeout": timeout}
        t.send(case, self._node_headers(node, data))

    @rule(node=consumes(nodes), data=st.data())
    def leave(self, node, data):
        t = self.target
        case = self._draw(data, "leave")
        case.body = dict(case.body, node_id=node)
        response = t.send(case, self._node_headers(node, data))
        if response is not None and response.status_code == 200:
            t.nodes.pop(node, None)

    @rule(data=st.data())
    def read(self, data):
        """An observer: the job's settings and status, Prometheus' scrape (the token, no job header), and
        the status page with its data and files (with the session cookie, mostly, once logged in)."""
        t = self.target
        for name in ("info", "status"):
            t.send(self._draw(data, name), t.headers())
        t.send(self._draw(data, METRICS), {"Authorization": f"Bearer {t.token}"})
        for name in UI_READS:
            case = self._draw(data, name)
            if name == "GET /ui/{name}":
                files = ["app.js", "app.css", case.path_parameters["name"]]
                case.path_parameters = {"name": data.draw(st.sampled_from(files), label="file")}
            cookies = None
            if t.ui_session and not data.draw(one_in(5)):
                cookies = {SESSION_COOKIE: t.ui_session}
            t.send(case, {}, cookies=cookies)

    @rule(data=st.data())
    def agent(self, data):
        """What an agent does, in one step: join under a new id, poll for its round, heartbeat, watch.
        (Hypothesis tries the simplest example first, which repeats the first rule: let it be this one.)"""
        t = self.target
        node = self._joined_fresh(data)
        if node is None:
            return
        book = t.nodes[node]
        poll = {"node_id": node, "after": 0, "timeout": POLL_TIMEOUTS[-1]}
        reply = t.send(t.operations["round"].Case(query=poll), t.headers(secret=book.secret))
        if reply is not None and reply.status_code == 200 and reply.json().get("assignment"):
            book.round = reply.json()["assignment"]["round"]
        beat = {"node_id": node, "round": book.round, "state": "running" if book.round else "waiting"}
        t.send(t.operations["heartbeat"].Case(body=beat), t.headers(secret=book.secret))
        watch = {"node_id": node, "round": book.round, "timeout": POLL_TIMEOUTS[1]}
        t.send(t.operations["watch"].Case(query=watch), t.headers(secret=book.secret))

    def _joined_fresh(self, data) -> str | None:
        t = self.target
        case = self._draw(data, "join")
        node = t.fresh_id()
        case.body = dict(case.body, node_id=node, min_nodes=MIN_NODES, max_nodes=MAX_NODES)
        case.body["host"] = data.draw(VALID_HOSTS)
        response = t.send(case, t.headers())
        return node if self._joined(node, response) == node else None

    @rule(name=st.sampled_from(WITH_INPUT), data=st.data())
    def any_request(self, name, data):
        """A request as the schema generates it (for node ids nobody joined as, mostly)."""
        t = self.target
        case = self._draw(data, name)
        if "timeout" in (case.query or {}):
            case.query = dict(case.query, timeout=data.draw(st.sampled_from(POLL_TIMEOUTS)))
        response = t.send(case, t.headers())
        if name == "join":
            self._joined(case.body["node_id"], response)

    @rule(
        how=st.sampled_from(["ok", "ok", "ok", "wrong_token", "wrong_csrf", "too_large", "too_many_fields"])
    )
    def ui_login(self, how):
        self.steps_since_batch += 1
        self.target.ui_login(how)

    # -- refusals -------------------------------------------------------------------------------------------
    @precondition(lambda self: self.steps_since_batch >= self.batch_gap)
    @rule(data=st.data())
    def refusals(self, data):
        """A batch of requests the master must refuse, between two quiet status snapshots that must be
        equal; no valid request runs meanwhile."""
        self.steps_since_batch = 0
        t = self.target
        before = self._quiesce()
        if before is None:
            t.tally.skipped_batches += 1
            return
        over = before["outcome"] is not None
        live = [n["node_id"] for n in before["nodes"] if n["node_id"] in t.nodes and n["state"] != "excluded"]
        kinds = []
        for _ in range(self.batch_size):
            kind = data.draw(st.sampled_from(REFUSAL_KINDS), label="refusal")
            if getattr(self, f"_refuse_{kind}")(data, over=over, live=live):
                t.tally.refusals[kind] += 1
                kinds.append(kind)
        t.tally.refusal_batches += 1
        after, diffs = t.quiet_status(before)
        t.tally.state_checks += 1
        if after is None or diffs:
            t.tally.fail(
                "state", f"GET /v1/status changed during refusals {kinds}: {diffs[:3] or 'never quiet'}"
            )

    def _quiesce(self) -> dict[str, Any] | None:
        """A quiet status before a batch. An open round that waits for its members closes when they rejoin,
        or when the rejoin timeout passes (a time-driven change, which could fall into the batch): so they
        rejoin first. None when no quiet status came."""
        t = self.target
        for _ in range(3):
            view, _ = t.quiet_status()
            if view is None or not (
                view["phase"] == "rendezvous" and view["outcome"] is None and view["nodes"]
            ):
                return view
            for row in view["nodes"]:
                book = t.nodes.get(row["node_id"])
                if book is None:
                    continue
                body = {
                    "node_id": row["node_id"], "host": "127.0.0.1", "nproc": 1, "store_port": 29500,
                    "min_nodes": MIN_NODES, "max_nodes": MAX_NODES,
                }  # fmt: skip
                self._joined(
                    row["node_id"],
                    t.send(t.operations["join"].Case(body=body), t.headers(secret=book.secret)),
                )
        return None

    def _generated(self, data, names: tuple[str, ...] | None = None, mode=GenerationMode.POSITIVE):
        t = self.target
        name = data.draw(st.sampled_from(names or API_OPS), label="operation")
        case = data.draw(t.strategy(name, mode), label=name)
        if mode is GenerationMode.POSITIVE and "timeout" in (case.query or {}):
            case.query = dict(case.query, timeout=0)
        return name, case

    def _refuse_no_token(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data)
        t.send(case, t.headers(token=None), expect=lambda s: s == 401)
        return True

    def _refuse_wrong_token(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data)
        wrong = data.draw(st.sampled_from([
            "Bearer x" + t.token, "Bearer " + t.token[:-1], "Basic " + t.token, "Bearer", "", t.token,
            "Token " + t.token, "Bearer " + t.token.upper(),
        ]), label="authorization")  # fmt: skip
        t.send(case, {**t.headers(), "Authorization": wrong}, expect=lambda s: s == 401)
        return True

    def _refuse_wrong_job(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data)
        job = data.draw(st.sampled_from([None, "", t.job + "x", t.job.upper(), "other"]), label="job")
        headers = t.headers(job=None)
        if job is not None:
            headers[JOB_HEADER] = job
        t.send(case, headers, expect=lambda s: s == 409)
        return True

    def _refuse_too_large(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data)
        size = data.draw(st.integers(MAX_BODY_BYTES + 1, 4 * MAX_BODY_BYTES), label="size")
        raw = json.dumps({"node_id": "n", "pad": "x" * size}).encode()
        t.send(case, t.headers(), expect=lambda s: s == 413, raw=raw)
        return True

    def _refuse_malformed_body(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data, ("join", "heartbeat", "leave"))
        raw = data.draw(st.sampled_from(MALFORMED_BODIES), label="body")
        t.send(case, t.headers(), expect=lambda s: s == 422, raw=raw)
        return True

    def _refuse_negative(self, data, live: list[str], **_) -> bool:
        """Data the schema forbids, with the right token (and a live node's secret)."""
        t = self.target
        name, case = self._generated(data, WITH_INPUT, GenerationMode.NEGATIVE)
        secret = None
        if name in NODE_OPS and live:
            secret = t.nodes[data.draw(st.sampled_from(live), label="node")].secret
        t.send(case, t.headers(secret=secret), expect=lambda s: 400 <= s < 500, negative=True)
        return True

    def _refuse_settings_mismatch(self, data, **_) -> bool:
        t = self.target
        _, case = self._generated(data, ("join",))
        low = data.draw(st.integers(1, 8), label="min")
        high = data.draw(
            st.integers(low, 9).filter(lambda h: (low, h) != (MIN_NODES, MAX_NODES)), label="max"
        )
        case.body = dict(case.body, min_nodes=low, max_nodes=high, host=data.draw(VALID_HOSTS))
        t.send(case, t.headers(), expect=lambda s: s == 409)
        return True

    def _refuse_unknown_node(self, data, over: bool, **_) -> bool:
        t = self.target
        name, case = self._generated(data, NODE_OPS)
        _aim(case, name, "ghost-" + uuid.uuid4().hex[:6])
        # Once the job is over a stranger is told so (stop, finished), like the node itself would be.
        expect = (lambda s: s in (200, 404)) if over else (lambda s: s == 404)
        t.send(case, t.headers(secret="not-a-secret"), expect=expect)
        return True

    def _wrong_secret(self, data, node: str) -> dict[str, str]:
        secret = self.target.nodes[node].secret or ""
        wrong = data.draw(
            st.sampled_from([None, "", "x" + secret, secret[:-1], secret.upper()]), label="secret"
        )
        return self.target.headers(secret=wrong)

    def _refuse_wrong_secret(self, data, over: bool, live: list[str]) -> bool:
        if over or not live or not self.target.credentials:
            return False
        name, case = self._generated(data, NODE_OPS)
        node = data.draw(st.sampled_from(live), label="node")
        _aim(case, name, node)
        self.target.send(case, self._wrong_secret(data, node), expect=lambda s: s == 403)
        return True

    def _refuse_duplicate_join(self, data, over: bool, live: list[str]) -> bool:
        """Another agent under a live node's id, without that node's secret."""
        if over or not live or not self.target.credentials:
            return False
        _, case = self._generated(data, ("join",))
        node = data.draw(st.sampled_from(live), label="node")
        case.body = dict(case.body, node_id=node, min_nodes=MIN_NODES, max_nodes=MAX_NODES, host="127.0.0.1")
        self.target.send(case, self._wrong_secret(data, node), expect=lambda s: s == 409)
        return True

    def _refuse_no_session(self, data, **_) -> bool:
        """The status page's data without a valid session cookie (none, forged, or another job's)."""
        t = self.target
        name = data.draw(st.sampled_from(["GET /ui", "GET /ui/status"]), label="operation")
        forged = data.draw(
            st.sampled_from([None, "", "1.abc", f"{2**40}.{'0' * 64}", (t.ui_session or "9.x") + "0"]),
            label="cookie",
        )
        cookies = None if forged is None else {SESSION_COOKIE: forged}
        expect = 303 if name == "GET /ui" else 401
        t.send(t.operations[name].Case(), {}, cookies=cookies, expect=lambda s: s == expect)
        return True


def _aim(case: schemathesis.Case, name: str, node: str) -> None:
    """Point a generated request of a node operation at ``node``."""
    if name in ("round", "watch"):
        case.query = dict(case.query, node_id=node)
    else:
        case.body = dict(case.body, node_id=node)


def machine_for(target: Target, batch_gap: int, batch_size: int) -> type[ApiMachine]:
    """The machine class for ``target`` (hypothesis builds one instance per example, without arguments)."""
    fields = {"target": target, "batch_gap": batch_gap, "batch_size": batch_size}
    return type("FuzzMachine", (ApiMachine,), fields)


# -- a run --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FuzzConfig:
    requests: int = 10_000
    seed: int = 0
    steps: int = 50  # steps of one example (a hypothesis stateful test case)
    examples: int = 25  # examples of one hypothesis run; runs repeat (next seed) until ``requests``
    batch_gap: int = 20
    batch_size: int = 60


def run_fuzz(config: FuzzConfig, folder: Path, progress: Callable[[str], None] = c.log) -> Tally:
    """Fuzz fresh masters until ``config.requests`` requests were sent; every process is killed at the end."""
    tally = Tally()
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        target = Target(folder, group, tally)
        machine = machine_for(target, config.batch_gap, config.batch_size)
        options = settings(
            max_examples=config.examples,
            stateful_step_count=config.steps,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # the master's state outlives an example: shrinking would mislead
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            verbosity=Verbosity.quiet,  # failures are tallied, not raised: nothing for hypothesis to print
        )
        for run in _runs():
            seed(config.seed * 1_000_003 + run)(machine)
            try:
                run_state_machine_as_test(machine, settings=options)
            except Flaky:
                # Draws depend on the master's answers: an example may start like an earlier one and then
                # draw differently, which hypothesis calls flaky. Start a new run, as schemathesis does.
                tally.flaky_runs += 1
            failures = sum(tally.failures.values())
            progress(f"fuzz: {tally.requests} requests, {tally.server_errors} 5xx, {failures} failures")
            if tally.requests >= config.requests:
                break
        target.session.close()
    return tally


def _runs() -> Iterator[int]:
    run = 0
    while True:
        yield run
        run += 1
