"""Fuzzing what the master's OpenAPI document does not describe (bench/fuzz_api.py fuzzes the rest): the
agent stream's frames after a valid upgrade, and the status page (``/ui``), against a real
``elastic-master`` process over raw sockets.

- **The stream** (docs/protocol.md, "The agent stream"): malformed frames (cut, bytes flipped, not UTF-8,
  not an object, empty), JSON nested 20,000 deep, NaN and ±Infinity in numeric fields, frames over the
  limit, unknown operations, fields of the wrong type, frames sent in pieces or several in one write, and
  calls the job refuses (an unknown node, a wrong node secret, a duplicate join, other job settings).
  Every line must get exactly one reply of the documented status (``id`` 0 and 422 for a line that is no
  call, 404 for an unknown operation, 422 naming the field, 413 and the stream closed for a frame over the
  limit); the stream goes on otherwise (an ``info`` call on it is answered 200).
- **The status page** (docs/security.md): login form posts with other content types, bodies over the
  limit, not UTF-8, with fields missing, repeated or too many, wrong tokens (401, then 429 for the
  address); forged, oversized and binary cookies; odd paths and methods. Every answer must have a
  documented status, the page's security headers, no job data without a session, and ``/ui/status`` must
  never answer without one.

Throughout: no 5xx, no traceback (nor asyncio's callback errors) in the master's output, a node joined on
its own stream (the *sentinel*) heartbeating between every two cases and always answered 200
``continue``, and ``GET /v1/status`` unchanged by the cases (compared every :data:`STATE_EVERY` cases,
as bench/fuzz_refusals.py does for the HTTP API).

    python bench/fuzz_wire.py                                   # 10,000 cases of each surface, seed 0
    python bench/fuzz_wire.py --cases 500 --seed 7 --surface stream --json /tmp/wire.json

The suite runs short versions (tests/integration/test_stream_fuzz.py, tests/integration/test_ui_fuzz.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import socket
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from bench.fuzz_job import MASTER_ARGS, MAX_NODES, MIN_NODES  # noqa: E402
from bench.fuzz_target import stable_view  # noqa: E402
from elastic.control.protocol import (  # noqa: E402
    JOB_HEADER,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    STREAM_MAX_FRAME_BYTES,
    STREAM_PATH,
    STREAM_UPGRADE,
)
from master.http.rate_limits import FAILURE_LIMIT  # noqa: E402
from master.http.ui import CSRF_COOKIE, LOGIN_BODY_MAX, SECURITY_HEADERS, SESSION_COOKIE  # noqa: E402

#: Cases per surface in a full run.
CASES = 10_000
#: ``GET /v1/status`` is compared with the first snapshot every this many cases.
STATE_EVERY = 50
#: How long an answer may take (the master answers every case at once; this only bounds a hang).
REPLY_TIMEOUT_S = 15.0
START_TIMEOUT_S = 60.0
#: What a traceback or an error asyncio caught looks like in the master's output.
LOG_ALARMS = re.compile(
    r"Traceback \(most recent call last\)|Exception in callback|Fatal error on|call failed|"
    r"failed to serve|exception was never retrieved|returned no response"
)
#: Statuses a stream reply may have (docs/protocol.md): a call's route statuses and the stream's refusals.
STREAM_STATUSES = frozenset({200, 403, 404, 409, 413, 422, 429})
#: Statuses a /ui answer may have: the routes', 405 (a method a route lacks), 307 (the framework's redirect
#: of a path with a trailing slash to the route without) and 400 (a request that is not HTTP/1.1: h11's
#: answer, before any route).
UI_STATUSES = frozenset({200, 303, 307, 400, 401, 403, 404, 405, 413, 429})
SENTINEL = "sentinel"
DEEP = 20_000
FAILURES_KEPT = 20


# -- the tally ---------------------------------------------------------------------------------------------
@dataclass
class WireTally:
    """What one run found: cases and statuses per kind, the failures (the first few described)."""

    cases: Counter = field(default_factory=Counter)  # by kind
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    server_errors: int = 0
    failures: Counter = field(default_factory=Counter)  # by what failed
    examples: list[str] = field(default_factory=list)
    sentinel_beats: int = 0
    state_checks: int = 0
    closed_streams: int = 0  # fuzz streams the master closed as documented (a frame over the limit)
    resets: int = 0  # of which the 413 was lost to the connection's reset (see _refused_and_closed)

    def note(self, kind: str, status: int) -> None:
        self.statuses[kind][status] += 1
        self.server_errors += status >= 500

    def fail(self, what: str, text: str) -> None:
        self.failures[what] += 1
        if len(self.examples) < FAILURES_KEPT:
            self.examples.append(f"[{what}] {text}")

    def to_json(self) -> dict[str, Any]:
        return {
            "cases": dict(self.cases),
            "statuses": {k: {str(s): n for s, n in sorted(v.items())} for k, v in self.statuses.items()},
            "server_errors": self.server_errors,
            "failures": dict(self.failures),
            "examples": self.examples,
            "sentinel_beats": self.sentinel_beats,
            "state_checks": self.state_checks,
            "closed_streams": self.closed_streams,
            "resets": self.resets,
        }


# -- the wire ----------------------------------------------------------------------------------------------
class Conn:
    """A blocking socket to the master: raw bytes out, lines or one HTTP response in."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=REPLY_TIMEOUT_S)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def line(self) -> bytes | None:
        """The next line (without its newline); None once the master closed the connection."""
        while b"\n" not in self.buffer:
            try:
                if not self._more():
                    return None
            except ConnectionResetError:
                return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def response(self, until_close: bool = False) -> tuple[int, dict[str, str], bytes]:
        """One HTTP response: status, headers (names lower-case; repeated ones joined by newlines), body
        (``until_close``: what came until the master closed the connection, e.g. none after a HEAD)."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._more():
                raise ConnectionError(f"closed before a whole response head: {self.buffer[:200]!r}")
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            headers[key] = (headers[key] + "\n" if key in headers else "") + value.strip()
        if until_close:
            return status, headers, self.rest()
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            if not self._more():
                break
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, body

    def closed(self) -> bool:
        """Whether the master closes the connection (what it sends meanwhile is read and dropped)."""
        try:
            while self._more():
                self.buffer = b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def rest(self) -> bytes:
        """Everything until the master closes the connection."""
        try:
            while self._more():
                pass
        except ConnectionResetError:
            pass
        data, self.buffer = self.buffer, b""
        return data

    def close(self) -> None:
        self.sock.close()


def upgrade_request(token: str, job_id: str) -> bytes:
    return (
        f"GET {STREAM_PATH} HTTP/1.1\r\nHost: master\r\nConnection: Upgrade\r\nUpgrade: {STREAM_UPGRADE}\r\n"
        f"Authorization: Bearer {token}\r\n{JOB_HEADER}: {job_id}\r\n"
        f"{PROTOCOL_HEADER}: {PROTOCOL_VERSION}\r\n\r\n"
    ).encode()


class Stream:
    """An agent stream to the master (the upgrade answered 101), frames as JSON lines."""

    def __init__(self, address: tuple[str, int], token: str, job_id: str) -> None:
        self.conn = Conn(address)
        self.conn.send(upgrade_request(token, job_id))
        status, _, body = self.conn.response()
        if status != 101:
            raise RuntimeError(f"the stream's upgrade was answered {status}: {body[:300]!r}")

    def reply(self) -> dict[str, Any] | None:
        """The next reply frame; None once the master closed the stream."""
        line = self.conn.line()
        return None if line is None else json.loads(line)

    def call(self, **frame: Any) -> dict[str, Any]:
        self.conn.send(json.dumps(frame).encode() + b"\n")
        reply = self.reply()
        if reply is None:
            raise ConnectionError(f"the master closed the stream on {frame.get('op')}")
        return reply


# -- the master ---------------------------------------------------------------------------------------------
class WireMaster:
    """One ``elastic-master`` process (the fuzzed job of bench/fuzz_job.py), the sentinel node joined on its
    own stream, and the checks every case ends with."""

    def __init__(self, folder: Path, group: c.Group, tally: WireTally) -> None:
        self.tally = tally
        self.job = f"fuzz-wire-{uuid.uuid4().hex[:8]}"
        token_file = folder / "token"
        argv = c.master_argv() + [
            "--host", "127.0.0.1", "--port", "0", "--job-id", self.job, "--token-file", str(token_file),
            *MASTER_ARGS,
        ]  # fmt: skip
        self.process = group.launch(argv, "wire-master")
        found = c.wait_until(
            lambda: (
                re.search(r"listening on 127\.0\.0\.1:(\d+)", self.process.output())
                or not self.process.alive()
            ),
            START_TIMEOUT_S,
        )
        if not isinstance(found, re.Match):
            raise RuntimeError(f"elastic-master did not start: {self.process.output()[-2000:]}")
        self.address = ("127.0.0.1", int(found.group(1)))
        self.token = token_file.read_text().strip()
        self._log_seen = 0
        self.sentinel = Stream(self.address, self.token, self.job)
        joined = self.sentinel.call(id=1, op="join", body=join_body(SENTINEL))
        if joined["status"] != 200:
            raise RuntimeError(f"the sentinel could not join: {joined}")
        self.secret: str = joined["body"]["node_secret"]
        self.round: int = joined["body"]["round"]
        self._beat_id = 1
        self.beat("sentinel's first heartbeat")
        ready = c.wait_until(lambda: (self.status() or {}).get("phase") == "training", START_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the fuzzed job never started its round: {self.status()}")
        self.baseline = stable_view(self.status() or {})

    def beat(self, after: str) -> None:
        """The sentinel's heartbeat: 200 ``continue`` whatever the case before did."""
        self._beat_id += 1
        body = {"node_id": SENTINEL, "round": self.round, "state": "running"}
        try:
            reply = self.sentinel.call(id=self._beat_id, op="heartbeat", secret=self.secret, body=body)
        except (OSError, ConnectionError, ValueError) as exc:
            self.tally.fail("sentinel", f"after {after}: {type(exc).__name__}: {exc}")
            self.sentinel = Stream(self.address, self.token, self.job)
            return
        self.tally.sentinel_beats += 1
        if reply["status"] != 200 or reply["body"].get("command") != "continue":
            self.tally.fail("sentinel", f"after {after}: {reply}")

    def http(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """Send one whole request (which says ``Connection: close``) on a new connection; its answer."""
        conn = Conn(self.address)
        try:
            conn.send(request)
            return conn.response(until_close=True)
        finally:
            conn.close()

    def status(self) -> dict[str, Any] | None:
        headers = {"Authorization": f"Bearer {self.token}", JOB_HEADER: self.job, "Connection": "close"}
        code, _, body = self.http(http_request("GET", "/v1/status", headers))
        return json.loads(body) if code == 200 else None

    def check_state(self, after: str) -> None:
        """``GET /v1/status`` as it was before the first case (fields that move with time left out)."""
        self.tally.state_checks += 1
        now = stable_view(self.status() or {})
        if now != self.baseline:
            self.tally.fail("state", f"GET /v1/status changed after {after}: {_diff(self.baseline, now)}")
            self.baseline = now

    def check_log(self, after: str) -> None:
        """No traceback nor asyncio error in the master's output since the last check."""
        text = self.process.output()
        new, self._log_seen = text[self._log_seen :], len(text)
        found = LOG_ALARMS.search(new)
        if found:
            start = max(0, found.start() - 300)
            self.tally.fail("log", f"after {after}: {new[start : found.start() + 1200]!r}")
        if not self.process.alive():
            raise RuntimeError(f"elastic-master exited after {after}: {text[-2000:]}")


def join_body(node_id: str, **overrides: Any) -> dict[str, Any]:
    body = dict(node_id=node_id, host="127.0.0.1", nproc=1, store_port=29500)
    return body | dict(min_nodes=MIN_NODES, max_nodes=MAX_NODES) | overrides


def http_request(method: str, target: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: master"] + [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _diff(before: Any, after: Any) -> str:
    if not isinstance(before, dict) or not isinstance(after, dict):
        return f"{before!r} -> {after!r}"[:400]
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys)[:600]


# -- stream cases ------------------------------------------------------------------------------------------
@dataclass
class Line:
    """One line a case sends and the reply it must get: its id (None: any) and the statuses allowed."""

    data: bytes
    reply_id: int | None
    statuses: frozenset[int]


@dataclass
class StreamCase:
    """Lines sent in ``pieces`` (None: one write); ``closes``: the master answers 413 and closes."""

    kind: str
    lines: list[Line]
    pieces: list[int] | None = None
    closes: bool = False
    #: Sent on a stream of its own, cut off after this many bytes by closing the connection: no reply.
    hang_up_at: int | None = None


class Calls:
    """Calls the fuzz starts from, each refused by the job (or read-only), with their statuses: no case
    changes the job, so ``GET /v1/status`` must not change either."""

    def __init__(self, master: WireMaster) -> None:
        self.master = master
        self.next_id = 1000

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def pick(self, rng: random.Random, mutable: bool = False) -> tuple[dict[str, Any], frozenset[int]]:
        """A call (without ``id``) and its statuses. ``mutable``: only calls that no edit of their bytes
        turns into one the job accepts (a duplicate join with one byte of its node id changed would be a
        new node)."""
        stranger = f"fz{rng.randrange(10**6)}"
        calls: list[tuple[dict[str, Any], frozenset[int]]] = [
            ({"op": "info"}, frozenset({200})),
            (
                {
                    "op": "heartbeat",
                    "secret": "x",
                    "body": {"node_id": stranger, "round": 0, "state": "running"},
                },
                frozenset({404}),
            ),
            ({"op": "watch", "query": {"node_id": stranger, "round": 0, "timeout": 0}}, frozenset({404})),
            ({"op": "round", "query": {"node_id": stranger, "after": 0, "timeout": 0}}, frozenset({404})),
            ({"op": "leave", "secret": "x", "body": {"node_id": stranger}}, frozenset({404})),
            ({"op": "join", "body": join_body(stranger, min_nodes=5, max_nodes=9)}, frozenset({409})),
        ]
        if not mutable:
            beat = {"node_id": SENTINEL, "round": self.master.round, "state": "failed"}
            calls += [
                ({"op": "heartbeat", "secret": self.master.secret + "x", "body": beat}, frozenset({403})),
                ({"op": "join", "body": join_body(SENTINEL)}, frozenset({409})),
                ({"op": "leave", "secret": "wrong", "body": {"node_id": SENTINEL}}, frozenset({403})),
            ]
        return rng.choice(calls)

    def frame(self, rng: random.Random, mutable: bool = False) -> tuple[dict[str, Any], frozenset[int]]:
        call, statuses = self.pick(rng, mutable)
        return {"id": self.new_id(), **call}, statuses


def _dump(frame: dict[str, Any]) -> bytes:
    return json.dumps(frame).encode()


INVALID = frozenset({422})


def refused_call(calls: Calls, rng: random.Random) -> StreamCase:
    frame, statuses = calls.frame(rng)
    return StreamCase("refused_call", [Line(_dump(frame), frame["id"], statuses)])


def bad_json(calls: Calls, rng: random.Random) -> StreamCase:
    """A frame cut short, bytes that are not JSON or not UTF-8, an empty line, a JSON value that is no
    object: ``id`` 0, 422. A frame with a byte flipped may still parse: any documented reply then."""
    frame, _ = calls.frame(rng, mutable=True)
    raw = _dump(frame)
    how = rng.choice(["cut", "flip", "not_utf8", "empty", "scalar", "garbage", "surrogate"])
    if how == "flip":
        flipped = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] = rng.choice(b'{}[]":,0123456789aez \\')
        return StreamCase("bad_json", [Line(bytes(flipped), None, STREAM_STATUSES)])
    if how == "surrogate":  # lone surrogates: valid JSON escapes, not encodable text
        text = raw.replace(b'"op"', b'"op\\ud800"', 1) if rng.random() < 0.5 else raw
        odd = text.replace(b"}", b', "\\udfff": "\\ud800"}', 1)
        return StreamCase("bad_json", [Line(odd, None, STREAM_STATUSES)])
    data = {
        "cut": raw[: rng.randrange(1, len(raw) - 1)],
        "not_utf8": raw.replace(b'"op"', b'"o\xff\xfep"', 1),
        "empty": b"",
        "scalar": rng.choice([b"null", b"42", b'"text"', b"[1, 2]", b"true", b"NaN", b"-Infinity", b"1e999"]),
        "garbage": bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))).replace(b"\n", b" "),
    }[how]
    return StreamCase("bad_json", [Line(data, 0, INVALID)])


