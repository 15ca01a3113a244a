"""Flapping nodes (``master.job.flapping`` and its hooks in ``master.job.job``) with a fake clock: a node id
lost more than ``--flap-limit`` times within ``--flap-window`` is excluded until ``--flap-cooldown`` ends or
an
operator re-admits it; the counters and exclusions are durable (snapshot/restore, write-ahead effects)."""

from __future__ import annotations

import job_calls as calls
import pytest
from job_builders import HB_TIMEOUT, LAST_CALL, join, join_req, kinds, make_job, new_kinds, running

from elastic.control.job_settings import JobSettings, SettingsError
from elastic.control.protocol import Command, HeartbeatRequest, JoinRequest, NodeState
from master.cli.status import render_status
from master.job.errors import NodeExcludedError, UnknownNodeError
from master.job.flapping import FlapCounter, FlapPolicy
from master.job.job import Job
from master.job.rendezvous import Phase

pytestmark = pytest.mark.timeout(10)

LIMIT, WINDOW, COOLDOWN = 2, 60.0, 20.0


def counter(limit: int = LIMIT) -> FlapCounter:
    return FlapCounter(FlapPolicy(limit, WINDOW, COOLDOWN))


def flap_job(**overrides: object) -> Job:
    values: dict = dict(
        min_nodes=2, max_nodes=3, flap_limit=LIMIT, flap_window_s=WINDOW, flap_cooldown_s=COOLDOWN
    )
    values.update(overrides)
    return make_job(**values)


def restart_agent(job: Job, node_id: str, now: float):
    """A new agent for ``node_id`` (no secret) after the previous one closed its connection: a REPLACE."""
    calls.connection_lost(job, node_id, now)
    reply = job.join(join_req(job, node_id), now + 0.01, None)
    calls.secrets_of(job)[node_id] = reply.node_secret
    return reply


def settle(job: Job, now: float, *node_ids: str) -> float:
    """The members rejoin the round a loss opened; it closes and they run. Returns the time after."""
    join(job, now, *node_ids)
    now += LAST_CALL + 0.5
    job.tick(now)
    assert job.rdzv.phase is Phase.ACTIVE
    for node_id in node_ids:
        calls.heartbeat(job, _beat(job, node_id), now)
    return now


def flap_by_restarts(job: Job, node_id: str, others: tuple[str, ...], now: float, times: int) -> float:
    """``times`` restarts of ``node_id``'s agent, each followed by the new round; returns the time after."""
    for _ in range(times):
        restart_agent(job, node_id, now)
        now = settle(job, now + 0.1, *others) + 1.0
    return now


def _beat(job: Job, node_id: str) -> HeartbeatRequest:
    return HeartbeatRequest(node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING)


# -- the pure counter -----------------------------------------------------------------------------------
def test_more_than_limit_losses_in_the_window_exclude_until_the_cooldown():
    flaps = counter()
    assert flaps.note("a", 0.0) is None
    assert flaps.note("a", 10.0) is None
    exclusion = flaps.note("a", 20.0, host="h", nproc=2)  # the K+1th within 60 s
    assert exclusion is not None and exclusion.count == LIMIT + 1
    assert (exclusion.since, exclusion.until) == (20.0, 20.0 + COOLDOWN)
    assert "a" in flaps.excluded and flaps.note("a", 21.0) is None, "an excluded id counts no more"
    assert flaps.expired(20.0 + COOLDOWN - 0.1) == []
    assert [e.node_id for e in flaps.expired(20.0 + COOLDOWN)] == ["a"]
    assert "a" not in flaps.excluded and flaps.count("a", 41.0) == 0, "the count starts afresh"


