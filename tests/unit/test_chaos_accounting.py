"""bench/chaos.py's accounting of the time the job had too few nodes: a node cut off from the others is
live but no member the job can use (the master counts that time as waiting for nodes too). And a node the
master excluded (its agent exits 4 by design) is the policy at work, not a failed job: the harness stopped a
30-minute run at t = 382 s on a node excluded for flapping (partitioned four times in 225 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import chaos
from bench import chaos_schedule as sch

pytestmark = pytest.mark.timeout(60)


class Fleet:
    """The part of bench/chaos.py's Cluster the accounting reads: the live nodes and their cut."""

    def __init__(self, count: int) -> None:
        self.nodes = [SimpleNamespace(name=f"node-{i}", cut="") for i in range(count)]

    def live(self) -> list[SimpleNamespace]:
        return list(self.nodes)


def test_a_cut_off_node_leaves_the_job_waiting_for_nodes_at_its_minimum() -> None:
    fleet = Fleet(sch.MIN_NODES)
    injector = chaos.Injector(fleet, chaos.Result("inprocess", 1, 60.0, 15.0, 1))  # type: ignore[arg-type]
    injector.note_nodes(10.0)
    fleet.nodes[0].cut = "table"  # a partition at the minimum: the survivors cannot form a round
    injector.note_nodes(12.0)
    fleet.nodes[0].cut = ""  # healed
    injector.note_nodes(21.0)
    assert injector.below_min == [(12.0, 21.0)]


def test_a_cut_off_node_above_the_minimum_leaves_enough_nodes() -> None:
    fleet = Fleet(sch.MIN_NODES + 1)
    injector = chaos.Injector(fleet, chaos.Result("inprocess", 1, 60.0, 15.0, 1))  # type: ignore[arg-type]
    fleet.nodes[0].cut = "table"
    injector.note_nodes(12.0)
    fleet.nodes[0].cut = ""
    injector.note_nodes(21.0)
    assert injector.below_min == []


def test_an_agent_the_master_excluded_is_not_a_failed_job_and_others_still_are(tmp_path: Path) -> None:
    flapping = "node node-4 excluded for flapping: lost 4 times within 300s (more than --flap-limit 3)"
    lines = [
        json.dumps({"kind": "node_dead", "node": "node-5", "message": "node node-5 declared dead"}),
        '{"kind": "node_flapping_exc',  # a line cut by a SIGKILL mid-write
        json.dumps({"kind": "node_flapping_excluded", "node": "node-4", "message": flapping}),
    ]
    (tmp_path / "events-1.jsonl").write_text("\n".join(lines) + "\n")
    exits = {"node-4": 4, "node-5": 4, "node-6": 1}
    procs = {
        n: subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]) for n, code in exits.items()
    }
    for proc in procs.values():
        proc.wait(timeout=30)
    cluster = object.__new__(chaos.Cluster)  # only what the exit checks read: the folder and the nodes
    cluster.folder = tmp_path
    cluster.nodes = {
        n: SimpleNamespace(name=n, ended="", proc=SimpleNamespace(popen=p)) for n, p in procs.items()
    }
    assert cluster.excluded_nodes() == [("node-4", flapping)]
    assert cluster.nodes["node-4"].ended.startswith("excluded")
    assert cluster.exited_nodes() == [("node-5", 4), ("node-6", 1)], "exit 4 without the master's word fails"
    assert cluster.excluded_nodes() == [] and cluster.exited_nodes() == [], "each is reported once"
