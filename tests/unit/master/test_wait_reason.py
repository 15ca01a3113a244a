"""The round's decision with its reason (``Rendezvous.decide``, ``master.job.views``), on a fake clock.

Each test shifts time and asserts both what the rendezvous does and the sentence that says why; deadlines
are rendered by a fake ``clock_text`` (``t=15``) so the sentences are exact.
"""

from __future__ import annotations

import logging
import time

import pytest
from job_calls import heartbeat
from job_calls import join as join_job

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
from master.job.job import Job
from master.job.rendezvous import Action, Candidate, Phase, Rendezvous, wall_clock_text
from master.job.views import ReasonLog, recent_events, waiting_reason

pytestmark = pytest.mark.timeout(10)

HOURS = 3600.0 * 5


def fake_time(t: float) -> str:
    return f"t={t:g}"


def make(**job) -> Rendezvous:
    job.setdefault("last_call_s", 5.0)
    job.setdefault("join_timeout_s", 1e6)
    return Rendezvous(JobSettings(job_id="job", **job), clock_text=fake_time)


def join(rdzv: Rendezvous, *node_ids: str, now: float) -> None:
    for i, node_id in enumerate(node_ids):
        rdzv.join(Candidate(node_id, f"10.0.0.{i + 1}", 1, 29500 + i, now), now)


def test_a_round_below_min_nodes_waits_for_the_missing_nodes_until_the_join_deadline():
    rdzv = make(min_nodes=2, max_nodes=3, join_timeout_s=600.0)
    join(rdzv, "a", now=0.0)
    decision = rdzv.decide(0.0)
    assert decision.action is Action.WAIT
    assert decision.reason == "waiting for 1 more node (1 joined, 2 needed) until t=600"
    assert decision.until == 600.0
    assert rdzv.decide(599.0) == decision, "nothing changed: the same decision, the same sentence"


def test_the_sentence_stays_the_same_while_time_passes_and_changes_with_the_decision():
    rdzv = make(min_nodes=3, max_nodes=4)
    join(rdzv, "a", now=0.0)
    assert rdzv.decide(HOURS).reason == "waiting for 2 more nodes (1 joined, 3 needed) until t=1e+06"
    join(rdzv, "b", "c", now=HOURS)
    decision = rdzv.decide(HOURS + 1.0)
    assert decision.action is Action.WAIT
    assert decision.reason == f"last call: 3 of at most 4 nodes joined, more may join until t={HOURS + 5:g}"
    closing = rdzv.decide(HOURS + 5.0)
    assert closing.action is Action.CLOSE and closing.admitted == 3
    assert closing.reason == "closing with 3 nodes: the last call ended"
    assert rdzv.try_close(HOURS + 5.0) is not None
    after = rdzv.decide(HOURS * 2)
    assert after.action is Action.TRAIN
    assert after.reason == "closed: 3 nodes, world size 3 (the last call ended)"


def test_node_unit_is_named_when_it_is_what_the_round_waits_for():
    rdzv = make(min_nodes=4, max_nodes=8, node_unit=2)
    join(rdzv, "a", "b", "c", now=0.0)
    assert (
        rdzv.decide(1.0).reason == "waiting for 1 more node (3 joined, 4 needed in units of 2) until t=1e+06"
    )


def test_a_full_round_closes_at_once_and_says_so():
    rdzv = make(min_nodes=1, max_nodes=2)
    join(rdzv, "a", "b", now=0.0)
    decision = rdzv.decide(0.0)
    assert (decision.action, decision.reason) == (
        Action.CLOSE,
        "closing with 2 nodes: the maximum of 2 nodes joined",
    )


def test_a_restart_waits_for_members_until_the_rejoin_timeout_then_leaves_them_out():
    rdzv = make(min_nodes=1, max_nodes=3, rejoin_timeout_s=30.0)
    join(rdzv, "a", "b", now=0.0)
    rdzv.try_close(5.0)
    rdzv.open_round(100.0, {"a", "b"})
    join(rdzv, "a", now=101.0)
    waiting = rdzv.decide(101.0)
    assert waiting.action is Action.WAIT
    assert waiting.reason == "waiting for member b to rejoin until t=130"
    assert rdzv.try_close(129.9) is None
    left_out = rdzv.decide(130.0)
    assert left_out.action is Action.CLOSE
    assert left_out.reason == "closing with 1 node: the last call ended; left out b (not back in time)"


def test_a_restart_closes_as_soon_as_every_member_is_back():
    rdzv = make(min_nodes=1, max_nodes=3)
    join(rdzv, "a", "b", now=0.0)
    rdzv.try_close(5.0)
    rdzv.open_round(10.0, {"a", "b"})
    join(rdzv, "b", "a", now=11.0)
    decision = rdzv.decide(11.0)
    assert (decision.action, decision.reason) == (
        Action.CLOSE,
        "closing with 2 nodes: every member came back",
    )
    rdzv.try_close(11.0)
    assert rdzv.decide(11.0).reason == "closed: 2 nodes, world size 2 (every member came back)"


def test_a_restart_below_min_nodes_names_the_members_it_expects_back():
    rdzv = make(min_nodes=2, max_nodes=3, join_timeout_s=600.0)
    join(rdzv, "a", "b", now=0.0)
    rdzv.try_close(5.0)
    rdzv.open_round(10.0, {"a", "b"})
    join(rdzv, "c", now=10.0)
    assert rdzv.decide(10.0).reason == (
        "waiting for 1 more node (1 joined, 2 needed; expected back: a, b) until t=610"
    )