def deep(calls: Calls, rng: random.Random) -> StreamCase:
    """JSON nested deeper than the parser's recursion limit, as the frame or inside a call: ``id`` 0, 422;
    nested less deep inside a call: that call's 422 (or ``id`` 0 where the parser's limit still hits)."""
    depth = rng.choice([DEEP, DEEP, 5000, 1500, 500])
    # arrays 20,000 deep fit in a frame (40 KB); objects only 5,000 deep (``{"a":`` is five bytes a level)
    opener, closer = (b"[", b"]") if depth == DEEP or rng.random() < 0.5 else (b'{"a":', b"}")
    nested = opener * depth + b"1" + closer * depth
    frame, statuses = calls.frame(rng, mutable=True)
    where = rng.choice(["frame", "body", "query", "secret"])
    if where == "frame":
        return StreamCase("deep", [Line(nested, 0, INVALID)])
    raw = _dump({**frame, where: "@@"}).replace(b'"@@"', nested)
    # parsed when shallow enough: then the call's own validation (or none: info reads no body)
    allowed = INVALID if depth >= DEEP else INVALID | statuses
    return StreamCase("deep", [Line(raw, None if depth < DEEP else 0, allowed)])


NON_FINITE = (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999")


def non_finite(calls: Calls, rng: random.Random) -> StreamCase:
    """NaN or ±Infinity (which Python's JSON parser accepts, also as 1e999) in a numeric field of a call:
    its 422."""
    value = rng.choice(NON_FINITE)
    stranger = f"fz{rng.randrange(10**6)}"
    worker = {"local_rank": 0, "step": 3, "step_time_s": "@@"}
    beat = {"node_id": stranger, "round": 0, "state": "running"}
    options: list[dict[str, Any]] = [
        {"op": "heartbeat", "secret": "x", "body": {**beat, "round": "@@"}},
        {"op": "heartbeat", "secret": "x", "body": {**beat, "workers": [worker]}},
        {"op": "heartbeat", "secret": "x", "body": {**beat, "ckpt_step": "@@"}},
        {"op": "join", "body": join_body(stranger, nproc="@@")},
        {"op": "join", "body": join_body(stranger, store_port="@@")},
        {"op": "watch", "query": {"node_id": stranger, "round": "@@", "timeout": 0}},
        {"op": "watch", "query": {"node_id": stranger, "round": 0, "timeout": "@@"}},
        {"op": "round", "query": {"node_id": stranger, "after": 0, "timeout": "@@"}},
        {"op": "round", "query": {"node_id": stranger, "after": "@@", "timeout": 0}},
    ]
    call = rng.choice(options)
    frame = {"id": calls.new_id(), **call}
    return StreamCase("non_finite", [Line(_dump(frame).replace(b'"@@"', value), frame["id"], INVALID)])


WRONG_IDS: tuple[Any, ...] = ("1", 1.5, True, False, -3, 0, None, [1], {"id": 1}, 1e3)
WRONG_OPS: tuple[Any, ...] = (1, None, ["info"], {"op": "info"}, True, 1.5)
WRONG_VALUES: tuple[Any, ...] = (5, [], {}, "x", True, None, -1, 1.5, [[]], {"a": {}})


def wrong_types(calls: Calls, rng: random.Random) -> StreamCase:
    """A call's ``id``, ``op``, ``secret``, ``query``, ``body`` or a field of its body of the wrong type."""
    frame, statuses = calls.frame(rng, mutable=True)
    what = rng.choice(["id", "op", "secret", "query", "body", "field", "huge_id"])
    if what == "id":
        frame["id"] = rng.choice(WRONG_IDS)
        return StreamCase("wrong_types", [Line(_dump(frame), 0, INVALID)])
    if what == "huge_id":  # an integer id of any size is an id
        frame["id"] = 2 ** rng.randint(31, 200)
        return StreamCase("wrong_types", [Line(_dump(frame), frame["id"], statuses)])
    if what == "op":
        frame["op"] = rng.choice(WRONG_OPS)
        return StreamCase("wrong_types", [Line(_dump(frame), frame["id"], frozenset({404}))])
    value = rng.choice(WRONG_VALUES)
    op = frame["op"]
    if what == "secret":  # checked before the operation runs, info's too
        allowed = statuses if value is None or isinstance(value, str) else INVALID
    elif what == "query":  # an object or none; only round and watch read it (and then validate it)
        if value is None or isinstance(value, dict):
            allowed = INVALID | statuses if op in ("round", "watch") else statuses
        else:
            allowed = INVALID
    elif what == "body":
        allowed = statuses if op in ("info", "round", "watch") else INVALID
    else:
        container = "body" if isinstance(frame.get("body"), dict) else "query" if "query" in frame else None
        if container is None:
            return StreamCase("wrong_types", [Line(_dump(frame), frame["id"], statuses)])
        name = rng.choice(sorted(frame[container]))
        frame[container] = {**frame[container], name: value}
        return StreamCase("wrong_types", [Line(_dump(frame), frame["id"], INVALID | statuses)])
    frame[what] = value
    return StreamCase("wrong_types", [Line(_dump(frame), frame["id"], allowed)])


def big_values(calls: Calls, rng: random.Random) -> StreamCase:
    """Values past a field's limits or a parser's: ids and strings thousands long, integers of hundreds or
    thousands of digits (over 4,300 Python's parser refuses the frame), a heartbeat reporting 2,000 workers.
    The call's own refusal (or the job's answer, when the value is merely large), or ``id`` 0, 422."""
    frame, statuses = calls.frame(rng, mutable=True)
    what = rng.choice(["long_id", "big_int", "huge_int", "workers", "long_text"])
    # every frame stays under the frame limit (oversize is a kind of its own)
    stranger = f"fz{rng.randrange(10**6)}"
    beat: dict[str, Any] = {"node_id": stranger, "round": 0, "state": "running"}
    if what == "long_id":
        beat["node_id"] = rng.choice("n-._é") * rng.choice([129, 4000, 9000])
    elif what in ("big_int", "huge_int"):
        beat["round"] = "@@"
    elif what == "workers":
        beat["workers"] = [{"local_rank": i % 7, "step": -i} for i in range(rng.choice([1000, 2000]))]
    else:
        beat["persist_error"] = "e" * rng.randint(300, 20000)
    frame = {"id": calls.new_id(), "op": "heartbeat", "secret": "x", "body": beat}
    digits = rng.choice([20, 400]) if what == "big_int" else 5000
    raw = _dump(frame).replace(b'"@@"', b"9" * digits)
    reply_id = 0 if what == "huge_int" else frame["id"]
    return StreamCase("big_values", [Line(raw, reply_id, INVALID | frozenset({404}))])


UNKNOWN_OPS = ("status", "", "INFO", "Info", "\u0000", "__init__", "_info", "info ", "heartbeats", "stream",
               "x" * 5000, "\ud7ff", "readmit", "metrics")  # fmt: skip


def unknown_op(calls: Calls, rng: random.Random) -> StreamCase:
    frame, _ = calls.frame(rng, mutable=True)
    frame["op"] = rng.choice(UNKNOWN_OPS)
    return StreamCase("unknown_op", [Line(_dump(frame), frame["id"], frozenset({404}))])


def pieces(calls: Calls, rng: random.Random) -> StreamCase:
    """Frames that arrive in pieces (cut anywhere, a newline's own write included), several per write."""
    lines = []
    for _ in range(rng.randint(1, 4)):
        frame, statuses = calls.frame(rng)
        lines.append(Line(_dump(frame), frame["id"], statuses))
    total = sum(len(line.data) + 1 for line in lines)
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(1, 12))))
    return StreamCase("pieces", lines, pieces=cuts)


