"""Structured events, recovery phases, goodput, the event log and /metrics, with a fake clock where the
logic is pure, and a real master over a real socket for the exposition."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import job_calls as calls
import pytest
import yaml
from e2e import wait_until
from prometheus_client.parser import text_string_to_metric_families
from tools import require_tool

from elastic.control.client import MasterClient
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState, WorkerFailure, WorkerProgress
from master.http.serving import EmbeddedMaster
from master.job.accounting import (
    BADPUT_BUCKETS,
    GoodputAccount,
    Histogram,
    JobStats,
    RecoveryTracker,
    goodput_of,
    redone_seconds,
)
from master.job.events import Event
from master.job.job import Job
from master.job.views import job_goodput
from master.service.event_log import EventLog
from master.service.settings import ServerSettings

pytestmark = pytest.mark.timeout(30)

T0 = 1_700_000_000.0  # the job clock reads Unix time


def make_job(**overrides) -> Job:
    values: dict = dict(
        job_id="obs",
        min_nodes=2,
        max_nodes=2,
        node_unit=1,
        last_call_s=1.0,
        join_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=4.0,
        max_restarts=3,
    )
    values.update(overrides)
    return Job(JobSettings(**values), now=T0)


def join(job: Job, now: float, *nodes: str) -> None:
    for i, node in enumerate(nodes):
        req = JoinRequest(
            node_id=node,
            host=f"10.0.0.{i + 1}",
            nproc=1,
            store_port=29500 + i,
            min_nodes=job.settings.min_nodes,
            max_nodes=job.settings.max_nodes,
        )
        calls.join(job, req, now)


def beat(job: Job, node: str, now: float, **fields) -> None:
    fields.setdefault("state", NodeState.RUNNING)
    calls.heartbeat(job, HeartbeatRequest(node_id=node, round=job.rdzv.round, **fields), now)


def train(job: Job, nodes: tuple[str, ...], started: float, stepped: float, now: float) -> None:
    """Every member reports (at ``now``) that its workers started at ``started``, stepped at ``stepped``."""
    for node in nodes:
        beat(job, node, now, workers_started_age_s=now - started, first_step_age_s=now - stepped)


def of_kind(job: Job, kind: str) -> list[Event]:
    return [e for e in job.events if e.kind == kind]


# -- pure accounting ------------------------------------------------------------------------------
def test_goodput_counts_only_time_with_the_full_world_stepping() -> None:
    account = GoodputAccount(started_at=100.0)
    assert account.ratio(100.0) is None
    assert account.start(110.0) and not account.start(111.0)
    assert account.ratio(130.0) == pytest.approx(20 / 30)
    assert account.stop(125.0)  # the failure was seen at 125, reported later
    assert account.ratio(140.0) == pytest.approx(15 / 40)
    account.start(150.0)
    account.end(160.0)
    assert account.ratio(1000.0) == pytest.approx(25 / 60), "the wall time stops at the job's end"
    again = GoodputAccount.restore(account.snapshot(), now=2000.0)
    assert again.ratio(3000.0) == pytest.approx(25 / 60)


def test_recovery_phases_cover_the_time_from_the_break_to_the_first_step_once() -> None:
    tracker = RecoveryTracker()
    tracker.round_closed(1, ["a", "b"], 0.0)
    assert tracker.node_started("a", 1, 1.0) is None
    assert tracker.node_started("b", 1, 2.0) == 2.0
    tracker.node_stepped("a", 1, 3.0)
    assert tracker.node_stepped("b", 1, 4.0) == (4.0, None), "the first round is no recovery"
    tracker.verdict("worker_failure", began_at=10.0, at=10.5)
    tracker.round_closed(2, ["a", "b"], 12.0)
    tracker.node_started("a", 2, 12.5)
    tracker.node_started("b", 2, 13.0)
    tracker.node_stepped("a", 2, 15.0)
    at, recovery = tracker.node_stepped("b", 2, 16.0)
    assert at == 16.0 and recovery.cause == "worker_failure"
    assert recovery.seconds == pytest.approx(
        {"detect": 0.5, "rendezvous": 1.5, "restart": 1.0, "first_step": 3.0}
    )
    assert recovery.total == pytest.approx(16.0 - 10.0)


def test_a_verdict_during_a_recovery_continues_it() -> None:
    tracker = RecoveryTracker()
    tracker.verdict("node_loss", began_at=0.0, at=4.0)
    tracker.round_closed(2, ["a"], 5.0)
    tracker.verdict("worker_failure", began_at=5.5, at=6.0)  # the restart broke again
    tracker.reattribute("node_loss")
    tracker.round_closed(3, ["a"], 7.0)
    tracker.node_started("a", 3, 8.0)
    _, recovery = tracker.node_stepped("a", 3, 9.0)
    assert recovery.cause == "node_loss"
    assert recovery.seconds == pytest.approx(
        {"detect": 4.0, "rendezvous": 2.0, "restart": 2.0, "first_step": 1.0}
    )


def test_a_start_estimated_before_the_rounds_close_counts_from_the_close() -> None:
    tracker = RecoveryTracker()
    tracker.verdict("worker_failure", began_at=0.0, at=0.5)
    tracker.round_closed(2, ["a"], 1.0)
    assert tracker.node_started("a", 2, 0.9994) == 1.0  # the heartbeat's age was a little long
    tracker.node_started("a", 2, 0.998)  # a later, earlier estimate: still not before the close
    at, recovery = tracker.node_stepped("a", 2, 2.0)
    assert tracker.round.all_started_at == 1.0
    assert recovery.seconds == pytest.approx(
        {"detect": 0.5, "rendezvous": 0.5, "restart": 0.0, "first_step": 1.0}
    )


def test_a_later_heartbeats_earlier_estimate_of_the_start_moves_the_split_until_the_first_step() -> None:
    tracker = RecoveryTracker()
    tracker.verdict("worker_failure", began_at=0.0, at=0.5)
    tracker.round_closed(2, ["a", "b"], 1.0)
    tracker.node_started("a", 2, 1.5)
    assert tracker.node_started("b", 2, 2.4) == 2.4  # its heartbeat waited for a CPU: 2.4 is late
    assert tracker.node_started("b", 2, 2.6) is None  # a later, worse estimate changes nothing
    tracker.node_started("b", 2, 2.0)  # the heartbeat with its first step arrived promptly
    tracker.node_stepped("a", 2, 3.0)
    at, recovery = tracker.node_stepped("b", 2, 4.0)
    assert at == 4.0 and tracker.round.all_started_at == 2.0
    assert recovery.seconds == pytest.approx(
        {"detect": 0.5, "rendezvous": 0.5, "restart": 1.0, "first_step": 2.0}
    )
    tracker.node_started("b", 2, 1.2)  # after every member stepped: the recovery is over
    assert tracker.round.all_started_at == 2.0


# -- the job's events -----------------------------------------------------------------------------
def test_a_worker_failure_yields_phases_goodput_and_lifetime_totals_from_events() -> None:
    job = make_job()
    join(job, T0 + 1, "a", "b")
    job.tick(T0 + 2)  # closes round 1
    train(job, ("a", "b"), started=T0 + 3, stepped=T0 + 5, now=T0 + 6)
    assert [e.data for e in of_kind(job, "first_step")] == [{"training": "started", "training_at": T0 + 5}]
    failure = WorkerFailure(rank=1, local_rank=0, exit_code=1, age_s=0.5)
    beat(job, "b", T0 + 20, state=NodeState.FAILED, failure=failure)
    failed = of_kind(job, "worker_failed")[-1]
    assert (failed.node, failed.cause, failed.round) == ("b", "worker_failure", 1)
    assert failed.durations == {"detect": pytest.approx(0.5)}
    opened = of_kind(job, "round_opened")[-1]
    assert opened.cause == "worker_failure" and opened.data["training_at"] == pytest.approx(T0 + 19.5)
    join(job, T0 + 21, "a", "b")
    job.tick(T0 + 22)
    train(job, ("a", "b"), started=T0 + 23, stepped=T0 + 25, now=T0 + 26)
    done = of_kind(job, "first_step")[-1]
    assert done.cause == "worker_failure" and done.round == 2
    assert done.durations == pytest.approx(
        # the round closed at the second join, at T0 + 21
        {"detect": 0.5, "rendezvous": 1.0, "restart": 2.0, "first_step": 2.0, "total": 5.5}
    )
    assert job.goodput.ratio(T0 + 30) == pytest.approx((14.5 + 5.0) / 30)
    assert job.status(T0 + 30).goodput_ratio == pytest.approx((14.5 + 5.0) / 30)
    assert job.stats.restarts == 1 and job.stats.verdicts == {"worker_failure": 1}
    assert {k: h.count for k, h in job.stats.recovery.items()} == {
        (p, "worker_failure"): 1 for p in ("detect", "rendezvous", "restart", "first_step")
    }
    seqs = [e.seq for e in job.events]
    assert seqs == list(range(1, job.event_count + 1)), "one sequence number per event, no gaps"

    again = Job.restore(job.settings, json.loads(json.dumps(job.snapshot())), T0 + 40)
    assert again.stats.restarts == 1 and again.stats.leader_changes == 1
    assert again.goodput.ratio(T0 + 40) == pytest.approx(job.goodput.ratio(T0 + 40))
    assert [e.seq for e in again.events][-2:] == [job.event_count, job.event_count + 1]
    assert again.events[-1].kind == "master_takeover"


def test_badput_buckets_name_the_redone_steps_and_the_wait_for_nodes_and_sum_to_the_wall_time() -> None:
    job = make_job()
    join(job, T0 + 1, "a", "b")
    job.tick(T0 + 2)  # closes round 1
    progress = [WorkerProgress(local_rank=0, step=10, step_time_s=0.5)]
    for node in ("a", "b"):
        beat(
            job, node, T0 + 6, workers_started_age_s=3.0, first_step_age_s=1.0, workers=progress, ckpt_step=8
        )
    failure = WorkerFailure(rank=1, local_rank=0, exit_code=1, age_s=0.5)
    beat(job, "b", T0 + 20, state=NodeState.FAILED, failure=failure, workers=progress, ckpt_step=8)
    opened = of_kind(job, "round_opened")[-1]
    assert opened.data["steps_lost"] == 2, "trained to step 10, committed 8"
    assert opened.data["redone_s"] == pytest.approx(2 * 0.5), "at the members' step time"
    join(job, T0 + 21, "a")
    join(job, T0 + 23, "b")  # short of the minimum of 2 from the round's opening at T0 + 20 until now
    job.tick(T0 + 23)
    closed = of_kind(job, "round_closed")[-1].at
    train(job, ("a", "b"), started=closed + 1, stepped=closed + 2, now=closed + 3)
    assert of_kind(job, "first_step")[-1].cause == "worker_failure"
    now = closed + 10
    figures = job_goodput(job, now)
    wall = now - T0
    training = job.goodput.training_time(now)
    assert figures.wall_s == pytest.approx(wall)
    assert figures.productive_s == pytest.approx(training - 1.0)
    assert figures.ratio == pytest.approx((training - 1.0) / wall)
    buckets = figures.badput_s
    assert list(buckets) == list(BADPUT_BUCKETS)
    assert buckets["redone_steps"] == pytest.approx(1.0)
    assert buckets["waiting_for_nodes"] == pytest.approx(3.0), "from the round's opening to b's join"
    assert buckets["detection"] == pytest.approx(0.5)
    assert buckets["rendezvous"] == pytest.approx(closed - (T0 + 20) - 3.0)
    assert buckets["re_form"] == pytest.approx(1.0) and buckets["restore"] == pytest.approx(1.0)
    assert figures.productive_s + sum(buckets.values()) == pytest.approx(wall)
    status = job.status(now)
    assert status.goodput_ratio == pytest.approx(figures.ratio)
    assert status.badput_s["redone_steps"] == pytest.approx(1.0)
    again = Job.restore(job.settings, json.loads(json.dumps(job.snapshot())), now)
    restored = job_goodput(again, now)
    assert restored.badput_s["redone_steps"] == pytest.approx(1.0)
    assert restored.badput_s["waiting_for_nodes"] == pytest.approx(3.0)


def test_a_recovery_in_progress_counts_in_its_phase_so_far() -> None:
    job = make_job()
    join(job, T0, "a", "b")
    job.tick(T0 + 0.1)
    train(job, ("a", "b"), started=T0 + 0.5, stepped=T0 + 1.0, now=T0 + 1.0)
    beat(job, "a", T0 + 5.5)
    job.tick(T0 + 5.5)  # b's last heartbeat was at T0 + 1.0: dead, a round opens
    figures = job_goodput(job, T0 + 8.0)
    assert figures.badput_s["detection"] == pytest.approx(4.5)
    assert figures.badput_s["rendezvous"] + figures.badput_s["waiting_for_nodes"] == pytest.approx(2.5)
    assert figures.productive_s + sum(figures.badput_s.values()) == pytest.approx(8.0)


def test_a_scale_ups_detection_is_no_badput_the_world_trained_through_it() -> None:
    stats = JobStats()
    for cause, seconds in (("scale_up", 5.0), ("node_loss", 2.0)):
        hist = Histogram()
        hist.observe(seconds)
        stats.recovery[("detect", cause)] = hist
    account = GoodputAccount(started_at=0.0)
    account.start(0.0)
    account.stop(90.0)
    figures = goodput_of(account, stats, RecoveryTracker(), 0.0, 100.0)
    assert figures.badput_s["detection"] == 2.0, "the members trained while the joined node waited"
    assert figures.productive_s + sum(figures.badput_s.values()) == pytest.approx(100.0)


def test_redone_steps_count_from_the_newest_step_a_member_saved() -> None:
    """The next round resumes from the newest copy any rank holds; the committed step (the lowest one
    saved) trails it by a heartbeat and counted steps nobody redoes."""
    job = make_job()
    join(job, T0 + 1, "a", "b")
    job.tick(T0 + 2)
    for node, step in (("a", 10), ("b", 7)):  # b's last heartbeat came before a's steps 8-10
        progress = [WorkerProgress(local_rank=0, step=step, step_time_s=0.5)]
        beat(job, node, T0 + 6, workers=progress, ckpt_step=step)
    job.tick(T0 + 6.5)
    assert job.committed_step == 7
    beat(job, "b", T0 + 7, state=NodeState.FAILED, failure=WorkerFailure(rank=1, local_rank=0, exit_code=1))
    opened = of_kind(job, "round_opened")[-1]
    assert opened.data["steps_lost"] == 0, "a saved step 10, the newest: nothing is redone"


def test_redone_seconds_use_the_lower_median_of_the_known_step_times() -> None:
    assert redone_seconds(3, [None, 0.2, 0.4, 0.3, 0.9]) == pytest.approx(3 * 0.3)
    assert redone_seconds(3, [None]) == 0.0 and redone_seconds(0, [0.5]) == 0.0


def test_a_lost_node_is_detected_from_its_last_heartbeat() -> None:
    job = make_job(min_nodes=1)
    join(job, T0, "a", "b")
    job.tick(T0 + 0.1)
    train(job, ("a", "b"), started=T0 + 0.5, stepped=T0 + 1.0, now=T0 + 1.0)
    beat(job, "a", T0 + 5.5)
    job.tick(T0 + 5.5)  # b's last heartbeat was at T0 + 1.0: 4.5 s > the 4 s timeout
    dead = of_kind(job, "node_dead")[-1]
    assert dead.node == "b" and dead.cause == "node_loss"
    assert dead.durations["detect"] == pytest.approx(4.5)
    assert of_kind(job, "round_opened")[-1].data["training_at"] == pytest.approx(T0 + 1.0)


def test_a_failure_that_followed_a_node_loss_dates_the_recovery_from_the_nodes_last_heartbeat() -> None:
    job = make_job(min_nodes=1)
    join(job, T0, "a", "b")
    job.tick(T0 + 0.1)
    train(job, ("a", "b"), started=T0 + 0.5, stepped=T0 + 1.0, now=T0 + 1.0)
    beat(job, "b", T0 + 2.0)  # b's last heartbeat; b dies
    # a's worker fails on the dead peer's collective first (seen at T0 + 2.6), long before b's timeout.
    failure = WorkerFailure(rank=0, local_rank=0, exit_code=1, age_s=0.1)
    beat(job, "a", T0 + 2.7, state=NodeState.FAILED, failure=failure)
    assert of_kind(job, "round_opened")[-1].data["training_at"] == pytest.approx(T0 + 2.6)
    join(job, T0 + 3.0, "a")
    job.tick(T0 + 6.5)  # 4.5 s without b: dead; the failure was its consequence
    (dead,) = of_kind(job, "node_dead")
    assert dead.durations["detect"] == pytest.approx(4.5)
    (moved,) = of_kind(job, "failure_not_counted")
    assert moved.data == {"training": "stopped", "training_at": pytest.approx(T0 + 2.0)}
    assert job.goodput.training_time(T0 + 7) == pytest.approx(1.0), "training from T0 + 1 to b's last beat"
    assert job.rdzv.phase.value == "active"  # a alone: the round closed
    closed = of_kind(job, "round_closed")[-1].at
    train(job, ("a",), started=closed + 0.5, stepped=closed + 1.0, now=closed + 1.5)
    done = of_kind(job, "first_step")[-1]
    assert done.cause == "node_loss"
    assert done.durations["detect"] == pytest.approx(0.7), "from b's last heartbeat to a's failure verdict"
    assert done.durations["total"] == pytest.approx(closed + 1.0 - (T0 + 2.0))
    assert job.goodput.ratio(closed + 2.0) == pytest.approx((1.0 + 1.0) / (closed + 2.0 - T0))


def test_a_node_loss_moves_the_end_of_training_back_never_before_the_period_began() -> None:
    account = GoodputAccount(started_at=0.0)
    assert account.stop_earlier(5.0) is None, "no period ended yet"
    account.start(10.0)
    assert account.stop_earlier(5.0) is None, "training runs"
    account.stop(20.0)
    assert account.stop_earlier(25.0) is None, "a later moment changes nothing"
    assert account.stop_earlier(18.0) == 18.0
    assert account.training_time(30.0) == pytest.approx(8.0)
    again = GoodputAccount.restore(json.loads(json.dumps(account.snapshot())), now=40.0)
    assert again.stop_earlier(5.0) == 10.0, "not before the period began"
    assert again.training_time(40.0) == 0.0


def test_a_node_loss_lengthens_detect_back_to_the_break_but_not_into_the_previous_world() -> None:
    tracker = RecoveryTracker()
    tracker.round_closed(1, ["a", "b"], 0.0)
    for node in ("a", "b"):
        tracker.node_started(node, 1, 1.0)
        tracker.node_stepped(node, 1, 2.0)  # the world trains from 2.0
    tracker.verdict("worker_failure", began_at=10.0, at=10.5)
    tracker.reattribute("node_loss", broke_at=9.0)
    assert tracker.recovery.began_at == 9.0 and tracker.recovery.seconds["detect"] == pytest.approx(1.5)
    tracker.reattribute("node_loss", broke_at=1.0)  # before the world began training: clamped
    assert tracker.recovery.began_at == 2.0 and tracker.recovery.seconds["detect"] == pytest.approx(8.5)
    tracker.round_closed(2, ["a"], 11.0)
    tracker.node_started("a", 2, 11.5)
    _, recovery = tracker.node_stepped("a", 2, 12.0)
    assert recovery.cause == "node_loss" and recovery.total == pytest.approx(12.0 - 2.0)


def test_an_older_snapshot_without_structured_events_restores() -> None:
    job = make_job()
    join(job, T0, "a")
    old = job.snapshot()
    old["events"] = [{"kind": e.kind, "message": e.message} for e in job.events]
    for key in ("goodput", "stats", "recovery"):
        del old[key]
    again = Job.restore(job.settings, old, T0 + 10)
    assert [e.seq for e in again.events] == [1, 2, 3]
    assert again.events[0].kind == "job_started" and again.events[0].at == T0 + 10


# -- the event log --------------------------------------------------------------------------------
def events(first: int, last: int, size: int = 0) -> list[Event]:
    return [Event(T0 + i, "node_joined", "x" * size, seq=i, node="a") for i in range(first, last + 1)]


def test_the_event_log_appends_json_lines_once_and_continues_after_a_restart(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path))
    assert log.resume() == 0
    assert log.write(events(1, 3)) == 3
    assert log.write(events(1, 4)) == 1, "events already written are skipped"
    follower = EventLog(str(path))  # the next leader
    assert follower.resume() == 4
    follower.write(events(2, 6))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert set(records[0]) == {
        "incarnation",
        "seq",
        "time",
        "kind",
        "round",
        "node",
        "cause",
        "durations",
        "data",
        "message",
    }


def test_a_new_job_incarnation_on_the_same_event_log_writes_its_own_first_events(tmp_path) -> None:
    """A resubmitted job (or a memory-store master that lost its state) numbers its events from 1 again: its
    first events are written after the earlier submission's, never skipped as already written."""
    path = tmp_path / "events.jsonl"
    first = EventLog(str(path))
    first.resume("inc-1")
    first.write(events(1, 5))
    standby = EventLog(str(path))
    assert standby.resume("inc-1") == 5, "a leader of the same submission continues the file"
    second = EventLog(str(path))
    assert second.resume("inc-2") == 0
    assert second.write(events(1, 3)) == 3
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["incarnation"], r["seq"]) for r in records] == [("inc-1", s) for s in range(1, 6)] + [
        ("inc-2", s) for s in range(1, 4)
    ]
    assert EventLog(str(path)).resume("inc-2") == 3