def test_the_window_slides_old_losses_do_not_count():
    flaps = counter()
    assert flaps.note("a", 0.0) is None
    assert flaps.note("a", 30.0) is None
    assert flaps.note("a", 61.0) is None, "the loss at 0 left the 60 s window"
    assert flaps.count("a", 61.0) == 2
    assert flaps.note("a", 89.0) is not None, "30, 61 and 89 are within 60 s"
    other = counter()
    for t in (0.0, 70.0, 140.0, 210.0):  # one loss per window, for ever: never excluded
        assert other.note("b", t) is None
    other.expired(400.0)
    assert other.losses == {}, "losses out of the window are dropped"


def test_operator_readmit_and_off_when_limit_is_zero():
    flaps = counter()
    for t in (0.0, 1.0, 2.0):
        flaps.note("a", t)
    assert flaps.readmit("a") is not None and flaps.readmit("a") is None
    off = counter(limit=0)
    assert all(off.note("a", float(t)) is None for t in range(100)) and off.excluded == {}


def test_counters_and_exclusions_survive_snapshot_and_restore():
    flaps = counter()
    flaps.note("a", 0.0)
    for t in (0.0, 1.0, 2.0):
        flaps.note("b", t, host="hb", nproc=4)
    again = counter()
    again.restore(flaps.snapshot())
    assert again.losses == flaps.losses and again.excluded == flaps.excluded
    assert again.note("a", 3.0) is None and again.note("a", 4.0) is not None, "a's first loss still counts"


def test_settings_validate_the_flap_options():
    with pytest.raises(SettingsError, match="--flap-limit"):
        JobSettings(job_id="j", flap_limit=-1)
    with pytest.raises(SettingsError, match="--flap-window"):
        JobSettings(job_id="j", flap_window_s=0)
    with pytest.raises(SettingsError, match="--flap-cooldown"):
        JobSettings(job_id="j", flap_cooldown_s=-1)


# -- the job ------------------------------------------------------------------------------------------
def test_a_restarting_agent_is_excluded_after_limit_plus_one_flaps_and_the_others_go_on():
    job = flap_job()
    running(job, 0.0, "a", "b", "c")
    now = flap_by_restarts(job, "c", ("a", "b"), 1.0, LIMIT)
    assert "c" in job.nodes and job.flapping.count("c", now) == LIMIT
    round_before = job.rdzv.round
    mark = job.event_count
    calls.connection_lost(job, "c", now)
    with pytest.raises(
        NodeExcludedError, match=r"excluded from job job-1 for flapping.*elastic-master readmit c"
    ):
        job.join(join_req(job, "c"), now + 0.01, None)
    assert "node_flapping_excluded" in new_kinds(job, mark)
    event = next(e for e in job.events if e.kind == "node_flapping_excluded")
    assert dict(event.data) == {"count": LIMIT + 1, "window_s": WINDOW, "until": now + 0.01 + COOLDOWN}
    assert "c" not in job.nodes and job.rdzv.round == round_before + 1, "its removal opened a round"
    after = settle(job, now + 0.1, "a", "b")
    assert job.rdzv.current.members == ["a", "b"]
    with pytest.raises(NodeExcludedError):
        job.join(join_req(job, "c"), after, None)
    # Its old incarnation's heartbeats and watches are told to stop, with the same line.
    stop = job.heartbeat(_beat(job, "c"), after, None)
    assert stop.command is Command.EXCLUDE and "for flapping" in stop.outcome.summary
    assert job.watch("c", 1, None).command is Command.EXCLUDE
    assert job.command_for("a", job.rdzv.round, job.round_term).command is Command.CONTINUE


