"""A leader that stops hearing from most of its nodes at once suspects its own network
(master.job.liveness.silent_at_once): it holds their dead verdicts for one heartbeat timeout and asks to
resign, once per incident; a successor that restores the incident, or the same master once the hold ends,
declares the still-silent nodes dead. Pure, on a fake clock; the service's resignation over a real etcd is
tests/e2e/test_leader_partition_e2e.py's."""

from __future__ import annotations

import job_calls as calls
import pytest
from job_builders import HB_TIMEOUT, beat, make_job, running

from master.job.job import Job
from master.job.liveness import MIN_SILENT, SILENT_INTERVALS, silent_at_once
from master.service.service import MasterService, resign_pause
from master.service.settings import ServerSettings

INTERVAL = 1.0  # make_job's heartbeat interval
QUIET = SILENT_INTERVALS * INTERVAL


# -- the rule -------------------------------------------------------------------------------------------
def test_most_of_the_membership_silent_at_once_is_suspect() -> None:
    ages = {"a": HB_TIMEOUT + 0.1, "b": HB_TIMEOUT - 0.5, "c": QUIET + 0.1, "d": 0.2}
    assert silent_at_once(ages, ["a"], [], 4, INTERVAL) == {"a", "b", "c"}


def test_half_or_fewer_silent_is_believed() -> None:
    ages = {"a": HB_TIMEOUT + 0.1, "b": QUIET + 0.1, "c": 0.3, "d": 0.2}
    assert silent_at_once(ages, ["a"], [], 4, INTERVAL) == frozenset()


def test_one_silent_node_is_believed_even_alone() -> None:
    assert MIN_SILENT == 2
    assert silent_at_once({"a": HB_TIMEOUT + 0.1}, ["a"], [], 1, INTERVAL) == frozenset()


def test_no_verdict_due_no_suspicion() -> None:
    ages = {"a": QUIET + 1.0, "b": QUIET + 1.0}
    assert silent_at_once(ages, [], [], 2, INTERVAL) == frozenset()


def test_members_left_out_of_the_ages_count_as_heard() -> None:
    """The caller passes only the quiet prefix (O(quiet)); the membership counts everyone."""
    ages = {"a": HB_TIMEOUT + 0.1, "b": QUIET + 0.1}
    assert silent_at_once(ages, ["a"], [], 3, INTERVAL) == {"a", "b"}
    assert silent_at_once(ages, ["a"], [], 4, INTERVAL) == frozenset()


def test_closed_connections_corroborate_the_loss() -> None:
    """A FIN or RST reached this master: its network works, those nodes are gone for real."""
    ages = {"a": HB_TIMEOUT + 0.1, "b": HB_TIMEOUT + 0.1, "c": 0.1}
    assert silent_at_once(ages, ["a", "b"], ["a", "b"], 3, INTERVAL) == frozenset()
    assert silent_at_once(ages, ["a", "b"], ["a"], 3, INTERVAL) == frozenset()
    assert silent_at_once(ages, ["a", "b"], [], 3, INTERVAL) == {"a", "b"}


# -- the job on a fake clock ----------------------------------------------------------------------------
def three_running() -> tuple[Job, float]:
    job = make_job(min_nodes=3, max_nodes=3)
    running(job, 10.0, "a", "b", "c")
    return job, 10.0


def tick_until(job: Job, now: float, until: float, beating: tuple[str, ...] = ()) -> float:
    while now < until:
        now += 0.25
        for node_id in beating:
            beat(job, node_id, now)
        job.tick(now)
    return now


def verdicts(job: Job) -> list[str]:
    return [e.node for e in job.events if e.kind == "node_dead"]


def suspicions(job: Job) -> int:
    return [e.kind for e in job.events].count("master_suspected")


def test_a_silent_world_holds_the_verdicts_then_declares_them() -> None:
    """Without a standby (a memory store) the hold is the whole effect: one more heartbeat timeout."""
    job, now = three_running()
    round_before = job.rdzv.round
    now = tick_until(job, now, 10.0 + HB_TIMEOUT + 0.3)
    assert verdicts(job) == [] and suspicions(job) == 1
    assert job.suspicion.resign_wanted and job.suspicion.incident == {"a", "b", "c"}
    suspected = next(e for e in job.events if e.kind == "master_suspected")
    assert suspected.data["silent"] == ["a", "b", "c"]
    assert job.rdzv.round == round_before, "no round opened while suspecting itself"
    now = tick_until(job, now, 10.0 + 2 * HB_TIMEOUT + 0.5)
    assert sorted(verdicts(job)) == ["a", "b", "c"], "a real mass loss is still declared"
    assert suspicions(job) == 1, "at most one suspicion per incident"
    assert job.suspicion.incident == set(), "the incident ended with its verdicts"


