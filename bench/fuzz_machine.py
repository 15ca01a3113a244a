"""The hypothesis state machine of the API fuzzer (bench/fuzz_engine.py): a fleet of nodes speaking to the
master, with requests generated from its OpenAPI document, and now and then a batch of refusals
(bench/fuzz_refusals.py).

A join that succeeds puts its node id and ``node_secret`` in a bundle, and later requests for that node
(round, heartbeat, watch, leave, rejoin) carry the secret in ``X-Elastic-Node-Secret``, so that the
requests reach the job's logic instead of stopping at 404."""

from __future__ import annotations

import json

import schemathesis
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

from bench.fuzz_job import (
    MAX_NODES,
    METRICS,
    MIN_NODES,
    POLL_TIMEOUTS,
    UI_READS,
    VALID_HOSTS,
    WITH_INPUT,
)
from bench.fuzz_refusals import refusal_batch
from bench.fuzz_target import Target
from master.http.ui import SESSION_COOKIE

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
        """``node`` for the bundle if the join was admitted, else nothing."""
        return node if self.target.record_join(node, response) else multiple()

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
        return node if t.record_join(node, response) else None

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
        """A batch of requests the master must refuse (see :func:`bench.fuzz_refusals.refusal_batch`)."""
        self.steps_since_batch = 0
        refusal_batch(self.target, data, self.batch_size)


def machine_for(target: Target, batch_gap: int, batch_size: int) -> type[ApiMachine]:
    """The machine class for ``target`` (hypothesis builds one instance per example, without arguments)."""
    fields = {"target": target, "batch_gap": batch_gap, "batch_size": batch_size}
    return type("FuzzMachine", (ApiMachine,), fields)
