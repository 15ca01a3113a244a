"""Batches of requests the master must refuse, for the API fuzzer (bench/fuzz_engine.py).

A batch runs while no valid request does, between two *quiet* snapshots of ``GET /v1/status``: every
refusal must have its expected status, and every snapshot taken during and after the batch must equal the
one before (see :func:`bench.fuzz_target.stable_view` for the fields left out). Each kind of refusal is a
function ``(target, data, over=..., live=...) -> bool`` (False: not possible now, nothing was sent)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

from bench.fuzz_job import API_OPS, MAX_NODES, MIN_NODES, NODE_OPS, VALID_HOSTS, WITH_INPUT
from bench.fuzz_target import Target
from elastic.control.protocol import JOB_HEADER, MAX_BODY_BYTES
from master.http.ui import SESSION_COOKIE

MALFORMED_BODIES = (
    b"", b"{", b"null", b"[]", b"42", b'"text"', b"\xff\xfe\x00garbage", b"{'node_id': 1}", b"[" * 20000,
    b'{"node_id": "a", "node_id": ', b"\x00",
)  # fmt: skip


def refusal_batch(t: Target, data: st.DataObject, size: int) -> None:
    """Up to ``size`` refusals of kinds drawn from :data:`REFUSALS`, between two quiet status snapshots
    that must be equal; tallied in ``t.tally``."""
    before = quiesce(t)
    if before is None:
        t.tally.skipped_batches += 1
        return
    over = before["outcome"] is not None
    live = [n["node_id"] for n in before["nodes"] if n["node_id"] in t.nodes and n["state"] != "excluded"]
    kinds = []
    for _ in range(size):
        kind = data.draw(st.sampled_from(REFUSAL_KINDS), label="refusal")
        if REFUSALS[kind](t, data, over=over, live=live):
            t.tally.refusals[kind] += 1
            kinds.append(kind)
    t.tally.refusal_batches += 1
    after, diffs = t.quiet_status(before)
    t.tally.state_checks += 1
    if after is None or diffs:
        t.tally.fail("state", f"GET /v1/status changed during refusals {kinds}: {diffs[:3] or 'never quiet'}")


def quiesce(t: Target) -> dict[str, Any] | None:
    """A quiet status before a batch. An open round that waits for its members closes when they rejoin,
    or when the rejoin timeout passes (a time-driven change, which could fall into the batch): so they
    rejoin first. None when no quiet status came."""
    for _ in range(3):
        view, _ = t.quiet_status()
        if view is None or not (view["phase"] == "rendezvous" and view["outcome"] is None and view["nodes"]):
            return view
        for row in view["nodes"]:
            book = t.nodes.get(row["node_id"])
            if book is None:
                continue
            body = {
                "node_id": row["node_id"], "host": "127.0.0.1", "nproc": 1, "store_port": 29500,
                "min_nodes": MIN_NODES, "max_nodes": MAX_NODES,
            }  # fmt: skip
            response = t.send(t.operations["join"].Case(body=body), t.headers(secret=book.secret))
            t.record_join(row["node_id"], response)
    return None


def _generated(t: Target, data, names: tuple[str, ...] | None = None, mode=GenerationMode.POSITIVE):
    name = data.draw(st.sampled_from(names or API_OPS), label="operation")
    case = data.draw(t.strategy(name, mode), label=name)
    if mode is GenerationMode.POSITIVE and "timeout" in (case.query or {}):
        case.query = dict(case.query, timeout=0)
    return name, case


def _aim(case: schemathesis.Case, name: str, node: str) -> None:
    """Point a generated request of a node operation at ``node``."""
    if name in ("round", "watch"):
        case.query = dict(case.query, node_id=node)
    else:
        case.body = dict(case.body, node_id=node)


def _wrong_secret(t: Target, data, node: str) -> dict[str, str]:
    secret = t.nodes[node].secret or ""
    wrong = data.draw(st.sampled_from([None, "", "x" + secret, secret[:-1], secret.upper()]), label="secret")
    return t.headers(secret=wrong)


def _unauthorized(status: int) -> bool:
    """401, or 429 once this address sent many wrong tokens (master.http.rate_limits.PeerFailureLimiter)."""
    return status in (401, 429)


def no_token(t: Target, data, **_) -> bool:
    _, case = _generated(t, data)
    t.send(case, t.headers(token=None), expect=_unauthorized)
    return True


def wrong_token(t: Target, data, **_) -> bool:
    _, case = _generated(t, data)
    wrong = data.draw(st.sampled_from([
        "Bearer x" + t.token, "Bearer " + t.token[:-1], "Basic " + t.token, "Bearer", "", t.token,
        "Token " + t.token, "Bearer " + t.token.upper(),
    ]), label="authorization")  # fmt: skip
    t.send(case, {**t.headers(), "Authorization": wrong}, expect=_unauthorized)
    return True


def wrong_job(t: Target, data, **_) -> bool:
    _, case = _generated(t, data)
    job = data.draw(st.sampled_from([None, "", t.job + "x", t.job.upper(), "other"]), label="job")
    headers = t.headers(job=None)
    if job is not None:
        headers[JOB_HEADER] = job
    t.send(case, headers, expect=lambda s: s == 409)
    return True


def too_large(t: Target, data, **_) -> bool:
    _, case = _generated(t, data)
    size = data.draw(st.integers(MAX_BODY_BYTES + 1, 4 * MAX_BODY_BYTES), label="size")
    raw = json.dumps({"node_id": "n", "pad": "x" * size}).encode()
    t.send(case, t.headers(), expect=lambda s: s == 413, raw=raw)
    return True


def malformed_body(t: Target, data, **_) -> bool:
    _, case = _generated(t, data, ("join", "heartbeat", "leave"))
    raw = data.draw(st.sampled_from(MALFORMED_BODIES), label="body")
    t.send(case, t.headers(), expect=lambda s: s == 422, raw=raw)
    return True


def negative(t: Target, data, live: list[str], **_) -> bool:
    """Data the schema forbids, with the right token (and a live node's secret)."""
    name, case = _generated(t, data, WITH_INPUT, GenerationMode.NEGATIVE)
    secret = None
    if name in NODE_OPS and live:
        secret = t.nodes[data.draw(st.sampled_from(live), label="node")].secret
    t.send(case, t.headers(secret=secret), expect=lambda s: 400 <= s < 500, negative=True)
    return True


def settings_mismatch(t: Target, data, **_) -> bool:
    _, case = _generated(t, data, ("join",))
    low = data.draw(st.integers(1, 8), label="min")
    high = data.draw(st.integers(low, 9).filter(lambda h: (low, h) != (MIN_NODES, MAX_NODES)), label="max")
    case.body = dict(case.body, min_nodes=low, max_nodes=high, host=data.draw(VALID_HOSTS))
    t.send(case, t.headers(), expect=lambda s: s == 409)
    return True


def unknown_node(t: Target, data, over: bool, **_) -> bool:
    name, case = _generated(t, data, NODE_OPS)
    _aim(case, name, "ghost-" + uuid.uuid4().hex[:6])
    # Once the job is over a stranger is told so (stop, finished), like the node itself would be.
    expect = (lambda s: s in (200, 404)) if over else (lambda s: s == 404)
    t.send(case, t.headers(secret="not-a-secret"), expect=expect)
    return True


def wrong_secret(t: Target, data, over: bool, live: list[str]) -> bool:
    if over or not live or not t.credentials:
        return False
    name, case = _generated(t, data, NODE_OPS)
    node = data.draw(st.sampled_from(live), label="node")
    _aim(case, name, node)
    t.send(case, _wrong_secret(t, data, node), expect=lambda s: s == 403)
    return True


def duplicate_join(t: Target, data, over: bool, live: list[str]) -> bool:
    """Another agent under a live node's id, without that node's secret."""
    if over or not live or not t.credentials:
        return False
    _, case = _generated(t, data, ("join",))
    node = data.draw(st.sampled_from(live), label="node")
    case.body = dict(case.body, node_id=node, min_nodes=MIN_NODES, max_nodes=MAX_NODES, host="127.0.0.1")
    t.send(case, _wrong_secret(t, data, node), expect=lambda s: s == 409)
    return True


def no_session(t: Target, data, **_) -> bool:
    """The status page's data without a valid session cookie (none, forged, or another job's)."""
    name = data.draw(st.sampled_from(["GET /ui", "GET /ui/status"]), label="operation")
    forged = data.draw(
        st.sampled_from([None, "", "1.abc", f"{2**40}.{'0' * 64}", (t.ui_session or "9.x") + "0"]),
        label="cookie",
    )
    cookies = None if forged is None else {SESSION_COOKIE: forged}
    expect = 303 if name == "GET /ui" else 401
    t.send(t.operations[name].Case(), {}, cookies=cookies, expect=lambda s: s == expect)
    return True


#: The kinds of refusal a batch draws from, by name (the name is what the report counts).
REFUSALS: dict[str, Callable[..., bool]] = {
    f.__name__: f
    for f in (
        no_token, wrong_token, wrong_job, too_large, malformed_body, negative, settings_mismatch,
        unknown_node, wrong_secret, duplicate_join, no_session,
    )
}  # fmt: skip
REFUSAL_KINDS = tuple(REFUSALS)
