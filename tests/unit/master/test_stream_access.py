"""The gate's rule as one pure function (master.http.gatekeeper.check_access), which the HTTP gate and the
agent stream's upgrade (master/http/stream.py) both apply: the token first (401, then 429 for an address
that keeps sending wrong ones, never for a valid token), then the job (409); with a fake clock. And the
stream's field-naming 422 text, the same as the HTTP routes' (master.service.api_ops.describe_errors)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from elastic.control.protocol import HeartbeatRequest
from master.http.gatekeeper import check_access, http_response, refusal_response
from master.http.rate_limits import PeerFailureLimiter
from master.service.api_ops import RoundQuery, describe_errors

TOKEN = b"the-token"
JOB = "job-1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def headers(token: str | None = "the-token", job: str | None = JOB) -> dict[bytes, bytes]:
    out = {}
    if token is not None:
        out[b"authorization"] = f"Bearer {token}".encode()
    if job is not None:
        out[b"x-elastic-job"] = job.encode()
    return out


def test_a_valid_token_and_job_pass_and_the_scheme_is_case_insensitive() -> None:
    failures = PeerFailureLimiter(clock=FakeClock())
    assert check_access(headers(), "10.0.0.1", TOKEN, JOB, failures) is None
    lower = {b"authorization": b"bearer the-token", b"x-elastic-job": JOB.encode()}
    assert check_access(lower, "10.0.0.1", TOKEN, JOB, failures) is None


def test_wrong_tokens_are_401_then_429_for_that_address_only_and_never_for_a_valid_token() -> None:
    clock = FakeClock()
    failures = PeerFailureLimiter(limit=3, window_s=10.0, clock=clock)
    for token in ("nope", None, "the-token-but-longer"):
        refusal = check_access(headers(token), "10.0.0.1", TOKEN, JOB, failures)
        assert refusal is not None and (refusal.status, refusal.code) == (401, "unauthorized")
        assert dict(refusal.headers)[b"www-authenticate"].startswith(b"Bearer")
    limited = check_access(headers("nope"), "10.0.0.1", TOKEN, JOB, failures)
    assert limited is not None and limited.status == 429 and dict(limited.headers)[b"retry-after"] == b"10"
    assert check_access(headers("nope"), "10.0.0.2", TOKEN, JOB, failures).status == 401  # per address
    assert check_access(headers(), "10.0.0.1", TOKEN, JOB, failures) is None  # a valid token: never
    clock.now += 10.0
    assert check_access(headers("nope"), "10.0.0.1", TOKEN, JOB, failures).status == 401


def test_the_token_is_checked_before_the_job() -> None:
    failures = PeerFailureLimiter(clock=FakeClock())
    assert check_access(headers("nope", "other"), "p", TOKEN, JOB, failures).status == 401
    for job in ("other", None):
        refusal = check_access(headers(job=job), "p", TOKEN, JOB, failures)
        assert refusal is not None and (refusal.status, refusal.code) == (409, "wrong_job")
        assert repr(job or "") in refusal.message


def test_a_refusal_is_a_whole_http_response_that_closes_the_connection() -> None:
    refusal = check_access(headers("nope"), "p", TOKEN, JOB, PeerFailureLimiter(clock=FakeClock()))
    head, _, body = refusal_response(refusal).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 401 Unauthorized"
    assert b"connection: close" in lines and b"content-length: %d" % len(body) in lines
    assert b'"error":"unauthorized"' in body
    assert http_response(503, b"{}").startswith(b"HTTP/1.1 503 Service Unavailable\r\n")


@pytest.mark.parametrize(
    "model, data, where, text",
    [
        (RoundQuery, {"node_id": "a", "timeout": 31}, "query", "query.timeout: Input should be less than"),
        (RoundQuery, {}, "query", "query.node_id: Field required"),
        (HeartbeatRequest, {"node_id": "a", "round": 0, "state": "x"}, "", "state: Input should be"),
        (HeartbeatRequest, {"node_id": "a", "round": 0, "state": "waiting", "x": 1}, "", "x: Extra inputs"),
    ],
)
def test_a_refused_field_is_named_as_the_http_routes_name_it(model, data, where, text) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    assert describe_errors(info.value.errors(), where).startswith(text)
