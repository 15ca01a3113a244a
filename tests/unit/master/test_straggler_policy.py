"""The straggler policy (master.job.stragglers.StragglerWatch): the decision on step-time series, recorded and
generated, and the job's eviction through the exclusion store (durable, exit 4, readmit)."""

from __future__ import annotations

import random

import job_calls as calls
import pytest
from health_jobs import beat, join_all, make_job

from bench.stragglers import load_series, noisy_run, replay, replay_checks, slowed
from elastic.control.job_settings import JobSettings, SettingsError
from elastic.control.protocol import Command, JoinRequest, NodeState, WorkerProgress
from master.job.job import Job
from master.job.stragglers import Pace, StragglerPolicy, StragglerTracker


def jittered(
    nodes: int, steps: int, seed: int, base: float = 0.2, jitter: float = 0.1
) -> dict[str, list[float]]:
    """Step times around ``base`` with uniform relative noise of +-``jitter``."""
    rng = random.Random(seed)
    return {f"n{i}": [base * (1 + rng.uniform(-jitter, jitter)) for _ in range(steps)] for i in range(nodes)}


@pytest.mark.parametrize("seed", range(5))
def test_a_node_slowed_1_5x_for_good_is_evicted_within_20_steps_on_noisy_steps(seed):
    run = replay(slowed(jittered(3, 400, seed), "n1", since=100))
    assert [node for _, node in run.evictions] == ["n1"]
    assert run.evictions[0][0] - 100 <= 20, run


def test_a_node_slowed_1_5x_is_evicted_within_20_steps_on_the_recorded_load():
    # Each node in turn, on 30 stretches of the recorded load: the other nodes' own slow phases may delay
    # the verdict (the reference is their median), never name them.
    checks = replay_checks(steps=0, trials=30)
    assert checks["slow_node_missed"] == 0 and checks["other_evictions_with_slow_node"] == 0, checks
    assert checks["slow_node_evicted_after_steps_median"] <= 20, checks


def test_a_3x_outlier_every_200_steps_on_a_random_node_evicts_nobody_over_10000_steps():
    run = replay(noisy_run(load_series(), 10_000))  # the recorded load of this machine, plus the outliers
    assert run.evictions == []
    run = replay(noisy_run(jittered(3, 10_000, seed=7), 10_000))  # and steady jitter
    assert run.evictions == []


def test_a_slow_phase_of_9_steps_costs_no_node():
    # A node's figure is the median of its last 20 steps: fewer than half of them slow never flag it.
    series = jittered(3, 400, seed=1)
    series["n2"] = [t * 2 if 100 <= s < 109 else t for s, t in enumerate(series["n2"])]
    run = replay(series)
    assert run.flagged_at.get("n2") is None and run.evictions == []


def test_report_never_evicts():
    assert replay(slowed(jittered(3, 300, seed=2), "n0", since=10), mode="report").evictions == []


def decide(tracker: StragglerTracker, step: int, members: int, spares: int = 0):
    """Three nodes, ``c`` twice as slow in compute, all at ``step``: the events of one assessment."""
    paces = {"a": Pace(0.4, 0.1), "b": Pace(0.4, 0.1), "c": Pace(0.4, 0.2)}
    return tracker.update(paces, float(step), dict.fromkeys(paces, step), members, spares)


def test_evict_keeps_min_nodes_and_says_so_once():
    tracker = StragglerTracker(1.5, StragglerPolicy("evict", 5, 60.0, min_nodes=3))
    notices = [m for step in range(0, 30, 2) for k, m in decide(tracker, step, 3) if k == "straggler_policy"]
    assert tracker.take_evictions() == []
    assert notices == [
        "straggler policy evict keeps node c (2.00x the median for 6 steps): removing it would leave fewer "
        "than 3 nodes (--nnodes MIN)"
    ]


def test_replace_waits_for_a_spare():
    tracker = StragglerTracker(1.5, StragglerPolicy("replace", 5, 60.0, min_nodes=1))
    events = [e for step in range(0, 12, 2) for e in decide(tracker, step, 3, spares=0)]
    assert tracker.take_evictions() == []
    assert any("no spare is waiting to take its slot" in m for _, m in events)
    decide(tracker, 12, 3, spares=1)
    (eviction,) = tracker.take_evictions()
    assert eviction.node_id == "c" and eviction.steps == 12
    assert eviction.cause().startswith("straggler replaced by a spare: compute time 0.200s per step, 2.00x")


def test_the_policy_says_once_that_it_cannot_act_without_compute_times():
    tracker = StragglerTracker(1.5, StragglerPolicy("evict", 5, 60.0, min_nodes=1))
    paces = {"a": Pace(0.4), "b": Pace(0.4, None)}
    first = tracker.update(paces, 0.0, {"a": 1, "b": 1}, 2, 0)
    assert [k for k, _ in first] == ["straggler_policy"]
    assert "cannot name stragglers from compute time: node a" in first[0][1]
    assert "elastic.track_ddp" in first[0][1]
    assert tracker.update(paces, 1.0, {"a": 2, "b": 2}, 2, 0) == []
    silent = StragglerTracker(1.5, StragglerPolicy("report", 5, 60.0, min_nodes=1))
    assert silent.update(paces, 0.0, {"a": 1, "b": 1}, 2, 0) == []