def cut_off(calls: Calls, rng: random.Random) -> StreamCase:
    """Frames whose connection closes in the middle of one (the last is never complete): the master reads
    on, answers nothing, and its other streams notice nothing."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        frame, statuses = calls.frame(rng)
        lines.append(Line(_dump(frame), frame["id"], statuses))
    total = sum(len(line.data) + 1 for line in lines)
    return StreamCase("cut_off", lines, hang_up_at=rng.randrange(1, total - 1))


def oversize(calls: Calls, rng: random.Random) -> StreamCase:
    """A frame over the limit, whole or never ending: ``id`` 0, 413, and the stream is closed."""
    frame, _ = calls.frame(rng, mutable=True)
    pad = "x" * (STREAM_MAX_FRAME_BYTES + rng.randint(1, 2 * STREAM_MAX_FRAME_BYTES))
    raw = _dump({**frame, "body": {"pad": pad}})
    if rng.random() < 0.5:  # no newline at all: refused once the buffer passes the limit
        return StreamCase("oversize", [Line(raw, 0, frozenset({413}))], pieces=[len(raw)], closes=True)
    return StreamCase("oversize", [Line(raw, 0, frozenset({413}))], closes=True)


STREAM_KINDS: dict[str, Callable[[Calls, random.Random], StreamCase]] = {
    f.__name__: f
    for f in (
        refused_call,
        bad_json,
        deep,
        non_finite,
        wrong_types,
        unknown_op,
        pieces,
        oversize,
        big_values,
        cut_off,
    )
}


def play_stream_case(master: WireMaster, stream: Stream, case: StreamCase) -> bool:
    """Send ``case`` on ``stream`` and check every reply; False when the stream is closed after it."""
    data = b"".join(line.data + b"\n" for line in case.lines)
    if case.closes and case.pieces is not None:  # a frame that never ends: no newline
        data = case.lines[0].data
    cuts = [0, *(case.pieces or []), len(data)]
    if case.closes:
        return _refused_and_closed(master, stream, case, data)
    if case.hang_up_at is not None:
        own = Stream(master.address, master.token, master.job)
        own.conn.send(data[: case.hang_up_at])
        own.conn.close()
        return True
    try:
        for start, end in zip(cuts, cuts[1:], strict=False):
            if end > start:
                stream.conn.send(data[start:end])
        pending = list(case.lines)
        for _ in range(len(case.lines)):
            reply = stream.reply()
            if reply is None:
                master.tally.fail(
                    "stream", f"{case.kind}: the stream closed instead of a reply: {_lines(case)}"
                )
                return False
            _check_reply(master.tally, case, pending, reply)
    except (OSError, ValueError) as exc:
        master.tally.fail("stream", f"{case.kind}: {type(exc).__name__}: {exc}: {_lines(case)}")
        return False
    return True


def _refused_and_closed(master: WireMaster, stream: Stream, case: StreamCase, data: bytes) -> bool:
    """A frame over the limit: ``id`` 0, 413, and the stream closed. The master closes with the rest of the
    frame unread, so the kernel may answer what we still send with a reset, which can also discard the 413
    from our socket's queue before we read it: a reset then counts as the close, without a reply."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.conn.send(data)
    try:
        reply = stream.reply()
    except (ConnectionResetError, BrokenPipeError):
        reply = None
    if reply is None:
        master.tally.resets += 1
    else:
        _check_reply(master.tally, case, list(case.lines), reply)
    if not stream.conn.closed():
        master.tally.fail("stream", f"{case.kind}: not closed after its 413: {_lines(case)}")
    master.tally.closed_streams += 1
    return False