def test_the_event_log_rotates_at_its_bound_and_keeps_the_newest_files(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), max_bytes=2000, backups=2)
    for seq in range(1, 41):
        log.write(events(seq, seq, size=200))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    oldest_first = ["events.jsonl.2", "events.jsonl.1", "events.jsonl"]
    seqs = [
        json.loads(line)["seq"]
        for name in oldest_first
        for line in (tmp_path / name).read_text().splitlines()
    ]
    assert seqs == list(range(seqs[0], 41)), "the kept files hold the newest events in order"
    path.write_text("")  # just rotated: the newest sequence number is in FILE.1
    assert (
        EventLog(str(path), max_bytes=2000, backups=2).resume()
        == json.loads((tmp_path / "events.jsonl.1").read_text().splitlines()[-1])["seq"]
    )


# -- /metrics on a real master --------------------------------------------------------------------
def test_metrics_need_the_token_and_expose_the_job(tmp_path) -> None:
    job = JobSettings(
        job_id="obs-metrics",
        min_nodes=1,
        max_nodes=1,
        node_unit=1,
        last_call_s=0.1,
        join_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=5.0,
        max_restarts=2,
    )
    log_path = tmp_path / "events.jsonl"
    master = EmbeddedMaster(ServerSettings(job=job, token="t0k", event_log=str(log_path))).start()
    try:
        with httpx.Client(base_url=f"http://{master.address}", timeout=10) as http:
            assert http.get("/metrics").status_code == 401
            assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
            reply = http.get("/metrics", headers={"Authorization": "Bearer t0k"})
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(reply.text)}
        for name in (
            "elastic_goodput_ratio",
            "elastic_restarts",
            "elastic_world_size",
            "elastic_recovery_seconds",
            "elastic_master_leader",
            "elastic_nodes",
            "elastic_rounds",
        ):
            assert name in families, sorted(families)
        leader = families["elastic_master_leader"].samples[0]
        assert leader.labels["job_id"] == "obs-metrics" and leader.value == 1.0
        badput = {s.labels["bucket"]: s.value for s in families["elastic_badput_seconds"].samples}
        assert list(badput) == list(BADPUT_BUCKETS), "every bucket from the start, each a counter"
        assert badput["other"] > 0, "the job's start-up, before any round"
        lines = log_path.read_text().splitlines()
        assert json.loads(lines[0])["kind"] == "job_started"
    finally:
        master.stop()


