"""The job state as records in a real etcd (master/store/etcd_state.py through ``EtcdStore``): a state of the
previous release is read and converted, a save cut off half-way is never seen, a large save spans several
fenced transactions, and the history is compacted."""

from __future__ import annotations

import asyncio
import json
import uuid

import aetcd
import pytest
from etcd_snapshots import job_snapshot, without

from master.store import etcd_layout as layout
from master.store import etcd_state
from master.store.base import StoreError
from master.store.etcd_store import EtcdStore

pytestmark = pytest.mark.etcd


def run(coro, limit: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


def client_of(endpoint: str) -> aetcd.Client:
    host, port = endpoint.split(":")
    return aetcd.Client(host=host, port=int(port))


async def keys_of(endpoint: str, job: str) -> set[str]:
    client = client_of(endpoint)
    try:
        prefix = f"/elastic/{job}/".encode()
        return {kv.key[len(prefix) :].decode() for kv in await client.get_prefix(prefix)}
    finally:
        await client.close()


async def save_and_resign(endpoint: str, job: str, snapshot: dict) -> None:
    """A leader saves ``snapshot`` and closes (a successor may take over at once)."""
    store = await leading_store(endpoint, job)
    try:
        await store.save(snapshot)
    finally:
        await store.close()


async def leading_store(endpoint: str, job: str, name: str = "m") -> EtcdStore:
    store = EtcdStore(endpoint, job)
    await store.start()
    await store.campaign(name, lambda: None)
    return store


@pytest.mark.timeout(60)
def test_a_state_of_the_previous_release_is_read_and_replaced_by_records(etcd_endpoint: str):
    job = f"job-{uuid.uuid4().hex[:10]}"
    old = {**job_snapshot(4), "job_id": job}

    async def scenario() -> None:
        client = client_of(etcd_endpoint)
        await client.put(f"/elastic/{job}/state".encode(), json.dumps(old).encode())
        await client.close()
        store = await leading_store(etcd_endpoint, job)
        try:
            assert await store.load() == old
            new = {**old, "restart_count": 2}
            await store.save(new)
            assert await EtcdStore(etcd_endpoint, job).load() == new
            assert await keys_of(etcd_endpoint, job) == {"leader", *layout.encode(new)}
        finally:
            await store.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_a_root_of_a_newer_schema_is_one_line_naming_the_key_never_a_misreading(etcd_endpoint: str):
    job = f"job-{uuid.uuid4().hex[:10]}"

    async def scenario() -> str:
        client = client_of(etcd_endpoint)
        root = {"schema": layout.ROOT_SCHEMA + 1, layout.LAYOUT_KEY: layout.LAYOUT, "job": {}}
        await client.put(f"/elastic/{job}/state".encode(), json.dumps(root).encode())
        await client.close()
        store = await leading_store(etcd_endpoint, job)
        try:
            with pytest.raises(StoreError) as raised:
                await store.load()
            return str(raised.value)
        finally:
            await store.close()

    message = run(scenario())
    assert f"etcd key /elastic/{job}/state" in message and "\n" not in message
    assert f"its schema version {layout.ROOT_SCHEMA + 1} is not one this master reads" in message
    assert "run a newer elastic-master" in message


@pytest.mark.timeout(60)
def test_a_save_cut_off_half_way_is_not_seen_and_the_next_leader_cleans_it_up(etcd_endpoint: str):
    job = f"job-{uuid.uuid4().hex[:10]}"
    first = {**job_snapshot(40), "job_id": job}
    second = without(first, "node-3")
    second["restart_count"] = 1
    second["nodes"][0]["state"] = "failed"

    async def scenario() -> None:
        await save_and_resign(etcd_endpoint, job, first)
        # A deposed master's save that stopped before its root record: its other records are there.
        batches = layout.plan(layout.encode(first), layout.encode(second))
        partial = [(k, v) for batch in batches for k, v in batch if k != layout.ROOT and v is not None]
        assert partial
        client = client_of(etcd_endpoint)
        for key, value in partial:
            await client.put(f"/elastic/{job}/{key}".encode(), value)
        await client.close()
        assert await EtcdStore(etcd_endpoint, job).load() == first
        successor = await leading_store(etcd_endpoint, job, "successor")
        try:
            third = {**first, "restart_count": 5}
            await successor.save(third)
            assert await EtcdStore(etcd_endpoint, job).load() == third
            assert await keys_of(etcd_endpoint, job) == {"leader", *layout.encode(third)}
        finally:
            await successor.close()

    run(scenario())


@pytest.mark.timeout(120)
def test_a_large_save_spans_fenced_transactions_and_a_deposed_master_writes_nothing(etcd_endpoint: str):
    job = f"job-{uuid.uuid4().hex[:10]}"
    big = {**job_snapshot(1000), "job_id": job}

    async def scenario() -> None:
        store = await leading_store(etcd_endpoint, job)
        try:
            await store.save(big)
            assert store._records.last_txns > 1
            assert await EtcdStore(etcd_endpoint, job).load() == big
            small_change = without(big, "node-500")
            await store.save(small_change)
            assert store._records.last_txns == 1 and store._records.last_bytes < 16 * 1024
            # Another master takes the leader key (the lease of this one ran out, say): fenced out.
            client = client_of(etcd_endpoint)
            await client.delete(store.leader_key)
            await client.put(store.leader_key, b"usurper")
            await client.close()
            with pytest.raises(StoreError, match="no longer leads"):
                await store.save(without(small_change, "node-501"))
            assert await EtcdStore(etcd_endpoint, job).load() == small_change
        finally:
            await store.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_the_leader_compacts_the_history_before_its_previous_save(etcd_endpoint: str, monkeypatch):
    monkeypatch.setattr(etcd_state, "COMPACT_EVERY", 5)
    job = f"job-{uuid.uuid4().hex[:10]}"
    snapshot = {**job_snapshot(3), "job_id": job}

    async def scenario() -> None:
        store = await leading_store(etcd_endpoint, job)
        client = client_of(etcd_endpoint)
        try:
            await store.save(snapshot)
            first = (await client.get(f"/elastic/{job}/state".encode())).mod_revision
            for count in range(1, 12):
                await store.save({**snapshot, "restart_count": count})
            request = aetcd.rpc.RangeRequest(key=b"/", revision=first)
            with pytest.raises(aetcd.rpc.AioRpcError, match="compacted"):
                await client.kvstub.Range(request, timeout=5.0)
            assert (await EtcdStore(etcd_endpoint, job).load())["restart_count"] == 11
        finally:
            await client.close()
            await store.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_a_new_leader_saves_what_changed_since_its_load_without_reading_every_record_again(
    etcd_endpoint: str, monkeypatch
):
    job = f"job-{uuid.uuid4().hex[:10]}"
    first = {**job_snapshot(40), "job_id": job}
    reads: list[int] = []
    real_read = etcd_state.read_prefix

    async def counted(*args, **kwargs):
        reads.append(1)
        return await real_read(*args, **kwargs)

    async def scenario() -> None:
        await save_and_resign(etcd_endpoint, job, first)
        monkeypatch.setattr(etcd_state, "read_prefix", counted)
        successor = await leading_store(etcd_endpoint, job, "successor")
        try:
            loaded = await successor.load()
            assert loaded == first and len(reads) == 1
            changed = {**loaded, "restart_count": 2}
            await successor.save(changed)
            assert len(reads) == 1, "the load's read serves the first save's diff"
            assert successor._records.last_txns == 1  # the root record alone, not 40 nodes again
            assert await EtcdStore(etcd_endpoint, job).load() == changed
        finally:
            await successor.close()

    run(scenario())
