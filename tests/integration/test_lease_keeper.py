"""The leader's etcd lease is renewed from its own thread: a busy or blocked master loop keeps its term.

At 10,000 nodes the master's asyncio loop runs near saturation and meets a reconnect storm after a
failover; a renewal queued on that loop came back too late and the leader stepped down. These tests
block the loop outright (a synchronous sleep inside it, longer than the lease TTL) against a real etcd.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import aetcd
import pytest

from master.store.etcd_store import EtcdStore

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

#: Lease TTL of the stores under test (etcd grants at least 2 s on a default server).
TTL = 2


class LostCounter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def _client(endpoint: str) -> aetcd.Client:
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=5)


def test_a_leader_whose_loop_is_blocked_past_its_lease_keeps_its_term(etcd_endpoint: str) -> None:
    job = f"job-{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        leader = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        standby = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost, client = LostCounter(), _client(etcd_endpoint)
        try:
            await leader.campaign("leader", lost)
            key = await client.get(f"/elastic/{job}/leader".encode())
            assert key is not None
            standby_campaign = asyncio.create_task(standby.campaign("standby", LostCounter()))
            await asyncio.sleep(0)  # the standby starts watching for a vacancy
            time.sleep(2.5 * TTL)  # noqa: ASYNC251 - the point: the leader's loop does nothing for 2.5 TTLs
            assert leader.leading, "renewed while its loop was blocked"
            done, _ = await asyncio.wait({standby_campaign}, timeout=TTL)
            assert not done, "the standby found no vacancy"
            now = await client.get(f"/elastic/{job}/leader".encode())
            assert now is not None and (now.value, now.lease) == (b"leader", key.lease)
            await leader.save({"n": 1})
            assert lost.calls == 0
            await leader.close()  # revokes the lease: the standby takes over at once
            await asyncio.wait_for(standby_campaign, 5.0)
            assert await standby.load() == {"n": 1}
        finally:
            await client.close()
            await leader.close()
            await standby.close()

    asyncio.run(asyncio.wait_for(scenario(), 45.0))


def test_a_keeper_that_finds_its_lease_revoked_ends_the_term_once(etcd_endpoint: str) -> None:
    job = f"job-{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        leader = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        lost, client = LostCounter(), _client(etcd_endpoint)
        try:
            await leader.campaign("leader", lost)
            key = await client.get(f"/elastic/{job}/leader".encode())
            assert key is not None
            await client.revoke_lease(key.lease)
            deadline = time.monotonic() + 2 * TTL
            while lost.calls == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert lost.calls == 1 and not leader.leading
            # The keeper that reported it has stopped: nothing renews that lease or reports it again.
            deadline = time.monotonic() + 2 * TTL
            while any(t.name == f"etcd-lease-{key.lease:x}" for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the keeper thread of the lost term is still running"
                await asyncio.sleep(0.02)
            assert lost.calls == 1
        finally:
            await client.close()
            await leader.close()

    asyncio.run(asyncio.wait_for(scenario(), 45.0))


def test_a_closed_store_leaves_no_thread_of_its_own(etcd_endpoint: str) -> None:
    job = f"job-{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        store = EtcdStore(etcd_endpoint, job, lease_ttl_s=TTL)
        try:
            await store.campaign("leader", LostCounter())
            await store.save({"n": 1})
            assert await store.load() == {"n": 1}
            names = {t.name for t in threading.enumerate()}
            assert {f"etcd-campaign-{job}", f"etcd-lease-{store._keeper.lease_id:x}"} <= names
        finally:
            await store.close()
        left = {t.name for t in threading.enumerate()} & {f"etcd-campaign-{job}"}
        assert not left and not any(t.name.startswith("etcd-lease-") for t in threading.enumerate())

    asyncio.run(asyncio.wait_for(scenario(), 45.0))