# -- promtool, the alert rules and the dashboard ---------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs"
_SUFFIXES = {
    "counter": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
    "gauge": ("",),
}


def live_metrics() -> str:
    """The /metrics text of a real master that ran a node (over HTTP) through a worker failure and its
    recovery, so that every family has samples."""
    job = JobSettings(
        job_id="obs-live",
        min_nodes=1,
        max_nodes=1,
        node_unit=1,
        last_call_s=0.1,
        join_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=30.0,
        max_restarts=2,
    )
    master = EmbeddedMaster(ServerSettings(job=job, token="t0k")).start()
    client = MasterClient([master.address], "obs-live", "t0k")
    try:
        number = 0
        for attempt in range(2):
            client.join(
                JoinRequest(
                    node_id="a", host="127.0.0.1", nproc=1, store_port=29500, min_nodes=1, max_nodes=1
                )
            )
            number = client.next_round("a", number, 10.0).round
            running = dict(
                node_id="a",
                round=number,
                state=NodeState.RUNNING,
                workers_started_age_s=0.2,
                first_step_age_s=0.1,
                ckpt_step=4 + attempt,
                persisted_step=4 + attempt,
                workers=[{"local_rank": 0, "pid": 1, "step": 5, "step_time_s": 0.1}],
            )
            client.heartbeat(HeartbeatRequest(**running))
            want = 4 + attempt
            wait_until(lambda want=want: master.service.job.committed_step == want, 10, "the committed step")
            if attempt == 0:
                failure = WorkerFailure(rank=0, local_rank=0, exit_code=1, age_s=0.05)
                client.heartbeat(
                    HeartbeatRequest(**{**running, "state": NodeState.FAILED, "failure": failure})
                )
        with httpx.Client(base_url=f"http://{master.address}", timeout=10) as http:
            reply = http.get("/metrics", headers={"Authorization": "Bearer t0k"})
        assert reply.status_code == 200
        return reply.text
    finally:
        client.close()
        master.stop()


def series_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


def test_promtool_accepts_the_live_metrics_and_the_alert_rules(tmp_path) -> None:
    promtool = require_tool("promtool")
    text = live_metrics()
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = subprocess.run(
        [promtool, "check", "rules", str(DOCS / "alerts.yml")], capture_output=True, text=True, timeout=60
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_every_metric_the_dashboard_and_the_rules_use_exists_on_a_live_master() -> None:
    live = series_names(live_metrics())
    for name in (
        "elastic_recovery_seconds_bucket",
        "elastic_restarts_total",
        "elastic_committed_step",
        "elastic_persisted_step",
        "elastic_node_heartbeat_age_seconds",
        "elastic_world_size",
    ):
        assert name in live, name
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [
        rule["expr"]
        for group in yaml.safe_load((DOCS / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    ]
    used = {name for expr in exprs for name in re.findall(r"\belastic_[a-z_]+", expr)}
    assert used and not used - live, f"not exported: {sorted(used - live)}"
