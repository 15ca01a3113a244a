"""A master that gets heartbeats faster than it can serve them degrades instead of falling over
(master/service/overload.py): within each pass of its event loop it serves heartbeats in the order they
arrived until the pass's budget is spent and sheds the rest at once (``429 busy``, which the agent retries
after its ``retry_after_s``), counts a shed heartbeat carrying its node's secret as a sign of life, and says
so where the operator looks: a ``master_overloaded`` event when it starts, ``master_overload_ended`` when it
ends, and the ``elastic_master_overloaded`` gauge.

The pure parts on a fake clock (the pass budget, the start and end of an overload, the receipt that keeps a
node alive), then a real master (``EmbeddedMaster``, real sockets, one stream per node) whose heartbeat
handler is made artificially slow: it must shed, report, and declare no node dead."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from typing import Any

import pytest
from e2e import wait_until
from embedded_masters import EmbeddedMasters, no_thread_left
from job_builders import HB_TIMEOUT, make_job, running
from job_calls import secrets_of
from stream_socket import StreamSocket, upgrade_request

from elastic.control.client import MasterClient
from elastic.control.error_table import Disposition, ErrorCode, MasterRejectedError
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
from master.job.job import Job
from master.service.overload import CALM_S, PASS_BUDGET_S, START_SHED, Admission, retry_after

pytestmark = pytest.mark.timeout(120)

TOKEN = "overload-test-token-0123"
JOB_ID = "job-overload"
NODES = 40
INTERVAL_S, TIMEOUT_S = 0.5, 2.0
#: The CPU the artificially slow handler costs per served heartbeat: a few of them fill a pass's budget.
SLOW_BEAT_S = PASS_BUDGET_S / 4


# -- the pure parts ----------------------------------------------------------------------------------------
def test_a_pass_serves_heartbeats_until_its_budget_is_spent_and_sheds_the_rest() -> None:
    clock = [0.0]
    admission = Admission(budget_s=0.02, clock=lambda: clock[0])

    async def two_passes() -> list[bool]:
        got = []
        for _ in range(5):  # one pass: 5 heartbeats read, 10 ms of work each
            got.append(admission.admit())
            clock[0] += 0.01
        await asyncio.sleep(0)  # the next pass of the loop
        got.append(admission.admit())
        return got

    assert asyncio.run(two_passes()) == [True, True, True, False, False, True]
    assert admission.shed == 2


def test_after_a_long_pass_the_next_serves_a_share_of_its_length() -> None:
    clock = [0.0]
    admission = Admission(budget_s=0.02, clock=lambda: clock[0])

    async def passes() -> list[int]:
        served = []
        for _ in range(3):
            got = 0
            for _ in range(100):  # 100 heartbeats read in each pass, 10 ms of work each: a second
                got += admission.admit()
                clock[0] += 0.01
            served.append(got)
            await asyncio.sleep(0)
        return served

    first, second, third = asyncio.run(passes())
    assert first == 3, "a pass's own budget"
    assert second > first and third > first, "half of the previous (long) pass"


def test_an_overload_starts_with_shedding_two_seconds_in_a_row_and_ends_after_calm() -> None:
    admission = Admission()
    served = 0
    assert admission.judge(0.0, served) is None  # the first mark
    admission.shed += START_SHED - 1  # a few shed in a second (one long pass): no overload
    served += 1000
    assert admission.judge(1.0, served) is None and not admission.overloaded
    admission.shed += START_SHED
    served += 100  # over 1 % of those received shed: once is a burst
    assert admission.judge(2.0, served) is None and not admission.overloaded
    admission.shed += START_SHED
    served += 100  # twice in a row: an overload
    assert admission.judge(3.0, served) is True and admission.overloaded
    now = 3.0
    while now < 3.0 + CALM_S - 1.0:  # a few shed now and then, but not calm for long enough yet
        now += 1.0
        served += 1000
        admission.shed += 1
        assert admission.judge(now, served) is None
    now += 1.0
    assert admission.judge(now, served + 1000) is False and not admission.overloaded


def test_a_shed_heartbeat_keeps_its_incarnation_alive_and_no_other() -> None:
    job = make_job()
    running(job, 0.0, "a", "b")
    now = 0.0
    while now < 3 * HB_TIMEOUT:  # every heartbeat of a shed on receipt; b's carry a wrong secret
        now += 1.0
        job.heard("a", secrets_of(job)["a"], now)
        job.heard("b", "not-b-s-secret", now)
        job.tick(now)
    assert "a" in job.nodes, "a node whose heartbeats were shed is alive"
    assert "b" not in job.nodes, "a shed heartbeat with another secret is no sign of b's life"


# -- a real master whose heartbeat handler is slow ---------------------------------------------------------
class Masters(EmbeddedMasters):
    token = TOKEN
    job_id = JOB_ID


def _events(masters: Masters, http: Any) -> list[str]:
    return [e["kind"] for e in http.get("/v1/status").json()["events"]]


def _gauge(http: Any) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("elastic_master_overloaded{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no elastic_master_overloaded gauge on /metrics")


def test_an_overloaded_master_sheds_reports_and_declares_no_node_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with no_thread_left(), Masters() as masters:
        master = masters.start(
            min_nodes=NODES, max_nodes=NODES, heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S
        )
        http = masters.http(master)
        ids = itertools.count(1)
        streams: dict[str, StreamSocket] = {}
        secrets: dict[str, str] = {}
        for i in range(NODES):
            node = f"node-{i}"
            stream = streams[node] = masters.keep(
                StreamSocket.open((master.host, master.port), upgrade_request(TOKEN, JOB_ID))
            )
            body = dict(node_id=node, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=NODES)
            reply = stream.call(id=next(ids), op="join", body=body | {"max_nodes": NODES})
            assert reply["status"] == 200, reply
            secrets[node] = reply["body"]["node_secret"]
        statuses: Counter[int] = Counter()

        def beat_all() -> None:
            """Every node sends a heartbeat on its stream at once, then every reply is read."""
            sent = {}
            for node, stream in streams.items():
                sent[node] = call_id = next(ids)
                body = dict(node_id=node, round=0, state="waiting")
                stream.send(id=call_id, op="heartbeat", secret=secrets[node], body=body)
            for node, stream in streams.items():
                reply = stream.reply()
                assert reply["id"] == sent[node], reply
                statuses[reply["status"]] += 1
                if reply["status"] == 429:  # shed: the agent waits before its next beat, its node still alive
                    assert reply["body"]["error"] == ErrorCode.BUSY, reply
                    assert 0 < reply["body"]["retry_after_s"] <= TIMEOUT_S / 2, reply

        for node, stream in streams.items():  # calm: one heartbeat at a time, each served
            body = dict(node_id=node, round=0, state="waiting")
            reply = stream.call(id=next(ids), op="heartbeat", secret=secrets[node], body=body)
            assert reply["status"] == 200, reply
        heartbeat = Job.heartbeat

        def slow_heartbeat(self: Job, *args: Any, **kwargs: Any) -> Any:
            spent = time.thread_time() + SLOW_BEAT_S  # a slow handler: a few heartbeats fill a pass's budget
            while time.thread_time() < spent:
                pass
            return heartbeat(self, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(Job, "heartbeat", slow_heartbeat)
            wait_until(
                lambda: beat_all() or "master_overloaded" in _events(masters, http),
                30.0,
                "the master to report an overload",
            )
            assert _gauge(http) == 1.0
            started = time.monotonic()
            while time.monotonic() - started < 2 * TIMEOUT_S:  # overloaded for two heartbeat timeouts
                beat_all()
        assert statuses[429] > 0 and set(statuses) == {200, 429}, statuses
        # Served at their pace again: the overload ends once nothing was shed for CALM_S.
        wait_until(
            lambda: beat_all() or "master_overload_ended" in _events(masters, http),
            CALM_S + 20.0,
            "the overload to end",
        )
        assert _gauge(http) == 0.0
        kinds = _events(masters, http)
        assert "node_dead" not in kinds and "node_suspect" not in kinds, kinds
        status = http.get("/v1/status").json()
        assert len(status["nodes"]) == NODES, "every node is still part of the job"


class ShedsAll(Admission):
    """A master's admission that sheds every heartbeat, noting when each arrived (the master's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[float] = []

    def admit(self) -> bool:
        self.arrivals.append(time.monotonic())
        self.shed += 1
        return False


def test_the_agents_stream_client_waits_retry_after_before_its_next_heartbeat() -> None:
    with no_thread_left(), Masters() as masters:
        master = masters.start(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S)
        wait = retry_after(INTERVAL_S, TIMEOUT_S)
        client = masters.keep(
            MasterClient([master.address], JOB_ID, TOKEN, request_timeout=10.0, stream=True)
        )
        join = JoinRequest(node_id="a", host="127.0.0.1", nproc=1, store_port=29501, min_nodes=2, max_nodes=2)
        client.join(join)
        shedding = master.service.admission = ShedsAll()
        beat = HeartbeatRequest(node_id="a", round=0, state=NodeState.WAITING)
        for _ in range(2):
            with pytest.raises(MasterRejectedError) as refused:
                client.heartbeat(beat)
            assert refused.value.status == 429 and refused.value.disposition is Disposition.RETRY
            assert refused.value.code == ErrorCode.BUSY
        first, second = shedding.arrivals
        assert second - first >= wait, "the second heartbeat waited the shed one's retry_after_s"