def _check_reply(tally: WireTally, case: StreamCase, pending: list[Line], reply: dict[str, Any]) -> None:
    status = reply.get("status")
    tally.note(case.kind, status if isinstance(status, int) else 0)
    # replies come in any order: the line whose id matches (a line of any id for lines that allow any)
    line = next((p for p in pending if p.reply_id == reply.get("id")), None)
    line = line or next((p for p in pending if p.reply_id is None), None)
    if line is None:
        tally.fail("stream", f"{case.kind}: a reply for no line sent: {reply} to {_lines(case)}")
        return
    pending.remove(line)
    body = reply.get("body")
    if status not in line.statuses or status not in STREAM_STATUSES:
        tally.fail(
            "stream",
            f"{case.kind}: {status} (allowed {sorted(line.statuses)}): {reply} to {line.data[:300]!r}",
        )
    elif status != 200 and not (isinstance(body, dict) and body.get("error") and body.get("message")):
        tally.fail("stream", f"{case.kind}: a refusal without an error body: {reply}")


def _lines(case: StreamCase) -> str:
    return " | ".join(repr(line.data[:160]) for line in case.lines)


def fuzz_stream(master: WireMaster, cases: int, rng: random.Random) -> None:
    """``cases`` stream cases on fuzz streams (a new one after each the master closed)."""
    calls = Calls(master)
    stream = Stream(master.address, master.token, master.job)
    kinds = sorted(STREAM_KINDS)
    for n in range(1, cases + 1):
        kind = rng.choice(kinds)
        case = STREAM_KINDS[kind](calls, rng)
        master.tally.cases[kind] += 1
        if not play_stream_case(master, stream, case):
            stream.conn.close()
            stream = Stream(master.address, master.token, master.job)
        master.beat(f"stream case {kind} {_lines(case)[:300]}")
        if n % STATE_EVERY == 0 or n == cases:
            master.check_log(f"stream cases up to {kind}")
            master.check_state(f"stream cases up to #{n}")
    goes_on = stream.call(id=calls.new_id(), op="info")  # the fuzz stream itself still serves calls
    if goes_on["status"] != 200:
        master.tally.fail("stream", f"the fuzz stream's last info call: {goes_on}")
    stream.conn.close()