def test_dead_verdicts_count_and_the_cooldown_readmits_with_an_event():
    job = flap_job()
    running(job, 0.0, "a", "b", "c")
    now = 0.0
    for i in range(LIMIT + 1):
        now += HB_TIMEOUT + 1.0  # c is silent past the heartbeat timeout; a and b are not
        for node_id in "ab":
            calls.heartbeat(job, _beat(job, node_id), now)
        job.tick(now)
        assert "c" not in job.nodes, "c declared dead"
        if i < LIMIT:
            calls.secrets_of(job).pop("c")
            join(job, now + 0.1, "c")
            now = settle(job, now + 0.2, "a", "b")
            calls.heartbeat(job, _beat(job, "c"), now)
    assert "node_flapping_excluded" in kinds(job), kinds(job)
    assert kinds(job).count("node_dead") == LIMIT + 1
    until = job.flapping.excluded["c"].until
    assert until == now + COOLDOWN
    row = next(n for n in job.status(until - 5.0).nodes if n.node_id == "c")
    assert row.state == "excluded" and "flapping" in row.excluded_reason and row.readmit_in_s == 5.0
    assert "excluded node c: flapping" in render_status(job.status(until - 5.0))
    mark = job.event_count
    job.tick(until - 0.01)
    assert "c" in job.flapping.excluded
    job.tick(until)
    assert "node_readmitted" in new_kinds(job, mark) and "c" not in job.flapping.excluded
    join(job, until + 0.1, "c")  # accepted again
    assert job.rdzv.has_joined("c")


def test_a_flap_of_a_node_that_is_not_a_member_still_counts():
    job = flap_job(min_nodes=2, max_nodes=2)
    running(job, 0.0, "a", "b")
    join(job, 0.5, "c")  # waits: the round is full
    assert not job.rdzv.is_member("c")
    restart_agent(job, "c", 1.0)  # one
    for node_id in "ab":
        calls.heartbeat(job, _beat(job, node_id), 5.5)
    job.tick(5.5)  # c, waiting, declared dead: two
    assert "c" not in job.nodes and job.flapping.count("c", 5.5) == 2
    calls.secrets_of(job).pop("c")
    join(job, 6.0, "c")
    with pytest.raises(NodeExcludedError):
        restart_agent(job, "c", 7.0)  # three: excluded
    assert job.rdzv.current.members == ["a", "b"] and job.rdzv.phase is Phase.ACTIVE, "no round for that"


def test_exclusion_and_readmission_are_durable_effects_and_the_operator_can_readmit():
    job = flap_job()
    running(job, 0.0, "a", "b", "c")
    now = flap_by_restarts(job, "c", ("a", "b"), 1.0, LIMIT)
    job.take_effects()
    with pytest.raises(NodeExcludedError):
        restart_agent(job, "c", now)
    effects = job.take_effects()
    assert effects.persist and effects.wake and "node_flapping_excluded" in [e.kind for e in effects.events]
    with pytest.raises(UnknownNodeError, match="not excluded for flapping"):
        job.readmit("a", now + 1.0)
    assert not job.take_effects().persist
    job.readmit("c", now + 1.0)
    effects = job.take_effects()
    assert effects.persist and effects.wake and [e.kind for e in effects.events] == ["node_readmitted"]
    restart_agent(job, "c", now + 1.5)
    assert job.rdzv.has_joined("c")


def test_a_master_taking_over_keeps_the_counters_and_the_exclusion():
    job = flap_job()
    running(job, 0.0, "a", "b", "c")
    flap_by_restarts(job, "c", ("a", "b"), 1.0, 1)  # one flap of c, counted
    for t in (1.0, 1.5, 2.0):
        job.flapping.note("d", t, host="hd", nproc=1)  # d excluded
    taken = calls.restored(job, Job.restore(job.settings, job.snapshot(), now=10.0))
    assert taken.flapping.count("c", 10.0) == 1 and "d" in taken.flapping.excluded
    with pytest.raises(NodeExcludedError, match="for flapping"):
        taken.join(join_req(taken, "d"), 10.0, None)
    assert any(n.node_id == "d" and n.state == "excluded" for n in taken.status(10.0).nodes)


def test_off_when_the_limit_is_zero():
    job = flap_job(flap_limit=0)
    running(job, 0.0, "a", "b", "c")
    flap_by_restarts(job, "c", ("a", "b"), 1.0, 5)
    assert job.flapping.excluded == {} and job.flapping.losses == {}
    assert "node_flapping_excluded" not in kinds(job)