def test_many_pending_members_are_named_briefly():
    rdzv = make(min_nodes=1, max_nodes=8)
    join(rdzv, *"abcdef", now=0.0)
    rdzv.try_close(5.0)
    rdzv.open_round(10.0, set("abcdef"))
    join(rdzv, "f", now=10.0)
    assert rdzv.decide(10.0).reason == "waiting for members a, b, c and 2 more to rejoin until t=40"


def test_growth_is_a_last_call_for_the_waiting_node_then_a_grow_decision():
    rdzv = make(min_nodes=1, max_nodes=4)
    join(rdzv, "a", "b", now=0.0)
    rdzv.try_close(5.0)
    join(rdzv, "c", now=20.0)
    decision = rdzv.decide(20.0)
    assert decision.action is Action.TRAIN
    assert decision.reason == (
        "closed: 2 nodes, world size 2 (the last call ended); last call for node c until t=25 (then 3 nodes)"
    )
    assert not rdzv.growth_due(24.9)
    grow = rdzv.decide(25.0)
    assert (grow.action, grow.reason, grow.admitted) == (
        Action.GROW,
        "admitting node c: the last call ended",
        3,
    )
    assert rdzv.growth_due(25.0)


def test_a_node_that_cannot_enlarge_the_world_is_told_why():
    rdzv = make(min_nodes=1, max_nodes=2)
    join(rdzv, "a", "b", now=0.0)
    rdzv.try_close(0.0)
    join(rdzv, "c", now=1.0)
    decision = rdzv.decide(1.0 + HOURS)
    assert decision.action is Action.TRAIN
    assert decision.reason == (
        "closed: 2 nodes, world size 2 (the maximum of 2 nodes joined); spare node c (the maximum of 2 "
        "nodes is reached; a spare takes a lost member's node rank at the next round)"
    )
    assert rdzv.spares == ["c"]


def test_the_default_clock_text_is_the_local_time_of_a_reading_of_the_masters_unix_clock():
    from master.service.service import unix_monotonic

    clock = unix_monotonic()
    in_a_minute = clock() + 60.0
    expected = {time.strftime("%H:%M:%S", time.localtime(time.time() + 60.0 + d)) for d in (-1.0, 0.0, 1.0)}
    assert wall_clock_text(in_a_minute) in expected


# -- the job's sentence ---------------------------------------------------------------------------------
def job_with(**settings) -> Job:
    job = Job(JobSettings(job_id="j", last_call_s=5.0, **settings), now=0.0)
    job.rdzv.clock_text = fake_time
    return job


def join_req(node_id: str, job: Job) -> JoinRequest:
    s = job.settings
    return JoinRequest(
        node_id=node_id,
        host="127.0.0.1",
        nproc=1,
        store_port=29500,
        min_nodes=s.min_nodes,
        max_nodes=s.max_nodes,
    )


def test_job_status_carries_the_reason_and_the_recent_events():
    job = job_with(min_nodes=2, max_nodes=2)
    join_job(job, join_req("a", job), 1.0)
    status = job.status(3.0)
    assert status.waiting_reason == "waiting for 1 more node (1 joined, 2 needed) until t=601"
    assert [(e.seq, e.kind, e.age_s) for e in status.events][-1] == (job.event_count, "node_joined", 2.0)
    join_job(job, join_req("b", job), 4.0)
    status = job.status(4.0)
    assert status.waiting_reason.startswith("closed: 2 nodes, world size 2")
    assert [e.kind for e in status.events][-3:] == ["node_joined", "node_joined", "round_closed"]


def test_recent_events_are_the_newest_numbered_from_the_first():
    job = job_with(min_nodes=1, max_nodes=9)
    for i in range(30):
        join_job(job, join_req(f"n{i}", job), float(i))
    events = recent_events(job, 100.0, limit=5)
    assert [e.seq for e in events] == [job.event_count - 4 + i for i in range(5)]
    assert events[-1].message == list(job.events)[-1].message


def test_a_finished_job_says_how_it_ended():
    job = job_with(min_nodes=1, max_nodes=1)
    join_job(job, join_req("a", job), 0.0)
    heartbeat(job, HeartbeatRequest(node_id="a", round=1, state=NodeState.SUCCEEDED), 1.0)
    assert job.rdzv.phase is Phase.ACTIVE
    assert waiting_reason(job, 2.0) == "finished: the job succeeded (all workers succeeded)"


def test_the_master_logs_the_reason_only_when_it_changes(caplog: pytest.LogCaptureFixture):
    job = job_with(min_nodes=2, max_nodes=2)
    reasons = ReasonLog(logging.getLogger("test.reasons"))
    with caplog.at_level(logging.INFO, logger="test.reasons"):
        join_job(job, join_req("a", job), 0.0)
        for t in (0.0, 1.0, HOURS):
            reasons.note(job, t)
        join_job(job, join_req("b", job), HOURS + 1)
        reasons.note(job, HOURS + 2)
        reasons.note(job, HOURS + 3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "round 1: waiting for 1 more node (1 joined, 2 needed) until t=600"
    assert lines[1].startswith("round 1: closed: 2 nodes")
    assert len(lines) == 2
