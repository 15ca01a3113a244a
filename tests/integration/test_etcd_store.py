"""``EtcdStore`` against a real etcd server: state round trip, leader election and takeover, fencing of a
deposed leader, etcd loss, fast failure when etcd is unreachable; then two real masters on one etcd.

The etcd server comes from the fixtures in ``conftest.py`` (a missing etcd binary fails these tests, it
never skips them). Every wait polls with a deadline; every process a test starts is killed by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd
import httpx
import pytest
from etcd_server import EtcdServer, free_port

from elastic.control.client import MasterClient
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import (
    JOB_HEADER,
    NODE_SECRET_HEADER,
    Command,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    NodeState,
    WorkerFailure,
)
from master.cli.options import check_store, open_store
from master.http.serving import EmbeddedMaster
from master.job.liveness import hash_secret
from master.service.settings import ServerSettings
from master.store import etcd_layout
from master.store.base import StoreError, StoreUnreachableError
from master.store.etcd_store import EtcdStore

pytestmark = pytest.mark.etcd

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "etcd-test-token"
#: Lease TTL of the stores under test (etcd grants at least 2 s on a default server).
TTL = 2


def new_job() -> str:
    return f"job-{uuid.uuid4().hex[:10]}"


def run(coro: Awaitable[Any], limit: float = 30.0) -> Any:
    """Run ``coro`` on a fresh event loop, failing (not hanging) after ``limit`` seconds."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


