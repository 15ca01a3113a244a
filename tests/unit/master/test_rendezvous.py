"""Unit tests of the rendezvous state machine (``master.job.rendezvous.Rendezvous``) with a fake clock.

Time is a plain float passed in as ``now``; nothing here sleeps or does I/O.
"""

from __future__ import annotations

import pytest

from elastic.control.job_settings import JobSettings
from master.job.rendezvous import Candidate, ClosedRound, Phase, Rendezvous

pytestmark = pytest.mark.timeout(10)

LAST_CALL = 5.0
JOIN_TIMEOUT = 100.0


def make(
    min_nodes: int = 1,
    max_nodes: int = 1,
    node_unit: int = 1,
    last_call_s: float = LAST_CALL,
    join_timeout_s: float = JOIN_TIMEOUT,
) -> Rendezvous:
    return Rendezvous(
        JobSettings(
            job_id="job",
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            node_unit=node_unit,
            last_call_s=last_call_s,
            join_timeout_s=join_timeout_s,
        )
    )


def cand(node_id: str, now: float, nproc: int = 1) -> Candidate:
    # Every node gets a distinct host and store port so the round's master address shows who is rank 0.
    index = ord(node_id[0]) - ord("a")
    return Candidate(node_id, f"10.0.0.{index + 1}", nproc, 29500 + index, now)


def join(rdzv: Rendezvous, *node_ids: str, now: float, nproc: int = 1) -> None:
    for node_id in node_ids:
        rdzv.join(cand(node_id, now, nproc), now)


def close_now(rdzv: Rendezvous, now: float) -> ClosedRound:
    closed = rdzv.try_close(now)
    assert closed is not None, f"round {rdzv.round} did not close at t={now} (waiting: {rdzv.waiting})"
    return closed


def ranks(closed: ClosedRound) -> dict[str, int]:
    return {slot.node_id: slot.node_rank for slot in closed.slots}


# -- first round ----------------------------------------------------------------------------------------
def test_first_round_closes_only_after_min_nodes_and_last_call():
    rdzv = make(min_nodes=2, max_nodes=4)
    join(rdzv, "a", now=0.0)
    assert rdzv.phase is Phase.OPEN
    assert rdzv.try_close(0.0) is None
    assert rdzv.try_close(1000.0) is None, "one node is below min_nodes: no last call can close the round"

    join(rdzv, "b", now=10.0)  # min reached at t=10: the last call runs until t=15
    assert rdzv.try_close(10.0) is None
    assert rdzv.try_close(10.0 + LAST_CALL - 0.01) is None

    closed = close_now(rdzv, 10.0 + LAST_CALL)
    assert closed.number == 1
    assert closed.members == ["a", "b"]
    assert closed.world_size == 2
    assert closed.closed_at == 10.0 + LAST_CALL
    assert rdzv.phase is Phase.ACTIVE
    assert rdzv.waiting == []
    assert rdzv.is_member("a") and rdzv.is_member("b")
    assert not rdzv.has_joined("a"), "admitted nodes leave the join list"
    assert rdzv.try_close(10.0 + LAST_CALL) is None, "an ACTIVE round cannot close again"


def test_last_call_counts_from_when_min_is_reached_not_from_first_join():
    rdzv = make(min_nodes=2, max_nodes=3)
    join(rdzv, "a", now=0.0)
    join(rdzv, "b", now=4.0)
    assert rdzv.try_close(LAST_CALL + 0.5) is None  # 5.5 < 4 + 5
    assert close_now(rdzv, 4.0 + LAST_CALL).members == ["a", "b"]


def test_first_round_closes_at_once_at_max_nodes():
    rdzv = make(min_nodes=1, max_nodes=3)
    join(rdzv, "a", "b", now=0.0)
    assert rdzv.try_close(1.0) is None, "below max and the last call is not over"
    join(rdzv, "c", now=1.0)
    closed = close_now(rdzv, 1.0)
    assert closed.members == ["a", "b", "c"]
    assert closed.closed_at == 1.0