# -- /ui cases ---------------------------------------------------------------------------------------------
@dataclass
class UiCase:
    """One request to /ui (the whole request's bytes) and the statuses allowed."""

    kind: str
    request: bytes
    statuses: frozenset[int]
    #: A path the answer is for (its checks: security headers, no job data without a session).
    path: str = "/ui"


FORM = "application/x-www-form-urlencoded"
CONTENT_TYPES = (FORM, FORM + "; charset=latin-1", "application/json", "text/plain", "multipart/form-data; "
                 "boundary=x", "", "application/octet-stream", "FORM", "x" * 300)  # fmt: skip


def login_form(master: WireMaster) -> tuple[str, str]:
    """The login form's CSRF field and cookie, as a browser gets them."""
    status, headers, body = master.http(http_request("GET", "/ui/login", {"Connection": "close"}))
    found = re.search(rb'name="csrf" value="([^"]+)"', body)
    cookie = re.search(rf"{CSRF_COOKIE}=([^;\s]+)", headers.get("set-cookie", ""))
    if status != 200 or not found or not cookie:
        raise RuntimeError(f"GET /ui/login answered {status}: {body[:300]!r}")
    return found.group(1).decode(), cookie.group(1)


class Logins:
    """Counts the wrong tokens the fuzz posts (the address is answered 429 after :data:`FAILURE_LIMIT`
    within the limiter's window, counted with every other wrong token)."""

    def __init__(self) -> None:
        self.wrong = 0