def test_the_settings_refuse_an_unknown_policy_or_an_empty_window():
    with pytest.raises(SettingsError, match="--straggler-policy must be one of report, evict, replace"):
        JobSettings(job_id="j", straggler_policy="kick")  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="--straggler-window must be >= 1"):
        JobSettings(job_id="j", straggler_window=0)


def work(step: int, compute: float) -> list[WorkerProgress]:
    return [WorkerProgress(local_rank=0, step=step, step_time_s=0.4, compute_time_s=compute)]


def test_the_job_evicts_a_straggler_excludes_it_durably_and_readmit_lifts_it():
    job = make_job(straggler_policy="evict", straggler_factor=1.3, straggler_cooldown_s=120.0)
    join_all(job, 0.0, "a", "b", "c")
    now = 1.0
    for step in range(1, 30):
        now += 0.5
        for node, compute in (("a", 0.1), ("b", 0.1), ("c", 0.15)):
            beat(job, node, now, workers=work(step, compute))
        job.tick(now)
        if "c" not in job.nodes:
            break
    assert "c" not in job.nodes, "the straggler was not evicted"
    (event,) = [e for e in job.events if e.kind == "straggler_evicted"]
    assert event.node == "c"
    assert "node c excluded: straggler evicted: compute time 0.150s per step, 1.50x the median 0.100s" in (
        event.message
    )
    assert "elastic-master readmit c" in event.message
    assert job.rdzv.round == 2, "the others' round reopens without it (a membership change)"
    assert job.restart_count == 0
    reply = beat(job, "c", now + 0.5, workers=work(30, 0.15))
    assert reply.command is Command.EXCLUDE and reply.outcome is not None and reply.outcome.exit_code == 4
    assert "excluded from job job-1: straggler evicted" in reply.outcome.summary
    row = next(n for n in job.status(now).nodes if n.node_id == "c")
    assert row.state == "excluded" and row.excluded_reason.startswith("straggler evicted")

    # Durable: a master taking over keeps the exclusion.
    taken = Job.restore(job.settings, job.snapshot(), now + 1.0, master_id="m2")
    assert taken.exclusion("c") is not None and "straggler evicted" in taken.exclusion("c")
    taken.readmit("c", now + 2.0)
    assert taken.exclusion("c") is None
    assert [e.kind for e in taken.events][-1] == "node_readmitted"


def test_an_evicted_straggler_is_readmitted_after_its_cooldown():
    job = make_job(straggler_policy="evict", straggler_factor=1.3, straggler_cooldown_s=10.0)
    join_all(job, 0.0, "a", "b", "c")
    now = 1.0
    for step in range(1, 30):
        now += 0.5
        for node, compute in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
            beat(job, node, now, workers=work(step, compute))
        job.tick(now)
        if "c" not in job.nodes:
            break
    assert job.exclusion("c") is not None
    job.tick(now + 9.0)
    assert job.exclusion("c") is not None
    job.tick(now + 10.0)
    assert job.exclusion("c") is None
    assert "node c re-admitted: its cool-down of 10s is over" in [e.message for e in job.events]


def test_replace_swaps_a_straggler_for_a_waiting_spare():
    job = make_job(straggler_policy="replace", straggler_factor=1.3, min_nodes=3, max_nodes=3)
    join_all(job, 0.0, "a", "b", "c")
    calls.join(
        job, JoinRequest(node_id="d", host="10.0.0.9", nproc=1, store_port=1, min_nodes=3, max_nodes=3), 0.5
    )
    job.tick(0.5)
    assert job.rdzv.spares == ["d"]
    now = 1.0
    for step in range(1, 30):
        now += 0.5
        for node, compute in (("a", 0.1), ("b", 0.1), ("c", 0.15)):
            beat(job, node, now, workers=work(step, compute))
        beat(job, "d", now, round=0, state=NodeState.WAITING)
        job.tick(now)
        if "c" not in job.nodes:
            break
    assert job.exclusion("c") is not None and "straggler replaced by a spare" in job.exclusion("c")
    for i, node in enumerate(("a", "b")):  # the others rejoin, told so by their next heartbeat
        req = JoinRequest(
            node_id=node, host=f"10.0.0.{i + 1}", nproc=1, store_port=2, min_nodes=3, max_nodes=3
        )
        calls.join(job, req, now + 1.0)
    job.tick(now + 1.0)
    assert job.rdzv.current is not None and sorted(job.rdzv.current.members) == ["a", "b", "d"]