# -- default node ids (HOSTNAME-PID): counted per host name and advertised address ------------------------
HOST_KEY = "gpu7@10.0.0.9"


def _default_agent(job: Job, pid: int, address: str = "10.0.0.9") -> JoinRequest:
    """The join of an agent started without --node-id on host gpu7: its id is elastic-run's HOSTNAME-PID."""
    return join_req(job, f"gpu7-{pid}", host=address, default_id=True)


def _crash_loop(job: Job, first_pid: int, losses: int, now: float) -> tuple[float, str]:
    """An agent with a default id crashes ``losses`` times; each time its restart (a new PID, so a new id)
    joins before the master declares the previous one dead. Returns the time after and the newest id."""
    newest = f"gpu7-{first_pid}"
    calls.join(job, _default_agent(job, first_pid), now)
    for pid in range(first_pid + 1, first_pid + 1 + losses):
        now += HB_TIMEOUT + 1.0  # the crashed agent is silent past the heartbeat timeout
        crashed, newest = newest, f"gpu7-{pid}"
        calls.join(job, _default_agent(job, pid), now - 0.5)
        for node_id in ("a", "b", newest):
            calls.heartbeat(job, _beat(job, node_id), now)
        job.tick(now)
        assert crashed not in job.nodes, f"{crashed} declared dead"
    return now, newest


def test_a_default_id_crash_loop_is_excluded_per_host_and_address():
    job = flap_job(max_nodes=2)  # the looping agent waits for a place: its losses count all the same
    running(job, 0.0, "a", "b")
    now, newest = _crash_loop(job, 100, LIMIT, 0.0)
    assert job.flapping.count(HOST_KEY, now) == LIMIT and not job.flapping.excluded, "every id lost once"
    now, newest = _crash_loop(job, 200, 1, now)  # one more loss: more than the limit within the window
    exclusion = job.flapping.excluded[HOST_KEY]
    assert exclusion.by_host and exclusion.count == LIMIT + 1
    assert newest not in job.nodes, "the loop's live agent goes with the exclusion"
    assert "node_flapping_excluded" in kinds(job)
    with pytest.raises(NodeExcludedError, match=r"default node ids \(HOSTNAME-PID\) at gpu7@10\.0\.0\.9"):
        calls.join(job, _default_agent(job, 300), now + 1.0)  # the next restart, under yet another id
    calls.join(job, _default_agent(job, 301, address="10.0.0.10"), now + 1.0)  # another address: let in
    calls.join(job, join_req(job, "gpu7-302", host="10.0.0.9"), now + 1.0)  # an explicit id
    taken = calls.restored(job, Job.restore(job.settings, job.snapshot(), now=now + 2.0))
    with pytest.raises(NodeExcludedError, match="for flapping"):
        calls.join(taken, _default_agent(taken, 303), now + 2.0)  # durable
    taken.readmit(HOST_KEY, now + 3.0)  # the operator's command names the host and address
    calls.join(taken, _default_agent(taken, 304), now + 3.0)


def test_explicit_ids_on_one_host_are_counted_per_id():
    job = flap_job(max_nodes=2)
    running(job, 0.0, "a", "b")
    now = 0.0
    ids = [f"gpu7-{i}" for i in range(LIMIT + 1)]  # several nodes of one host and address (tests, SLURM)
    for node_id in ids:
        calls.join(job, join_req(job, node_id, host="10.0.0.9"), now)
    now += HB_TIMEOUT + 1.0
    for node_id in "ab":
        calls.heartbeat(job, _beat(job, node_id), now)
    job.tick(now)  # all of them lost at once: one loss per id
    assert not any(node_id in job.nodes for node_id in ids)
    assert not job.flapping.excluded and all(job.flapping.count(i, now) == 1 for i in ids)
