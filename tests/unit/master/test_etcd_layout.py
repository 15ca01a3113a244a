"""The etcd record layout of a job snapshot (master/store/etcd_layout.py): a round trip, and a save that
writes
what changed, as many bytes for a node leaving a 1,000-node job as for one leaving a 100-node job."""

from __future__ import annotations

import pytest
from etcd_snapshots import job_snapshot, without

from master.store import etcd_layout as layout


def plan_bytes(old: dict, new: dict) -> int:
    batches = layout.plan(layout.encode(old), layout.encode(new))
    return sum(len(v) for batch in batches for _, v in batch if v is not None)


@pytest.mark.timeout(60)
def test_a_snapshot_round_trips_through_its_records():
    snapshot = job_snapshot(300)
    records = layout.encode(snapshot)
    assert layout.decode(records) == snapshot
    assert sum(k.startswith(layout.NODE) for k in records) == 300
    assert max(len(v) for v in records.values()) < 64 * 1024


@pytest.mark.timeout(60)
def test_slots_that_do_not_follow_from_their_position_are_kept_as_they_are():
    snapshot = job_snapshot(5)
    snapshot["rendezvous"]["current"]["slots"][2]["rank_offset"] = 77
    assert layout.decode(layout.encode(snapshot)) == snapshot


@pytest.mark.timeout(60)
def test_a_missing_record_is_named():
    records = layout.encode(job_snapshot(3))
    del records[layout.NODE + "node-1"]
    with pytest.raises(layout.LayoutError, match="node/node-1"):
        layout.decode(records)


@pytest.mark.timeout(120)
def test_a_node_leaving_from_the_middle_costs_the_same_at_100_and_1000_nodes():
    small, large = job_snapshot(100), job_snapshot(1000)
    cost_small = plan_bytes(small, without(small, "node-50"))
    cost_large = plan_bytes(large, without(large, "node-500"))
    whole_large = sum(len(v) for v in layout.encode(large).values())
    assert cost_large <= 1.5 * cost_small, (cost_small, cost_large)
    assert cost_large < whole_large / 20, (cost_large, whole_large)


@pytest.mark.timeout(60)
def test_an_unchanged_snapshot_writes_nothing_and_a_save_fits_etcds_limits():
    snapshot = job_snapshot(1000)
    records = layout.encode(snapshot)
    assert layout.plan(records, records) == []
    batches = layout.plan({}, records)
    assert len(batches) > 1 and all(len(b) <= layout.MAX_TXN_OPS for b in batches)
    assert all(sum(len(k) + len(v or b"") for k, v in b) < 1024 * 1024 + 64 * 128 for b in batches)
    # The root, which names the chunks, comes last: a reader never finds it before what it refers to.
    assert batches[-1][-1][0] == layout.ROOT


@pytest.mark.timeout(60)
def test_dropped_records_are_deleted_with_or_after_the_root():
    old = job_snapshot(200)
    batches = layout.plan(layout.encode(old), layout.encode(without(old, "node-7")))
    ops = [op for batch in batches for op in batch]
    root_at = next(i for i, (k, _) in enumerate(ops) if k == layout.ROOT)
    deleted = [i for i, (_, v) in enumerate(ops) if v is None]
    assert deleted and min(deleted) > root_at
    assert (layout.NODE + "node-7", None) in ops
