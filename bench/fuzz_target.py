"""The master under test for the API fuzzer (bench/fuzz_engine.py): one ``elastic-master`` process at a
time over a real socket, the HTTP session to it, every request sent and checked against the master's own
OpenAPI document, and quiet snapshots of ``GET /v1/status``."""

from __future__ import annotations

import contextlib
import http.cookiejar
import http.cookies
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests
import schemathesis
from hypothesis import strategies as st
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
from bench.fuzz_job import MASTER_ARGS, UI_LOGIN
from bench.fuzz_tally import Tally
from elastic.control.protocol import API_PREFIX, JOB_HEADER, LONG_POLL_CAP_S, NODE_SECRET_HEADER
from master.http.ui import CSRF_COOKIE, SESSION_COOKIE
from master.job.job import AGGREGATE_PERIOD_S

#: A snapshot of the status is quiet once it held this long: past the master's periodic recomputation of
#: the committed step and the straggler flags (master.job.job.AGGREGATE_PERIOD_S), plus a tick.
QUIET_S = AGGREGATE_PERIOD_S + 0.25
#: Status fields that move with time alone: heartbeat and event ages, the goodput ratio (training time
#: over wall time) and the badput seconds. They are left out when two snapshots are compared.
TIME_FIELDS = frozenset({"heartbeat_age_s", "age_s", "goodput_ratio", "badput_s"})
REQUEST_TIMEOUT_S = LONG_POLL_CAP_S + 10
START_TIMEOUT_S = 60.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def stable_view(status: dict[str, Any]) -> Any:
    """``status`` without :data:`TIME_FIELDS`, at any depth."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIME_FIELDS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(status)


@dataclass
class NodeBook:
    """What the fleet knows about one node id it joined."""

    secret: str | None
    round: int = 0  # the newest round it was assigned


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
            operation_name(method, path): self.schema[path][method.upper()]
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
        """Count a dropped connection (or a dead master) as a crash, and start a fresh master."""
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
        """A node id no request used yet."""
        self._ids += 1
        return f"n{self._ids}"

    def record_join(self, node: str, response: schemathesis.Response | None) -> bool:
        """Note what a join of ``node`` answered (a new secret starts a new book); True if it was admitted."""
        if response is None or response.status_code != 200:
            return False
        secret = response.json().get("node_secret") or None
        book = self.nodes.get(node)
        if book is None or secret != book.secret:
            self.nodes[node] = NodeBook(secret)
        return True

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
        # A wrong token is 401, or 429 once this address sent many wrong ones (counted with /v1 and /metrics).
        expect = {303} if how == "ok" else {"wrong_token": {401, 429}, "wrong_csrf": {403}}.get(how, {413})
        response = self.send(
            self.operations[UI_LOGIN].Case(),
            {},
            raw=urlencode(fields).encode(),
            content_type="application/x-www-form-urlencoded",
            cookies={CSRF_COOKIE: csrf_cookie},
            expect=lambda s: s in expect,
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


def operation_name(method: str, path: str) -> str:
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