def test_single_node_job_closes_at_once():
    rdzv = make(min_nodes=1, max_nodes=1)
    join(rdzv, "a", now=0.0)
    assert close_now(rdzv, 0.0).members == ["a"]


def test_joining_twice_refreshes_and_does_not_duplicate():
    rdzv = make(min_nodes=2, max_nodes=2)
    join(rdzv, "a", now=0.0)
    rdzv.join(Candidate("a", "10.9.9.9", 4, 31000, 1.0), 1.0)
    assert rdzv.waiting == ["a"]
    assert rdzv.try_close(1.0) is None, "the same node twice is still one node"
    join(rdzv, "b", now=2.0)
    closed = close_now(rdzv, 2.0)
    assert closed.slot("a").nproc == 4
    assert (closed.master_addr, closed.master_port) == ("10.9.9.9", 31000), "the newest join of a counts"


def test_a_waiting_node_that_is_removed_resets_the_last_call():
    rdzv = make(min_nodes=2, max_nodes=3)
    join(rdzv, "a", "b", now=0.0)
    rdzv.remove("b", now=1.0)
    assert rdzv.waiting == ["a"]
    assert rdzv.try_close(LAST_CALL) is None
    join(rdzv, "c", now=10.0)  # min reached again at t=10
    assert rdzv.try_close(10.0 + LAST_CALL - 0.01) is None
    assert close_now(rdzv, 10.0 + LAST_CALL).members == ["a", "c"]


# -- node unit ------------------------------------------------------------------------------------------
def test_node_unit_rounds_down_and_the_rest_waits_then_a_fourth_node_grows_the_world():
    rdzv = make(min_nodes=2, max_nodes=4, node_unit=2)
    join(rdzv, "a", "b", "c", now=0.0)
    closed = close_now(rdzv, LAST_CALL)
    assert closed.members == ["a", "b"], "3 joined with node unit 2: 2 admitted"
    assert rdzv.waiting == ["c"], "the third waits for the next round"
    assert not rdzv.is_member("c")
    assert not rdzv.growth_due(1000.0), "a single waiting node cannot form another unit of 2"

    join(rdzv, "d", now=100.0)
    assert rdzv.growth_due(100.0), "a+b+c+d reaches max_nodes: growth is due at once"

    assert rdzv.open_round(100.0, expected={"a", "b"}) == 2
    assert rdzv.phase is Phase.OPEN
    assert rdzv.try_close(100.0) is None, "a and b have not rejoined yet"
    join(rdzv, "b", "a", now=101.0)
    closed = close_now(rdzv, 101.0)
    assert closed.number == 2
    assert closed.members == ["a", "b", "c", "d"]
    assert closed.world_size == 4
    assert rdzv.waiting == []


def test_node_unit_below_a_full_unit_never_closes():
    rdzv = make(min_nodes=1, max_nodes=4, node_unit=2)
    join(rdzv, "a", now=0.0)
    assert rdzv.try_close(1000.0) is None, "one node is no unit of 2"
    join(rdzv, "b", now=1000.0)
    assert rdzv.try_close(1000.0) is None, "two nodes: the last call starts now"
    assert close_now(rdzv, 1000.0 + LAST_CALL).members == ["a", "b"]


# -- ranks ----------------------------------------------------------------------------------------------
def test_rank_offsets_world_size_and_store_address_follow_rank_order():
    rdzv = make(min_nodes=3, max_nodes=3)
    rdzv.join(cand("b", 0.0, nproc=2), 0.0)
    rdzv.join(cand("a", 0.0, nproc=3), 0.0)
    rdzv.join(cand("c", 0.0, nproc=1), 0.0)
    closed = close_now(rdzv, 0.0)
    assert closed.members == ["b", "a", "c"], "first round: join order"
    assert [(s.node_rank, s.rank_offset, s.nproc) for s in closed.slots] == [(0, 0, 2), (1, 2, 3), (2, 5, 1)]
    assert closed.world_size == 6
    assert (closed.master_addr, closed.master_port) == (cand("b", 0).host, cand("b", 0).store_port)
    assert closed.slot("a").rank_offset == 2
    assert closed.slot("zz") is None


