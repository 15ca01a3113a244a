"""The master's OpenAPI document, completed: every status each operation can return, with its error body,
and the bearer security scheme.

FastAPI derives the paths, parameters and models from the routes, but it knows neither the refusals of
:class:`master.http.gatekeeper.Gatekeeper` (an ASGI middleware that checks the token and the job id, and caps
the body, before anything is routed or parsed) nor the errors the job raises. :data:`OPERATIONS` lists, for
every operation, the statuses it can return besides ``200``; :func:`complete` adds them (each with an
:class:`~elastic.control.protocol.ErrorBody` whose ``error`` is one of the codes listed for that status), the
bearer scheme, and the required ``X-Elastic-Job`` header. :func:`install` makes the app serve that
document at ``/openapi.json``, built once on the first request.

A route that :data:`OPERATIONS` does not list still gets the refusals its path implies (the gate's under
``/v1``), but ``tests/integration/test_openapi.py`` fails until it has a row of its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import (
    API_PREFIX,
    JOB_HEADER,
    MAX_BODY_BYTES,
    NODE_SECRET_HEADER,
    STREAM_PATH,
    STREAM_UPGRADE,
    ErrorBody,
)
from master.http.rate_limits import FAILURE_LIMIT, FAILURE_WINDOW_S

#: Name of the security scheme in ``components.securitySchemes``.
BEARER = "bearerAuth"
ERROR_SCHEMA = ErrorBody.__name__


@dataclass(frozen=True)
class Refusal:
    """One ``(status, code)`` an operation can answer with (an :class:`~elastic.control.protocol.ErrorBody`),
    and
    when; ``challenge``: the answer carries ``WWW-Authenticate: Bearer ...``."""

    status: int
    code: ErrorCode
    when: str
    challenge: bool = False


@dataclass(frozen=True)
class Answer:
    """An answer that is no :class:`~elastic.control.protocol.ErrorBody`: a redirect, a page, plain text."""

    status: int
    when: str
    media_type: str | None = None  # None: no body worth describing
    headers: tuple[str, ...] = ()  # response headers it always carries


@dataclass(frozen=True)
class Operation:
    """What one operation can answer besides the gate's refusals (under ``/v1``)."""

    refusals: tuple[Refusal, ...] = ()
    answers: tuple[Answer, ...] = ()
    #: "bearer" (the job's token), "session" (the status page's cookie) or "public".
    security: str = "bearer"
    ok: bool = True  # whether it can answer 200 at all


UNAUTHORIZED = Refusal(401, ErrorCode.UNAUTHORIZED, "missing or wrong bearer token", challenge=True)
WRONG_JOB = Refusal(409, ErrorCode.WRONG_JOB, f"the `{JOB_HEADER}` header is missing or names another job")
TOO_LARGE = Refusal(
    413, ErrorCode.BODY_TOO_LARGE, f"the body is over {MAX_BODY_BYTES} bytes (declared or sent)"
)
#: master.http.rate_limits.PeerFailureLimiter: a valid token is never refused so.
WRONG_TOKENS = Refusal(
    429,
    ErrorCode.UNAUTHORIZED,
    f"this address sent {FAILURE_LIMIT} requests with a wrong bearer token within {FAILURE_WINDOW_S:g} s: "
    "refused at once until the window passes",
)
#: The gate's refusals, in the order it checks, for every operation under ``/v1``.
GATE = (UNAUTHORIZED, WRONG_TOKENS, WRONG_JOB, TOO_LARGE)

INVALID = Refusal(
    422, ErrorCode.INVALID_REQUEST, "malformed JSON or a bad field or query parameter (the message names it)"
)
NOT_LEADER = Refusal(
    503, ErrorCode.NOT_LEADER, "this master is a standby (or lost its lease): ask another master"
)
UNKNOWN_NODE = Refusal(
    404, ErrorCode.UNKNOWN_NODE, "the master does not know the node (never joined, dead or left)"
)
SETTINGS_MISMATCH = Refusal(409, ErrorCode.SETTINGS_MISMATCH, "the node's --nnodes differs from the job's")
NODE_EXCLUDED = Refusal(
    409,
    ErrorCode.NODE_EXCLUDED,
    "the node check excluded this node from the job, or it is excluded for flapping (until its cool-down "
    "ends or `elastic-master readmit`)",
)
DUPLICATE_NODE = Refusal(
    409,
    ErrorCode.DUPLICATE_NODE,
    f"another live agent holds this node id (the join lacks its `{NODE_SECRET_HEADER}`)",
)
BAD_NODE_SECRET = Refusal(
    403,
    ErrorCode.BAD_NODE_SECRET,
    f"`{NODE_SECRET_HEADER}` is missing or is not the node's (from its join reply)",
)
NO_SESSION = Refusal(401, ErrorCode.UNAUTHORIZED, "no valid session cookie: log in at /ui/login")
TO_LOGIN = Answer(303, "not signed in: a redirect to the login form", headers=("Location",))
_NODE = (INVALID, UNKNOWN_NODE, BAD_NODE_SECRET, NOT_LEADER)

