"""bench/chaos.py's accounting of the time the job had too few nodes: a node cut off from the others is
live but no member the job can use (the master counts that time as waiting for nodes too)."""

from __future__ import annotations

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