def login_post(master: WireMaster, rng: random.Random, logins: Logins) -> UiCase:
    """A login post: its body's fields, encoding, size and content type drawn; the statuses follow
    docs/security.md: 413 over the size or field limit, 403 without the matching CSRF value, 401 (then 429)
    for a wrong token, 303 for the job's token."""
    csrf, cookie = login_form(master)
    fields: list[tuple[str, str]] = [("csrf", csrf), ("token", "w" * rng.randint(0, 40))]
    how = rng.choice(["wrong_token", "no_csrf", "no_token", "bad_csrf", "repeated", "many", "empty",
                      "not_utf8", "percent", "nul", "oversize", "good", "long_name", "unicode"])  # fmt: skip
    raw: bytes | None = None
    if how == "no_csrf":
        fields = fields[1:]
    elif how == "no_token":
        fields = fields[:1]
    elif how == "bad_csrf":
        fields[0] = ("csrf", csrf[:-1] + ("A" if csrf[-1] != "A" else "B"))
    elif how == "repeated":
        fields = [("csrf", "x"), *fields, ("token", "y")]
    elif how == "many":
        fields += [(f"f{i}", "1") for i in range(rng.randint(3, 50))]
    elif how == "empty":
        raw = rng.choice([b"", b"&", b"=", b"&&&", b"csrf", b"=&="])
    elif how == "not_utf8":
        raw = urlencode(fields).encode() + b"&x=\xff\xfe\xc3"
    elif how == "percent":
        raw = f"csrf={quote(csrf)}&token=%ff%fe%c3%28%ed%a0%80".encode()
    elif how == "nul":
        raw = urlencode(fields).encode().replace(b"token=", b"token=\x00", 1)
    elif how == "oversize":
        fields.append(("pad", "x" * rng.randint(LOGIN_BODY_MAX, 4 * LOGIN_BODY_MAX)))
    elif how == "good":
        fields[1] = ("token", master.token)
    elif how == "long_name":
        fields.append(("n" * rng.randint(100, 3000), "1"))
    elif how == "unicode":
        fields[1] = ("token", "токен\u202e" + "w" * 20)
    body = raw if raw is not None else urlencode(fields).encode()
    content_type = FORM if how in ("good", "wrong_token") else rng.choice(CONTENT_TYPES)
    headers = {"Connection": "close", "Cookie": f"{CSRF_COOKIE}={cookie}"}
    if content_type:
        headers["Content-Type"] = content_type
    chunked = rng.random() < 0.2
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
        request = http_request("POST", "/ui/login", headers).replace(
            b"Content-Length: %d\r\n" % len(body), b""
        )
        request += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    else:
        request = http_request("POST", "/ui/login", headers, body)
    return UiCase(f"login_{how}", request, _login_statuses(body, csrf, master.token, logins), "/ui/login")


