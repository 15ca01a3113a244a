"""Hot spares in the rendezvous state machine (``master.job.rendezvous.Rendezvous``), with a fake clock: a
node beyond the maximum is a spare; when a member is lost, the next round closes as soon as the survivors
are back, with the spare in the lost member's node rank, the survivors keeping theirs.
"""

from __future__ import annotations

import pytest

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
from master.job.job import Job
from master.job.rendezvous import Action, Candidate, ClosedRound, Rendezvous
from master.job.views import replica_targets

pytestmark = pytest.mark.timeout(10)

LAST_CALL = 30.0  # long: a round that closes before it ended did not wait for a last call


def make(min_nodes: int, max_nodes: int, node_unit: int = 1) -> Rendezvous:
    settings = JobSettings(
        job_id="job", min_nodes=min_nodes, max_nodes=max_nodes, node_unit=node_unit, last_call_s=LAST_CALL
    )
    return Rendezvous(settings, clock_text=lambda t: f"t={t:g}")


def join(rdzv: Rendezvous, *node_ids: str, now: float, nproc: int = 1) -> None:
    for node_id in node_ids:
        index = ord(node_id[0]) - ord("a")
        rdzv.join(Candidate(node_id, f"10.0.0.{index + 1}", nproc, 29500 + index, now), now)


def ranks(closed: ClosedRound) -> dict[str, int]:
    return {slot.node_id: slot.node_rank for slot in closed.slots}


def running(rdzv: Rendezvous, *members: str, spares: tuple[str, ...] = ()) -> ClosedRound:
    """A round of ``members`` (in rank order) running, with ``spares`` joined after it closed."""
    join(rdzv, *members, now=0.0)
    closed = rdzv.try_close(LAST_CALL)
    assert closed is not None and closed.members == list(members)
    join(rdzv, *spares, now=LAST_CALL + 1)
    return closed


def lose(rdzv: Rendezvous, lost: str, now: float) -> None:
    """What the job does when a member is lost: forget it, open a round expecting the others back."""
    assert rdzv.current is not None
    rdzv.remove(lost, now)
    rdzv.open_round(now, expected={m for m in rdzv.current.members if m != lost})


def test_a_node_beyond_the_maximum_is_a_spare_and_no_growth_is_due():
    rdzv = make(2, 2)
    running(rdzv, "a", "b", spares=("c",))
    assert rdzv.spares == ["c"]
    assert not rdzv.growth_due(1e6), "a full round never grows for a spare"
    assert "spare node c (the maximum of 2 nodes is reached" in rdzv.decide(100.0).reason


def test_a_node_waiting_for_growth_is_no_spare():
    rdzv = make(1, 4)
    running(rdzv, "a", "b", spares=("c",))
    assert rdzv.spares == [], "c enlarges the world at the end of the last call"
    assert rdzv.decide(LAST_CALL + 1).action is Action.TRAIN
    assert rdzv.decide(2 * LAST_CALL + 1).action is Action.GROW


@pytest.mark.parametrize("lost", ["a", "b", "c"])
def test_the_spare_takes_the_lost_members_node_rank_and_survivors_keep_theirs(lost):
    rdzv = make(3, 3)
    before = ranks(running(rdzv, "a", "b", "c", spares=("d",)))
    lose(rdzv, lost, 100.0)
    survivors = [m for m in "abc" if m != lost]
    join(rdzv, *survivors, now=100.5)
    closed = rdzv.try_close(100.5)
    assert closed is not None, "closes at once when the survivors are back: no last call"
    assert closed.world_size == 3
    after = ranks(closed)
    assert after["d"] == before[lost]
    assert all(after[m] == before[m] for m in survivors)
    assert rdzv.spares == []
    # Rank 0's node hosts the store: a spare in rank 0 does.
    assert (closed.master_addr == "10.0.0.4") is (lost == "a")
    assert f"spare d takes node rank {before[lost]} of {lost}" in rdzv.decide(101.0).reason


def test_the_round_closes_when_the_survivors_are_back_not_when_the_spare_is():
    rdzv = make(2, 2)
    running(rdzv, "a", "b", spares=("c",))
    lose(rdzv, "a", 100.0)
    decision = rdzv.decide(100.0)
    assert decision.action is Action.WAIT and "expected back: b" in decision.reason
    join(rdzv, "b", now=100.2)
    assert rdzv.decide(100.2).action is Action.CLOSE
    closed = rdzv.try_close(100.2)
    assert closed is not None and ranks(closed) == {"c": 0, "b": 1}