def test_nodes_heard_again_end_the_incident_without_a_restart() -> None:
    job, now = three_running()
    restarts = job.restart_count
    now = tick_until(job, now, 10.0 + HB_TIMEOUT + 0.3)
    assert suspicions(job) == 1
    version = job.version
    now = tick_until(job, now, now + HB_TIMEOUT * 2, beating=("a", "b", "c"))
    assert verdicts(job) == [] and job.restart_count == restarts
    assert job.suspicion.incident == set() and job.version > version, "its end is durable"
    assert not job.suspicion.settle(job.liveness), "noted once"
    # A later incident is a new one: it may suspect again.
    tick_until(job, now, now + HB_TIMEOUT + 0.3)
    assert suspicions(job) == 2 and verdicts(job) == []


def test_a_single_loss_is_declared_at_its_timeout() -> None:
    job, now = three_running()
    tick_until(job, now, 10.0 + HB_TIMEOUT + 0.3, beating=("a", "b"))
    assert verdicts(job) == ["c"] and suspicions(job) == 0


def test_closed_connections_are_declared_without_suspicion() -> None:
    """All agents SIGKILLed: their connections close, the leader hears that, and believes it."""
    job, now = three_running()
    for node_id in ("a", "b", "c"):
        calls.connection_lost(job, node_id, now)
    tick_until(job, now, 10.0 + HB_TIMEOUT)
    assert sorted(verdicts(job)) == ["a", "b", "c"] and suspicions(job) == 0


def test_a_successor_declares_the_incident_dead_after_its_grace() -> None:
    """The incident is durable: the master that takes over after the resignation does not resign again."""
    job, now = three_running()
    now = tick_until(job, now, 10.0 + HB_TIMEOUT + 0.3)
    assert suspicions(job) == 1
    successor = calls.restored(job, Job.restore(job.settings, job.snapshot(), now + 0.5, "successor", 2))
    assert successor.suspicion.incident == {"a", "b", "c"}
    assert not successor.suspicion.resign_wanted
    tick_until(successor, now + 0.5, now + 0.5 + HB_TIMEOUT + 0.5)
    assert sorted(verdicts(successor)) == ["a", "b", "c"]
    assert suspicions(successor) == 1, "only the predecessor's (restored with the events)"
    assert not successor.suspicion.resign_wanted


def test_a_successor_the_nodes_reach_keeps_the_round() -> None:
    job, now = three_running()
    now = tick_until(job, now, 10.0 + HB_TIMEOUT + 0.3)
    successor = calls.restored(job, Job.restore(job.settings, job.snapshot(), now + 0.5, "successor", 2))
    round_before = successor.rdzv.round
    tick_until(successor, now + 0.5, now + 0.5 + 3 * HB_TIMEOUT, beating=("a", "b", "c"))
    assert verdicts(successor) == [] and successor.rdzv.round == round_before
    assert successor.suspicion.incident == set()


# -- the service: only a durable store resigns ------------------------------------------------------------
def test_a_memory_store_master_only_holds() -> None:
    clock = [10.0]
    job = make_job(min_nodes=3, max_nodes=3)
    service = MasterService(ServerSettings(job=job.settings, token="t"), clock=lambda: clock[0])
    service.job = job
    running(job, clock[0], "a", "b", "c")
    while clock[0] < 10.0 + HB_TIMEOUT + 0.3:
        clock[0] += 0.1
        service.tick()
    assert suspicions(job) == 1 and not job.suspicion.resign_wanted, "the service took the request"
    assert service.job is job and service.store.leading, "no standby to hand over to: it leads on"


@pytest.mark.parametrize(
    ("interval", "timeout", "pause"), [(0.5, 3.0, 1.0), (2.0, 10.0, 4.0), (2.0, 3.0, 3.0)]
)
def test_resign_pause(interval: float, timeout: float, pause: float) -> None:
    assert resign_pause(interval, timeout) == pause