#: Every operation of the master. A route missing here is found by tests/integration/test_openapi.py.
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", f"{API_PREFIX}/info"): Operation((NOT_LEADER,)),
    ("post", f"{API_PREFIX}/join"): Operation(
        (INVALID, SETTINGS_MISMATCH, NODE_EXCLUDED, DUPLICATE_NODE, NOT_LEADER)
    ),
    ("get", f"{API_PREFIX}/round"): Operation(_NODE),
    ("post", f"{API_PREFIX}/heartbeat"): Operation(_NODE),
    ("get", f"{API_PREFIX}/watch"): Operation(_NODE),
    ("post", f"{API_PREFIX}/leave"): Operation(_NODE),
    ("get", f"{API_PREFIX}/status"): Operation((NOT_LEADER,)),
    # The agent stream (master.http.stream): 101 and frames with the upgrade headers, 426 without.
    ("get", STREAM_PATH): Operation(
        (
            Refusal(
                426,
                ErrorCode.UPGRADE_REQUIRED,
                f"the request lacks `Connection: Upgrade` and `Upgrade: {STREAM_UPGRADE}` (or has a body)",
            ),
            Refusal(503, ErrorCode.NOT_LEADER, "a standby master (or one stepping down): ask another master"),
        ),
        answers=(
            Answer(
                101,
                f"Switching Protocols: the connection carries the agent stream from now on ({STREAM_UPGRADE}:"
                " newline-delimited JSON calls and replies, docs/protocol.md)",
                headers=("Connection", "Upgrade"),
            ),
        ),
        ok=False,
    ),
    ("post", f"{API_PREFIX}/nodes/{{node_id}}/readmit"): Operation(
        (
            INVALID,
            Refusal(404, ErrorCode.UNKNOWN_NODE, "the node is not excluded for flapping"),
            NOT_LEADER,
        )
    ),
    # Prometheus sends the token but no job header: the route checks the token itself, no gate.
    ("get", "/metrics"): Operation((UNAUTHORIZED, WRONG_TOKENS)),
    # The status page (master/http/ui.py): a login form sets a session cookie that only /ui accepts.
    ("get", "/ui"): Operation(answers=(TO_LOGIN,), security="session"),
    ("get", "/ui/login"): Operation(security="public"),
    ("post", "/ui/login"): Operation(
        answers=(
            Answer(303, "signed in: a redirect to the page, with the session cookie", headers=("Location",)),
            Answer(401, "wrong token: the form again", "text/html"),
            Answer(
                429,
                f"{FAILURE_LIMIT} wrong tokens from this address within {FAILURE_WINDOW_S:g} s (counted"
                " with /v1 and /metrics): the form again, refused until the window passes",
                "text/html",
                headers=("Retry-After",),
            ),
            Answer(403, "the form's CSRF value does not match its cookie: the form again", "text/html"),
            Answer(413, "the form is over 4096 bytes or has more than 4 fields", "text/plain"),
        ),
        security="public",
        ok=False,
    ),
    ("get", "/ui/status"): Operation((NO_SESSION, NOT_LEADER), security="session"),
    ("get", "/ui/{name}"): Operation(answers=(Answer(404, "no such file", "text/plain"),), security="public"),
}

_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
SESSION = "uiSession"


def gated(path: str) -> bool:
    """Whether :class:`master.http.gatekeeper.Gatekeeper` guards ``path`` (its rule, kept in one place)."""
    return path.startswith(API_PREFIX + "/")


def describe(method: str, path: str, operation: dict[str, Any] | None = None) -> Operation:
    """What an operation can answer, the gate's refusals first. Without a row in :data:`OPERATIONS`,
    what the path and the operation's shape imply (422 when it takes a body or parameters, 503 as every
    job route asks the leading job)."""
    row = OPERATIONS.get((method, path))
    if row is None:
        takes_input = operation is not None and (
            "requestBody" in operation
            or any(p.get("in") in ("query", "path") for p in operation.get("parameters", []))
        )
        row = Operation(((INVALID,) if takes_input else ()) + (NOT_LEADER,))
    if gated(path):
        row = replace(row, refusals=GATE + row.refusals)
    return row