def test_ranks_are_stable_across_rounds_and_new_nodes_are_appended():
    rdzv = make(min_nodes=1, max_nodes=4)
    join(rdzv, "c", "a", "b", now=0.0)
    first = close_now(rdzv, LAST_CALL)
    assert first.members == ["c", "a", "b"]

    join(rdzv, "d", now=10.0)  # a new node waits for growth
    rdzv.open_round(10.0, expected={"a", "b", "c"})
    join(rdzv, "b", "a", "c", now=11.0)  # previous members rejoin in another order
    second = close_now(rdzv, 11.0)
    assert second.members == ["c", "a", "b", "d"], "previous members keep their order; d is appended"
    assert ranks(second) == {"c": 0, "a": 1, "b": 2, "d": 3}

    # c (rank 0) dies: the others close ranks up in the same relative order, b becomes the store host.
    rdzv.open_round(20.0, expected={"a", "b", "d"})
    join(rdzv, "d", "b", "a", now=21.0)
    third = close_now(rdzv, 21.0)
    assert third.members == ["a", "b", "d"]
    assert third.number == 3
    assert (third.master_addr, third.master_port) == (cand("a", 0).host, cand("a", 0).store_port)


# -- restart rounds -------------------------------------------------------------------------------------
def test_restart_round_closes_at_once_when_all_expected_members_are_back():
    rdzv = make(min_nodes=1, max_nodes=3, last_call_s=100.0)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, 100.0)

    assert rdzv.open_round(200.0, expected={"a", "b"}) == 2
    join(rdzv, "a", now=200.5)
    assert rdzv.try_close(200.5) is None, "b is expected back"
    join(rdzv, "b", now=201.0)
    closed = close_now(rdzv, 201.0)  # no last-call wait (it would end at t=300.5)
    assert closed.number == 2
    assert closed.members == ["a", "b"]


def test_open_round_while_open_keeps_the_round_number():
    rdzv = make(min_nodes=2, max_nodes=2)
    join(rdzv, "a", now=0.0)
    assert rdzv.open_round(1.0, expected=set()) == 1


def test_member_that_dies_while_the_round_is_open_is_dropped_from_the_expected_set():
    rdzv = make(min_nodes=2, max_nodes=3, last_call_s=100.0)
    join(rdzv, "a", "b", "c", now=0.0)
    close_now(rdzv, 0.0)

    rdzv.open_round(10.0, expected={"a", "b", "c"})
    join(rdzv, "a", "b", now=11.0)
    assert rdzv.try_close(11.0) is None, "c is still expected"
    rdzv.remove("c", now=12.0)
    closed = close_now(rdzv, 12.0)
    assert closed.members == ["a", "b"]
    assert closed.number == 2


def test_expected_members_below_min_nodes_do_not_close_the_round():
    rdzv = make(min_nodes=3, max_nodes=3)
    join(rdzv, "a", "b", "c", now=0.0)
    close_now(rdzv, 0.0)
    rdzv.open_round(10.0, expected={"a", "b", "c"})
    rdzv.remove("c", now=10.0)
    join(rdzv, "a", "b", now=11.0)
    assert rdzv.try_close(1000.0) is None, "everyone expected is back, but 2 < min_nodes"


