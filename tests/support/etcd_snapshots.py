"""Real job snapshots (plain JSON, as a store gets them) for the etcd layout and state tests."""

from __future__ import annotations

import json

from job_builders import make_job, running


def job_snapshot(n: int) -> dict:
    """A real job's snapshot with ``n`` nodes training in round 1 (plain JSON, as the store gets it)."""
    job = make_job(min_nodes=1, max_nodes=n)
    running(job, 0.0, *[f"node-{i}" for i in range(n)])
    return json.loads(json.dumps(job.snapshot()))


def without(snapshot: dict, node_id: str) -> dict:
    """The snapshot after ``node_id`` left: its record and slot gone, later slots renumbered."""
    out = json.loads(json.dumps(snapshot))
    out["nodes"] = [n for n in out["nodes"] if n["node_id"] != node_id]
    slots, offset = [], 0
    for slot in out["rendezvous"]["current"]["slots"]:
        if slot["node_id"] != node_id:
            slots.append({**slot, "node_rank": len(slots), "rank_offset": offset})
            offset += slot["nproc"]
    out["rendezvous"]["current"]["slots"] = slots
    return out