def _login_statuses(body: bytes, csrf: str, token: str, logins: Logins) -> frozenset[int]:
    if len(body) > LOGIN_BODY_MAX or body.count(b"&") + 1 > 4:
        return frozenset({413})
    form = parse_qs(body.decode("utf-8", errors="replace"))
    if (form.get("csrf") or [""])[0] != csrf:
        return frozenset({403})
    if (form.get("token") or [""])[0].strip() == token:
        return frozenset({303})
    logins.wrong += 1
    # 401 until the address sent FAILURE_LIMIT wrong tokens; from then on 429 while they are within the
    # limiter's window, 401 again once they left it (the run outlasts the window): either, nothing else
    return frozenset({401}) if logins.wrong <= FAILURE_LIMIT else frozenset({401, 429})


COOKIE_VALUES = (
    "", "1.abc", f"{2**40}.{'0' * 64}", "9" * 400 + ".x", '"quoted"', "a=b=c", ";;;", "x" * 6000,
    "1700000000.deadbeef", "%ff%fe", "\\", "\u00e9\u00e8",
)  # fmt: skip


def cookies(master: WireMaster, rng: random.Random, logins: Logins) -> UiCase:
    """The page and its data with forged session cookies: the page redirects to the form (303), its data is
    refused (401); a header too large for the parser is a malformed request (400)."""
    path = rng.choice(["/ui", "/ui/status"])
    value = rng.choice(COOKIE_VALUES)
    jar = [f"{SESSION_COOKIE}={value}"] + [f"c{i}={rng.randrange(10**9)}" for i in range(rng.randint(0, 30))]
    rng.shuffle(jar)
    header = "; ".join(jar)
    if rng.random() < 0.2:
        header = header.replace(value, value + "\xff\xfe", 1)  # bytes past ASCII (obs-text)
    request = http_request("GET", path, {"Connection": "close", "Cookie": header})
    allowed = frozenset({303 if path == "/ui" else 401, 400})
    return UiCase("cookies", request, allowed, path)


PATH_PARTS = (
    "app.js", "app.css", "login", "status", "..", "%2e%2e", "%2f", "", "x" * 3000, "%00", "%ff", "page.html",
    "ui", "%252e", "login/", "status?x=1", "app.js%00", ";", "~", "%c0%ae",
)  # fmt: skip
METHODS = ("GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")