def test_rank_offsets_follow_the_spares_place():
    rdzv = make(3, 3)
    join(rdzv, "a", "b", "c", now=0.0, nproc=2)
    rdzv.try_close(LAST_CALL)
    join(rdzv, "d", now=31.0, nproc=2)
    lose(rdzv, "b", 100.0)
    join(rdzv, "a", "c", now=100.1, nproc=2)
    closed = rdzv.try_close(100.1)
    assert closed is not None
    assert [(s.node_id, s.node_rank, s.rank_offset) for s in closed.slots] == [
        ("a", 0, 0),
        ("d", 1, 2),
        ("c", 2, 4),
    ]


def test_two_lost_members_and_one_spare_fill_the_lower_rank_and_close_up_the_rest():
    rdzv = make(1, 4)
    running(rdzv, "a", "b", "c", "d")
    join(rdzv, "e", now=40.0)  # max 4 is reached: e is a spare
    assert rdzv.spares == ["e"]
    rdzv.remove("a", 100.0)
    rdzv.remove("c", 100.0)
    rdzv.open_round(100.0, expected={"b", "d"})
    join(rdzv, "d", "b", now=100.1)
    closed = rdzv.try_close(100.1)
    assert closed is not None
    assert closed.members == ["e", "b", "d"], "e takes rank 0; the place of c is closed up"


def test_with_more_spares_than_places_the_first_joined_spare_is_taken_and_the_other_stays_a_spare():
    rdzv = make(2, 2)
    running(rdzv, "a", "b", spares=("d", "c"))
    assert rdzv.spares == ["d", "c"]
    lose(rdzv, "b", 100.0)
    join(rdzv, "a", now=100.1)
    closed = rdzv.try_close(100.1)
    assert closed is not None and closed.members == ["a", "d"]
    assert rdzv.spares == ["c"]


def test_node_unit_is_respected_and_survivors_come_before_spares():
    rdzv = make(2, 4, node_unit=2)
    running(rdzv, "a", "b", "c", "d", spares=("e",))
    assert rdzv.spares == ["e"]
    for lost in ("b", "c"):
        rdzv.remove(lost, 100.0)
    rdzv.open_round(100.0, expected={"a", "d"})
    join(rdzv, "a", "d", now=100.1)
    closed = rdzv.try_close(100.1)
    assert closed is not None and closed.members == ["a", "d"], "3 nodes round down to 2: the survivors"
    assert rdzv.spares == ["e"]


def test_without_a_spare_a_loss_shrinks_the_world_as_before():
    rdzv = make(1, 2)
    running(rdzv, "a", "b")
    lose(rdzv, "a", 100.0)
    join(rdzv, "b", now=100.1)
    closed = rdzv.try_close(100.1)
    assert closed is not None and ranks(closed) == {"b": 0} and closed.world_size == 1


# -- the job: replication targets, status, metrics --------------------------------------------------------
def test_a_spare_is_a_replication_target_and_status_and_metrics_show_it():
    job = Job(JobSettings(job_id="j", min_nodes=2, max_nodes=2, last_call_s=0.0), now=0.0)
    secrets = {}
    for i, node in enumerate("abc"):
        join_req = JoinRequest(node_id=node, host="h", nproc=1, store_port=2000 + i, min_nodes=2, max_nodes=2)
        secrets[node] = job.join(join_req, 0.0).node_secret
        job.tick(0.0)
    assert job.rdzv.current is not None and job.rdzv.current.members == ["a", "b"]
    assert job.status(1.0).spares == ["c"]
    replies = {}
    for i, node in enumerate("abc"):
        spare = node == "c"  # a waiting agent reports round 0, state waiting
        beat = HeartbeatRequest(
            node_id=node,
            round=0 if spare else job.rdzv.round,
            state=NodeState.WAITING if spare else NodeState.RUNNING,
            replicas=1,
            replication_port=3000 + i,
        )
        replies[node] = job.heartbeat(beat, 1.0, secrets[node])
    # Spare 0 is fed by node rank 0 (after its ring successor); node rank 1 feeds no spare.
    assert [peer for peer, _ in replica_targets(job, "a", 1)] == ["b", "c"]
    assert [peer for peer, _ in replica_targets(job, "b", 1)] == ["a"]
    assert replies["c"].replication_key, "the spare gets its receiver key: it accepts the pushes"
    assert replies["c"].peers == [], "a spare pushes nothing"
    assert len(replies["a"].peers) == len(replies["a"].peer_keys) == 2

    from master.http.metrics import _job_metrics  # the families /metrics serves for the job

    spare_gauge = [m for m in _job_metrics(job, "j", 1.0) if m.name == "elastic_spare_nodes"]
    assert [s.value for s in spare_gauge[0].samples] == [1.0]