def uncovered(document: dict[str, Any]) -> list[str]:
    """``METHOD path`` of every operation in ``document`` that :data:`OPERATIONS` has no row for."""
    return [
        f"{method.upper()} {path}"
        for path, item in document.get("paths", {}).items()
        for method in item
        if method in _METHODS and (method, path) not in OPERATIONS
    ]


def complete(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of FastAPI's ``document`` with every answer, the security schemes and the job header."""
    doc = copy.deepcopy(document)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas[ERROR_SCHEMA] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components.setdefault("securitySchemes", {}).update(
        {
            BEARER: {
                "type": "http",
                "scheme": "bearer",
                "description": "The job's token (`--token-file` or `ELASTIC_TOKEN`). Under /v1 the "
                "master's gate checks it in constant time before the request is routed or its body "
                f"parsed: 401 when it is missing or wrong (429 at once after {FAILURE_LIMIT} wrong ones from "
                f"one address within {FAILURE_WINDOW_S:g} s), then 409 when `{JOB_HEADER}` names another "
                f"job, then 413 for a body over {MAX_BODY_BYTES} bytes.",
            },
            SESSION: {
                "type": "apiKey",
                "in": "cookie",
                "name": "elastic_ui_session",
                "description": "The status page's session, set by `POST /ui/login` (the job's token).",
            },
        }
    )
    doc["security"] = [{BEARER: []}]
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if method in _METHODS:
                _complete_operation(path, operation, describe(method, path, operation))
    # FastAPI's validation-error models describe a body this master never sends (its 422 is an ErrorBody).
    for name in ("HTTPValidationError", "ValidationError"):  # the first refers to the second
        if f"#/components/schemas/{name}" not in _refs([doc.get("paths"), schemas]):
            schemas.pop(name, None)
    return doc


def install(app: FastAPI) -> None:
    """Serve :func:`complete` of the app's own document (built once, on first use) at ``app.openapi_url``."""
    plain = app.openapi
    built: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not built:
            built.append(complete(plain()))
        return built[0]

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace it


def _complete_operation(path: str, operation: dict[str, Any], row: Operation) -> None:
    parameters = []
    for parameter in operation.get("parameters", []):
        name = parameter.get("name", "").lower()
        if parameter.get("in") == "header" and name == "authorization":
            continue  # described by the security scheme (OpenAPI ignores an Authorization parameter)
        if parameter.get("in") == "header" and name == JOB_HEADER.lower():
            if not gated(path):
                continue  # FastAPI lists the app-wide dependency everywhere; only the gate reads it
            parameter = {
                **parameter,
                "required": True,
                "schema": {"type": "string"},
                "description": f"The job id; a missing or other one is refused with 409 `{WRONG_JOB.code}`.",
            }
        parameters.append(parameter)
    if parameters:
        operation["parameters"] = parameters
    else:
        operation.pop("parameters", None)
    if row.security != "bearer":
        operation["security"] = [{SESSION: []}] if row.security == "session" else []
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)  # FastAPI's HTTPValidationError: replaced by ours, where 422 can happen
    if not row.ok:
        responses.pop("200", None)
    by_status: dict[int, list[Refusal]] = {}
    for refusal in row.refusals:
        by_status.setdefault(refusal.status, []).append(refusal)
    for status, cases in by_status.items():
        responses[str(status)] = _error_response(cases)
    for answer in row.answers:
        response: dict[str, Any] = {"description": answer.when}
        if answer.media_type:
            response["content"] = {answer.media_type: {"schema": {"type": "string"}}}
        if answer.headers:
            response["headers"] = {
                h: {"required": True, "schema": {"type": "string"}} for h in answer.headers
            }
        responses[str(answer.status)] = response
    operation["responses"] = dict(sorted(responses.items()))


def _error_response(cases: list[Refusal]) -> dict[str, Any]:
    codes = list(dict.fromkeys(c.code for c in cases))
    response: dict[str, Any] = {
        "description": "; ".join(f"`{c.code}`: {c.when}" for c in cases),
        "content": {
            "application/json": {
                "schema": {
                    "allOf": [
                        {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"},
                        {"properties": {"error": {"enum": codes}}},
                    ]
                }
            }
        },
    }
    if any(c.challenge for c in cases):
        response["headers"] = {
            "WWW-Authenticate": {
                "description": "The scheme to authenticate with (RFC 7235).",
                "required": True,
                "schema": {"type": "string", "pattern": "^Bearer "},
            }
        }
    return response


def _refs(node: Any) -> set[str]:
    """Every ``$ref`` target in ``node``."""
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()