class LostCounter:
    """An ``on_lost`` callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; return the seconds it took, fail after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def still_blocked(task: asyncio.Task, for_s: float) -> bool:
    """True if ``task`` is still running after ``for_s`` seconds (a bounded wait, not a sleep)."""
    done, _ = await asyncio.wait({task}, timeout=for_s)
    return not done


async def raw_client(endpoint: str) -> aetcd.Client:
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=5)


async def leader_of(store: EtcdStore) -> str | None:
    """The candidate string in ``store``'s leader key, read with a client of the test's own; None when the
    key is vacant."""
    client = await raw_client(store.endpoint)
    try:
        kv = await client.get(store.leader_key)
    finally:
        await client.close()
    return None if kv is None else kv.value.decode()


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


# -- state ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_save_load_round_trip(etcd_endpoint: str):
    job = new_job()
    snapshot = {"job_id": job, "restart_count": 2, "nodes": [{"node_id": "a", "round": 3}], "text": "ünï"}

    async def scenario() -> None:
        store = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        reader = EtcdStore(etcd_endpoint, job)
        try:
            await store.start()
            assert store.durable is True
            assert await store.load() is None, "a new job has no state"
            assert await leader_of(store) is None
            await store.campaign("master-a", LostCounter())
            assert await leader_of(store) == "master-a"
            await store.save(snapshot)
            assert await store.load() == snapshot
            await reader.start()
            assert await reader.load() == snapshot, "another master (a fresh client) reads the same state"
            snapshot["restart_count"] = 3
            await store.save(snapshot)
            assert (await reader.load())["restart_count"] == 3
            client = await raw_client(etcd_endpoint)
            try:
                keys = {kv.key for kv in await client.get_prefix(f"/elastic/{job}/".encode())}
            finally:
                await client.close()
            # Only the records of the last save are left (the first save's changed ones were replaced).
            records = {f"/elastic/{job}/{k}".encode() for k in etcd_layout.encode(snapshot)}
            assert keys == {f"/elastic/{job}/leader".encode(), *records}
        finally:
            await store.close()
            await reader.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_save_without_leadership_is_refused(etcd_endpoint: str):
    async def scenario() -> None:
        store = EtcdStore(etcd_endpoint, new_job())
        try:
            await store.start()
            with pytest.raises(StoreError, match="does not lead"):
                await store.save({"x": 1})
            assert await store.load() is None
        finally:
            await store.close()

    run(scenario())


# -- leader election --------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_one_of_two_campaigners_leads_and_the_other_takes_over_when_it_closes(etcd_endpoint: str):
    job = new_job()

    async def scenario() -> None:
        a, b = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL), EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost_a, lost_b = LostCounter(), LostCounter()
        try:
            await a.start()
            await b.start()
            await a.campaign("master-a", lost_a)
            await a.save({"by": "a"})
            b_campaign = asyncio.create_task(b.campaign("master-b", lost_b))
            assert await still_blocked(b_campaign, 3 * TTL / 2), "b waits while a leads (past a's TTL too)"
            assert await leader_of(b) == "master-a"
            with pytest.raises(StoreError):
                await b.save({"by": "b"})

            start = time.monotonic()
            await a.close()  # a clean shutdown revokes the lease: b is elected at once, not after a TTL
            await asyncio.wait_for(b_campaign, 5.0)
            assert time.monotonic() - start < 1.5
            assert await leader_of(b) == "master-b"
            assert await b.load() == {"by": "a"}
            await b.save({"by": "b"})
            assert await b.load() == {"by": "b"}
            assert (lost_a.calls, lost_b.calls) == (0, 0), "a resigned; nobody lost anything"
        finally:
            await a.close()
            await b.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_a_leader_that_resigns_hands_over_at_once_and_can_campaign_again(etcd_endpoint: str):
    """``resign`` (a leader suspecting its own network, master.service.service): the lease is revoked, no
    ``on_lost``, and the store stays open for the next campaign."""
    job = new_job()

    async def scenario() -> None:
        a, b = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL), EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost_a, lost_b = LostCounter(), LostCounter()
        try:
            await a.start()
            await b.start()
            await a.campaign("master-a", lost_a)
            await a.save({"by": "a", "silent_incident": ["n1", "n2"]})
            b_campaign = asyncio.create_task(b.campaign("master-b", lost_b))
            assert await still_blocked(b_campaign, TTL / 2), "b waits while a leads"
            await a.resign()
            assert not a.leading
            await asyncio.wait_for(b_campaign, 5.0)  # revoked: no wait for the lease to expire
            assert await leader_of(b) == "master-b"
            assert await b.load() == {"by": "a", "silent_incident": ["n1", "n2"]}, "the incident went over"
            with pytest.raises(StoreError):
                await a.save({"by": "a, resigned"})
            a_again = asyncio.create_task(a.campaign("master-a", lost_a))
            assert await still_blocked(a_again, TTL / 2), "the resigned store stands by"
            await b.close()
            await asyncio.wait_for(a_again, 5.0)
            await a.save({"by": "a again"})
            assert await a.load() == {"by": "a again"}
            assert (lost_a.calls, lost_b.calls) == (0, 0), "resigning is quiet"
        finally:
            await a.close()
            await b.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_three_campaigners_elect_exactly_one_at_a_time(etcd_endpoint: str):
    job = new_job()

    async def scenario() -> None:
        stores = [EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL) for _ in range(3)]
        tasks = {asyncio.create_task(s.campaign(f"m{i}", LostCounter())): s for i, s in enumerate(stores)}
        try:
            for _ in range(3):
                done, _ = await asyncio.wait(set(tasks), timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
                assert len(done) == 1, "exactly one campaign returns at a time"
                assert not await still_blocked_any(set(tasks) - done, 0.5)
                (task,) = done
                task.result()
                winner = tasks.pop(task)
                assert winner.leading
                assert await leader_of(winner) == f"m{stores.index(winner)}"
                await winner.close()
        finally:
            for task in tasks:
                await cancel(task)
            for store in stores:
                await store.close()

    async def still_blocked_any(pending: set[asyncio.Task], for_s: float) -> bool:
        if not pending:
            return False
        done, _ = await asyncio.wait(pending, timeout=for_s)
        return bool(done)

    run(scenario())


LEADER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from master.store.etcd_store import EtcdStore

    async def main():
        store = EtcdStore(sys.argv[1], sys.argv[2], lease_ttl_s=float(sys.argv[3]))
        await store.start()
        await store.campaign("doomed", lambda: None)
        await store.save({"by": "doomed"})
        print("LEADING", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line, failing after ``timeout`` seconds or when it exits."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no line from pid {proc.pid} within {timeout}s")
            if sel.select(remaining):
                line = proc.stdout.readline()
                if not line:
                    pytest.fail(f"pid {proc.pid} exited with {proc.wait(5)}: {proc.stderr.read()}")
                return line.strip()


@pytest.mark.timeout(60)
def test_standby_is_elected_when_the_leader_dies_without_resigning(etcd_endpoint: str):
    """A SIGKILLed leader revokes nothing: its lease expires after the TTL and the standby takes over."""
    job = new_job()
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER_SCRIPT, etcd_endpoint, job, str(TTL)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert read_line(proc, 20.0) == "LEADING"

        async def scenario() -> None:
            standby = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
            lost = LostCounter()
            try:
                await standby.start()
                campaign = asyncio.create_task(standby.campaign("standby", lost))
                assert await still_blocked(campaign, 3 * TTL / 2), "the live leader renews its lease"
                os.kill(proc.pid, signal.SIGKILL)
                start = time.monotonic()
                await asyncio.wait_for(campaign, TTL + 5.0)
                took = time.monotonic() - start
                assert took < TTL + 3.0, f"takeover took {took:.1f}s with a {TTL}s lease"
                assert await leader_of(standby) == "standby"
                assert await standby.load() == {"by": "doomed"}, "the dead leader's state survives"
                assert lost.calls == 0
            finally:
                await standby.close()

        run(scenario())
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


# -- fencing ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_deposed_leader_cannot_overwrite_the_new_leaders_state(etcd_endpoint: str):
    """The old leader still believes it leads (its long lease has not been checked again), yet its save is
    refused by the transaction on the leader key, and it then steps down exactly once."""
    job = new_job()

    async def scenario() -> None:
        old = EtcdStore(etcd_endpoint, job, lease_ttl_s=60)  # renews every 20 s: it will not notice in time
        new = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost_old = LostCounter()
        client = await raw_client(etcd_endpoint)
        try:
            await old.campaign("old", lost_old)
            await old.save({"by": "old", "n": 1})
            new_campaign = asyncio.create_task(new.campaign("new", LostCounter()))
            assert await still_blocked(new_campaign, 0.5)
            await client.delete(f"/elastic/{job}/leader".encode())  # e.g. an operator, or a partition
            await asyncio.wait_for(new_campaign, 5.0)
            await new.save({"by": "new", "n": 2})

            assert old.leading and lost_old.calls == 0, "the old leader has not noticed yet"
            with pytest.raises(StoreError, match="no longer leads"):
                await old.save({"by": "old", "n": 3})
            assert await new.load() == {"by": "new", "n": 2}, "the new leader's state is intact"
            assert not old.leading and lost_old.calls == 1
            with pytest.raises(StoreError):
                await old.save({"by": "old", "n": 4})
            assert lost_old.calls == 1, "on_lost is called exactly once"
            assert await leader_of(new) == "new"
            await new.save({"by": "new", "n": 5})
        finally:
            await client.close()
            await old.close()
            await new.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_leader_steps_down_once_when_its_lease_is_revoked(etcd_endpoint: str):
    job = new_job()

    async def scenario() -> None:
        leader = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        standby = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost = LostCounter()
        client = await raw_client(etcd_endpoint)
        try:
            await leader.campaign("leader", lost)
            await leader.save({"n": 1})
            standby_campaign = asyncio.create_task(standby.campaign("standby", LostCounter()))
            kv = await client.get(f"/elastic/{job}/leader".encode())
            assert kv is not None and kv.lease
            await client.revoke_lease(kv.lease)
            await asyncio.wait_for(standby_campaign, 5.0)
            await eventually(lambda: lost.calls > 0, TTL, "the leader to notice that its lease is gone")
            assert not leader.leading
            with pytest.raises(StoreError):
                await leader.save({"n": 2})
            await standby.save({"n": 3})
            assert await standby.load() == {"n": 3}
            assert lost.calls == 1
        finally:
            await client.close()
            await leader.close()
            await standby.close()

    run(scenario())


# -- etcd loss --------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_leader_steps_down_when_etcd_is_lost_and_leads_again_when_it_is_back(etcd_server: EtcdServer):
    job = new_job()

    async def scenario() -> None:
        store = EtcdStore(etcd_server.endpoint, job, lease_ttl_s=TTL)
        lost = LostCounter()
        try:
            await store.start()
            await store.campaign("m1", lost)
            await store.save({"round": 7})
            etcd_server.stop()
            took = await eventually(lambda: lost.calls == 1, TTL + 2.0, "the leader to step down")
            assert took < TTL, "it steps down before its lease could have expired"
            assert not store.leading
            with pytest.raises(StoreError):
                await store.save({"round": 8})

            again = LostCounter()
            campaign = asyncio.create_task(store.campaign("m1", again))
            assert await still_blocked(campaign, 1.0), "no leader while etcd is down"
            await asyncio.to_thread(etcd_server.start)
            await asyncio.wait_for(campaign, 15.0)  # the stale lease is revoked: no wait for its expiry
            assert await store.load() == {"round": 7}
            await store.save({"round": 8})
            assert await store.load() == {"round": 8}
            assert (lost.calls, again.calls) == (1, 0)
        finally:
            await store.close()

    run(scenario(), limit=60.0)


@pytest.mark.timeout(30)
def test_start_against_a_closed_port_fails_fast_with_one_line():
    port = free_port()  # nothing listens there
    store = EtcdStore(f"127.0.0.1:{port}", new_job())

    async def scenario() -> str:
        try:
            start = time.monotonic()
            with pytest.raises(StoreError) as info:
                await store.start()
            assert time.monotonic() - start < 4.0
            return str(info.value)
        finally:
            await store.close()

    message = run(scenario())
    assert "\n" not in message
    assert message.startswith(f"etcd at 127.0.0.1:{port} is unreachable: ")
    assert message.endswith("; start etcd or fix --store")


@pytest.mark.timeout(30)
def test_check_store_fails_fast_for_an_unreachable_etcd_and_passes_for_a_live_one(etcd_endpoint: str):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        check_store(f"etcd://127.0.0.1:{port}", new_job())
    assert time.monotonic() - start < 4.0
    message = str(info.value)
    assert "\n" not in message and f"127.0.0.1:{port} is unreachable" in message and "--store" in message

    # Several endpoints: the first dead one is skipped.
    check_store(f"etcd://127.0.0.1:{port},{etcd_endpoint}", new_job())
    check_store(f"etcd://{etcd_endpoint}", new_job())
    with pytest.raises(StoreError) as info:
        open_store("etcd://no-port-here", new_job())
    assert "HOST:PORT" in str(info.value)
    assert isinstance(open_store(f"etcd://{etcd_endpoint}", "j"), EtcdStore)


# -- two masters on one etcd ------------------------------------------------------------------------------
def info_status(master: EmbeddedMaster, job: str) -> tuple[int, str | None]:
    try:
        response = httpx.get(
            f"http://{master.address}/v1/info",
            timeout=5.0,
            trust_env=False,
            headers={"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job},
        )
    except httpx.TransportError:
        return 0, None
    error = response.json().get("error") if response.status_code != 200 else None
    return response.status_code, error


def status_of(master: EmbeddedMaster, job: str) -> dict[str, Any]:
    response = httpx.get(
        f"http://{master.address}/v1/status",
        timeout=5.0,
        trust_env=False,
        headers={"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job},
    )
    assert response.status_code == 200, response.text
    data = response.json()
    for row in data["nodes"]:
        row.pop("heartbeat_age_s")
    return data


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def join_reply(client: MasterClient, node_id: str) -> JoinReply:
    req = JoinRequest(node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=2, max_nodes=2)
    return client.join(req)


def join(client: MasterClient, node_id: str) -> int:
    return join_reply(client, node_id).round


def beat(
    client: MasterClient,
    node_id: str,
    round_: int,
    state: NodeState = NodeState.RUNNING,
    failure: WorkerFailure | None = None,
):
    return client.heartbeat(HeartbeatRequest(node_id=node_id, round=round_, state=state, failure=failure))


@pytest.mark.timeout(120)
def test_two_masters_on_one_etcd_one_leads_and_the_standby_takes_over_with_the_state(etcd_endpoint: str):
    job = new_job()
    settings = ServerSettings(
        job=JobSettings(
            job_id=job,
            min_nodes=2,
            max_nodes=2,
            last_call_s=0.5,
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=30.0,
            max_restarts=5,
        ),
        token=TOKEN,
        host="127.0.0.1",
        port=0,
        store_url=f"etcd://{etcd_endpoint}",
    )
    masters = [
        EmbeddedMaster(settings, store=EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)) for _ in range(2)
    ]
    client = MasterClient([m.address for m in masters], job, TOKEN, request_timeout=10.0)
    try:
        for master in masters:
            master.start()
        wait_for(
            lambda: sorted(info_status(m, job)[0] for m in masters) == [200, 503],
            10.0,
            "one master to lead and the other to stand by",
        )
        leader, standby = sorted(masters, key=lambda m: info_status(m, job)[0] != 200)
        assert info_status(standby, job) == (503, "not_leader")
        assert client.info().master_id == leader.service.master_id

        # Round 1, a worker failure (a restart), round 2 with both nodes running.
        joined = {node_id: join_reply(client, node_id) for node_id in ("a", "b")}
        assert [reply.round for reply in joined.values()] == [1, 1]
        secrets = {node_id: reply.node_secret for node_id, reply in joined.items()}
        assert client.next_round("a", 0, 5.0).status == "assigned"
        assert beat(client, "a", 1).command is Command.CONTINUE
        assert beat(client, "b", 1).command is Command.CONTINUE
        failure = WorkerFailure(rank=1, local_rank=0, exit_code=1, message="RuntimeError: boom")
        assert beat(client, "b", 1, NodeState.FAILED, failure).command is Command.REJOIN
        assert (join(client, "a"), join(client, "b")) == (2, 2)
        for node_id in ("a", "b"):
            reply = client.next_round(node_id, 1, 5.0)
            assert (reply.status, reply.assignment.round) == ("assigned", 2)
            assert beat(client, node_id, 2).command is Command.CONTINUE
        before = status_of(leader, job)
        assert (before["round"], before["restart_count"], before["phase"]) == (2, 1, "training")
        assert {row["node_id"]: row["state"] for row in before["nodes"]} == {"a": "running", "b": "running"}

        def persisted() -> bool:
            snap = run(EtcdStore(etcd_endpoint, job).load(), limit=10.0)
            return (
                bool(snap)
                and snap["rendezvous"]["round"] == 2
                and snap["restart_count"] == 1
                and {n["node_id"] for n in snap["nodes"]} == {"a", "b"}  # their states are soft
            )

        wait_for(persisted, 10.0, "the leader to persist the job state in etcd")
        # The nodes' credentials are durable: their hashes, never the secrets themselves.
        stored = run(EtcdStore(etcd_endpoint, job).load(), limit=10.0)
        assert {n["node_id"]: n["secret_hash"] for n in stored["nodes"]} == {
            node_id: hash_secret(secret) for node_id, secret in secrets.items()
        }
        assert not [secret for secret in secrets.values() if secret in json.dumps(stored)]

        leader.stop()
        took = wait_for(lambda: info_status(standby, job)[0] == 200, 5.0, "the standby to take over")
        assert took < 3.0
        after = status_of(standby, job)
        assert after["master_id"] == standby.service.master_id != before["master_id"]
        for key in ("round", "restart_count", "phase", "world_size", "nnodes", "nodes"):
            assert after[key] == before[key], key

        # The agents' client moves to the new leader by itself; the round goes on, nothing is restarted:
        # the new leader accepts the nodes' secrets, and only them.
        reply = beat(client, "a", 2)
        assert (reply.command, reply.round) == (Command.CONTINUE, 2)
        assert reply.master_id == standby.service.master_id
        forged = httpx.post(f"http://{standby.address}/v1/heartbeat", timeout=5.0, trust_env=False,
                            json={"node_id": "a", "round": 2, "state": "failed"},
                            headers={"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job,
                                     NODE_SECRET_HEADER: secrets["b"]})  # fmt: skip
        assert forged.status_code == 403 and forged.json()["error"] == "bad_node_secret", forged.text
        assert client.status().restart_count == 1
    finally:
        client.close()
        for master in masters:
            master.stop()


@pytest.mark.timeout(120)
def test_a_master_told_to_wait_for_its_store_starts_once_etcd_is_back(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A standby restarted by its supervisor while etcd is down (chaos finding 11) waits for it with
    # --store-wait, where it exited at once; a refusal or a closed port with no wait still fails at once.
    etcd_server.stop()
    url = f"etcd://{etcd_server.endpoint}"
    with pytest.raises(StoreUnreachableError):
        check_store(url, new_job())  # --store-wait 0: the fast failure, as before
    outcome: list[BaseException | None] = []

    def start_master() -> None:
        try:
            check_store(url, new_job(), wait_s=90.0)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    with caplog.at_level(logging.INFO, logger="master.cli.options"):
        waiter = threading.Thread(target=start_master, daemon=True)  # never holds the test run open
        waiter.start()
        try:
            deadline = time.monotonic() + 60
            while "--store-wait" not in caplog.text and time.monotonic() < deadline and waiter.is_alive():
                waiter.join(0.05)  # until it says it waits (a condition, bounded)
            assert "waiting for it" in caplog.text, "it waits, saying so"
        finally:
            etcd_server.start()
            waiter.join(90)
    assert outcome == [None], outcome
    assert "the store answers: starting" in caplog.text