def test_last_call_does_not_close_a_round_without_expected_members_that_are_still_alive():
    # a and b train; c waits for growth. The growth round opens; c alone reaches min_nodes=1 at once.
    # a and b must stop their workers (SIGTERM grace, 5 s by default) before they can rejoin. The round
    # must wait for them (a dead one is removed, which bounds the wait), not close with c alone after
    # the last call and force yet another round when a and b arrive.
    rdzv = make(min_nodes=1, max_nodes=3, last_call_s=2.0)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, 2.0)
    join(rdzv, "c", now=10.0)
    assert rdzv.growth_due(12.0)
    rdzv.open_round(12.0, expected={"a", "b"})
    assert rdzv.try_close(14.5) is None, "a and b are alive and expected back"


# -- growth ---------------------------------------------------------------------------------------------
def test_growth_waits_the_last_call():
    rdzv = make(min_nodes=1, max_nodes=4)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, LAST_CALL)
    assert not rdzv.growth_due(LAST_CALL), "no one is waiting"

    join(rdzv, "c", now=10.0)
    assert rdzv.waiting == ["c"]
    assert not rdzv.growth_due(10.0)
    assert not rdzv.growth_due(10.0 + LAST_CALL - 0.01)
    assert rdzv.growth_due(10.0 + LAST_CALL)


def test_growth_is_due_at_once_when_it_reaches_max_nodes():
    rdzv = make(min_nodes=1, max_nodes=4)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, LAST_CALL)
    join(rdzv, "c", now=10.0)
    assert not rdzv.growth_due(11.0)
    join(rdzv, "d", now=11.0)
    assert rdzv.growth_due(11.0), "a+b+c+d = max_nodes"


def test_growth_is_never_due_at_max_nodes_or_while_open():
    rdzv = make(min_nodes=1, max_nodes=2)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, 0.0)
    join(rdzv, "c", now=1.0)
    assert not rdzv.growth_due(1000.0), "the world is already at max_nodes"

    rdzv = make(min_nodes=2, max_nodes=3)
    join(rdzv, "a", "b", "c", now=0.0)
    assert not rdzv.growth_due(1000.0), "nothing is running yet"


def test_growth_timer_stops_when_the_waiting_node_goes_away():
    rdzv = make(min_nodes=1, max_nodes=4)
    join(rdzv, "a", now=0.0)
    close_now(rdzv, LAST_CALL)
    join(rdzv, "b", now=10.0)
    rdzv.remove("b", now=11.0)
    assert not rdzv.growth_due(100.0)
    join(rdzv, "c", now=100.0)
    assert not rdzv.growth_due(100.0 + LAST_CALL - 0.01), "the window restarts with c"
    assert rdzv.growth_due(100.0 + LAST_CALL)


def test_remove_of_a_member_keeps_its_slot_until_the_next_round():
    rdzv = make(min_nodes=1, max_nodes=2)
    join(rdzv, "a", "b", now=0.0)
    close_now(rdzv, 0.0)
    rdzv.remove("b", now=1.0)
    assert rdzv.is_member("b"), "the running round is unchanged until a new one opens"
    rdzv.open_round(1.0, expected={"a"})
    assert not rdzv.is_member("a"), "no one is a member while the round is open"
    join(rdzv, "a", now=2.0)
    assert close_now(rdzv, 2.0).members == ["a"]


# -- join deadline --------------------------------------------------------------------------------------
def test_join_deadline_counts_from_first_join_and_from_each_new_round():
    rdzv = make(min_nodes=2, max_nodes=2)
    assert rdzv.join_deadline() is None, "no one joined yet"
    join(rdzv, "a", now=3.0)
    assert rdzv.join_deadline() == 3.0 + JOIN_TIMEOUT
    join(rdzv, "b", now=50.0)
    assert rdzv.join_deadline() == 3.0 + JOIN_TIMEOUT, "later joins do not extend the deadline"
    close_now(rdzv, 50.0)
    assert rdzv.join_deadline() is None, "no deadline while ACTIVE"
    rdzv.open_round(500.0, expected={"a", "b"})
    assert rdzv.join_deadline() == 500.0 + JOIN_TIMEOUT