def paths(master: WireMaster, rng: random.Random, logins: Logins) -> UiCase:
    """Odd paths and methods under /ui: a static asset (200), the login form (200), the page (303 without a
    session), its data (401), 404 elsewhere, 405 for a method a route lacks; never 5xx."""
    segments = [rng.choice(PATH_PARTS) for _ in range(rng.randint(1, 3))]
    path = "/ui/" + "/".join(segments)
    if rng.random() < 0.3:
        path += "?" + rng.choice(["a=1", "%ff=%fe", "x" * 2000, "&&", "token=" + master.token[:4]])
    method = rng.choice(METHODS)
    body = b"x=1" if method in ("POST", "PUT", "PATCH") else b""
    request = http_request(method, path, {"Connection": "close"}, body)
    return UiCase("paths", request, UI_STATUSES - {429}, path.split("?")[0])


UI_KINDS: dict[str, Callable[[WireMaster, random.Random, Logins], UiCase]] = {
    "login": login_post,
    "cookies": cookies,
    "paths": paths,
}


def play_ui_case(master: WireMaster, case: UiCase) -> None:
    try:
        status, headers, body = master.http(case.request)
    except (OSError, ConnectionError) as exc:
        master.tally.fail("ui", f"{case.kind}: {type(exc).__name__}: {exc}: {case.request[:300]!r}")
        return
    master.tally.note(case.kind, status)
    what = f"{case.kind}: {status} {body[:200]!r} to {case.request[:300]!r}"
    if status not in case.statuses or status not in UI_STATUSES:
        master.tally.fail("ui", f"{what} (allowed {sorted(case.statuses)})")
    if status == 400:
        return  # h11's answer to a request it could not parse: no route ran
    missing = [name for name in SECURITY_HEADERS if name.lower() not in headers]
    if missing:
        master.tally.fail("ui", f"{what}: without the page's headers {missing}")
    if master.job.encode() in body or master.secret.encode() in body or master.token.encode() in body:
        master.tally.fail("ui", f"{what}: job data without a session")
    if case.path.rstrip("/") == "/ui/status" and status == 200:
        master.tally.fail("ui", f"{what}: the page's data without a session")


def fuzz_ui(master: WireMaster, cases: int, rng: random.Random) -> None:
    logins = Logins()
    kinds = sorted(UI_KINDS)
    for n in range(1, cases + 1):
        kind = rng.choice(kinds)
        case = UI_KINDS[kind](master, rng, logins)
        master.tally.cases[case.kind] += 1
        play_ui_case(master, case)
        master.beat(f"/ui case {case.kind} {case.request[:200]!r}")
        if n % STATE_EVERY == 0 or n == cases:
            master.check_log(f"/ui cases up to {case.kind}")
            master.check_state(f"/ui cases up to #{n}")


# -- a run ---------------------------------------------------------------------------------------------------
SURFACES = ("stream", "ui")


@dataclass(frozen=True)
class WireConfig:
    """How many cases of which surfaces, with which seed."""

    cases: int = CASES
    seed: int = 0
    surfaces: tuple[str, ...] = SURFACES


def run_wire_fuzz(config: WireConfig, folder: Path) -> WireTally:
    """``config.cases`` cases of each surface against a fresh master; every process is killed at the end."""
    tally = WireTally()
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(config.seed)
    with c.Group(folder) as group:
        master = WireMaster(folder, group, tally)
        if "stream" in config.surfaces:
            fuzz_stream(master, config.cases, rng)
        if "ui" in config.surfaces:
            fuzz_ui(master, config.cases, rng)
        master.check_log("the last case")
        master.sentinel.conn.close()
    return tally


def report(tally: WireTally, config: WireConfig, seconds: float) -> str:
    rows = [
        [
            kind,
            tally.cases.get(kind, 0),
            ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses[kind].items())),
        ]
        for kind in sorted(set(tally.cases) | set(tally.statuses))
    ]
    failures = sum(tally.failures.values())
    lines = [
        f"{sum(tally.cases.values())} cases in {seconds:.0f} s (seed {config.seed}) against `elastic-master "
        f"{' '.join(MASTER_ARGS)}` over 127.0.0.1: {', '.join(config.surfaces)}.",
        "",
        c.table(["case", "sent", "answers"], rows),
        "",
        f"The sentinel node heartbeated {tally.sentinel_beats} times on its own stream between cases; "
        f"`GET /v1/status` compared {tally.state_checks} times; {tally.closed_streams} fuzz streams closed "
        f"after a 413 as documented ({tally.resets} of them reset before the 413 was read).",
        "",
        f"Found: {tally.server_errors} answers 5xx, {failures} failures"
        + (f" ({dict(tally.failures)})" if failures else "")
        + ".",
    ]
    lines += [f"- {example}" for example in tally.examples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=CASES, help="cases per surface (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cases (default %(default)s)")
    p.add_argument("--surface", choices=[*SURFACES, "both"], default="both")
    p.add_argument("--workdir", default=None, help="keep the master's log here (default: a temp folder)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    args = p.parse_args(argv)
    surfaces = SURFACES if args.surface == "both" else (args.surface,)
    config = WireConfig(cases=args.cases, seed=args.seed, surfaces=surfaces)
    with c.workdir(args.workdir) as root:
        started = time.monotonic()
        tally = run_wire_fuzz(config, root / "wire")
        took = time.monotonic() - started
    c.emit_report(args, "Stream and status page fuzzing", report(tally, config, took))
    if args.json:
        args.json.write_text(json.dumps({"seed": config.seed, "seconds": round(took, 1), **tally.to_json()}))
    return c.finish(1 if tally.server_errors or tally.failures else 0)


if __name__ == "__main__":
    sys.exit(main())
