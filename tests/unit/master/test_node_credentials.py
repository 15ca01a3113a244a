"""Node credentials (``master.job.liveness`` and their use in ``master.job.job.Job``), with a fake clock:
one secret per node incarnation, returned by its join and required on every later request for the node; a
join under a live node's id without its secret is a duplicate; a dead, departed or disconnected
incarnation is replaced by the next join; the job stores hashes only, and they survive a takeover.
And the agent's side of the contract: the error table (``elastic.control.error_table``)."""

from __future__ import annotations

import json
import re

import pytest

from elastic.control.error_table import Disposition, disposition
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import Command, HeartbeatRequest, JoinRequest, NodeState, WorkerFailure
from master.http.errors import http_status
from master.job.errors import BadNodeSecretError, DuplicateNodeError, UnknownNodeError
from master.job.job import Job
from master.job.liveness import JoinKind, hash_secret, judge_join, matches, new_secret
from master.job.rendezvous import Phase

pytestmark = pytest.mark.timeout(10)

HB_INTERVAL = 1.0
HB_TIMEOUT = 4.0


def make_job(**overrides: object) -> Job:
    values: dict = dict(
        job_id="job-1",
        min_nodes=2,
        max_nodes=2,
        last_call_s=2.0,
        join_timeout_s=60.0,
        heartbeat_interval_s=HB_INTERVAL,
        heartbeat_timeout_s=HB_TIMEOUT,
        max_restarts=3,
    )
    values.update(overrides)
    return Job(JobSettings(**values), now=0.0)


def join_req(node_id: str, host: str = "10.0.0.1") -> JoinRequest:
    return JoinRequest(node_id=node_id, host=host, nproc=1, store_port=29500, min_nodes=2, max_nodes=2)


def beat(job: Job, node_id: str, now: float, secret: str | None, **fields: object):
    values: dict = dict(node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING)
    values.update(fields)
    return job.heartbeat(HeartbeatRequest(**values), now, secret)


def running(job: Job) -> dict[str, str]:
    """Nodes a and b join at t=0 and run round 1; their secrets."""
    secrets = {n: job.join(join_req(n), 0.0).node_secret for n in ("a", "b")}
    job.tick(0.0)
    assert job.rdzv.phase is Phase.ACTIVE
    for node_id, secret in secrets.items():
        assert beat(job, node_id, 0.0, secret).command is Command.CONTINUE
    return secrets


def state(job: Job) -> tuple:
    """Everything a refused request must leave alone: stored state, version, events, status."""
    return json.dumps(job.snapshot(), sort_keys=True), job.version, job.event_count, job.status(1.0)


# -- the pure decision ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stored", "alive", "sent", "kind"),
    [
        (None, False, None, JoinKind.NEW),
        (None, False, "old secret of a dead incarnation", JoinKind.NEW),
        ("s", True, "s", JoinKind.REJOIN),
        ("s", False, "s", JoinKind.REJOIN),
        ("s", True, None, JoinKind.DUPLICATE),
        ("s", True, "someone else's", JoinKind.DUPLICATE),
        ("s", False, None, JoinKind.REPLACE),
        ("s", False, "someone else's", JoinKind.REPLACE),
    ],
)
def test_judge_join(stored: str | None, alive: bool, sent: str | None, kind: JoinKind) -> None:
    assert judge_join(hash_secret(stored) if stored else None, alive, sent) is kind


def test_secrets_are_random_and_only_their_own_hash_matches() -> None:
    first, second = new_secret(), new_secret()
    assert first != second and len(first) >= 43 and re.fullmatch(r"[A-Za-z0-9_-]+", first)
    assert matches(hash_secret(first), first)
    assert not matches(hash_secret(first), second)
    assert not matches(hash_secret(first), None) and not matches(hash_secret(first), "")
    assert not matches("", first), "a node without a stored hash accepts nothing"


# -- joins ------------------------------------------------------------------------------------------------
def test_a_join_returns_a_secret_that_the_job_keeps_only_as_a_hash() -> None:
    job = make_job()
    secret = job.join(join_req("a"), 0.0).node_secret
    assert secret and job.nodes["a"].secret_hash == hash_secret(secret)
    assert secret not in json.dumps(job.snapshot())


def test_a_rejoin_with_its_secret_keeps_the_secret_and_restarts_the_world() -> None:
    job = make_job()
    secrets = running(job)
    failure = WorkerFailure(rank=1, local_rank=0, exit_code=1, message="boom")
    assert (
        beat(job, "b", 1.0, secrets["b"], state=NodeState.FAILED, failure=failure).command is Command.REJOIN
    )
    for node_id in ("a", "b"):  # both agents rejoin, each with its own secret
        assert job.join(join_req(node_id), 1.5, secrets[node_id]).node_secret == secrets[node_id]
    job.tick(1.5)
    assert job.rdzv.phase is Phase.ACTIVE and job.rdzv.round == 2 and job.restart_count == 1
    assert beat(job, "a", 2.0, secrets["a"]).command is Command.CONTINUE


@pytest.mark.parametrize("sent", [None, "a-guess"], ids=["no-secret", "wrong-secret"])
def test_a_join_under_a_live_node_id_without_its_secret_is_a_duplicate_and_changes_nothing(
    sent: str | None,
) -> None:
    job = make_job()
    secrets = running(job)
    before = state(job)
    with pytest.raises(DuplicateNodeError) as info:
        job.join(join_req("a", host="10.9.9.9"), 1.0, sent)
    assert (http_status(info.value), info.value.code) == (409, "duplicate_node")
    assert "node id a is in use by another live agent" in str(info.value) and "--node-id" in str(info.value)
    assert state(job) == before
    assert beat(job, "a", 1.0, secrets["a"]).command is Command.CONTINUE, "the first agent goes on"


def test_a_finished_node_id_stays_taken_while_the_job_runs() -> None:
    job = make_job()
    secrets = running(job)
    beat(job, "a", 1.0, secrets["a"], state=NodeState.SUCCEEDED)
    with pytest.raises(DuplicateNodeError):
        job.join(join_req("a"), 10.0 * HB_TIMEOUT)  # no heartbeats from a finished node: not a death


def test_a_join_replaces_an_incarnation_declared_dead() -> None:
    job = make_job()
    secrets = running(job)
    beat(job, "b", HB_TIMEOUT, secrets["b"])
    job.tick(HB_TIMEOUT + 0.5)  # a: silent for longer than the timeout
    assert "a" not in job.nodes and "node_dead" in [e.kind for e in job.events]
    new = job.join(join_req("a"), HB_TIMEOUT + 1.0).node_secret
    assert new != secrets["a"]
    with pytest.raises(BadNodeSecretError):  # the old agent, should it wake up, acts for nobody
        beat(job, "a", HB_TIMEOUT + 1.0, secrets["a"])
    assert beat(job, "a", HB_TIMEOUT + 1.0, new, round=0, state=NodeState.WAITING).command is Command.CONTINUE


def test_a_join_replaces_a_silent_incarnation_before_the_tick_declares_it_dead() -> None:
    job = make_job()
    secrets = running(job)
    reply = job.join(join_req("a"), HB_TIMEOUT + 0.1)  # no tick ran since the timeout passed
    assert reply.node_secret != secrets["a"]
    assert [e.message for e in job.events if e.kind == "node_replaced"] == [
        "node a: a new agent replaced the previous one (it stopped heartbeating)"
    ]


def test_a_join_replaces_an_incarnation_that_left() -> None:
    job = make_job()
    secrets = running(job)
    job.leave("a", "preempted", 1.0, secrets["a"])
    new = job.join(join_req("a"), 1.5).node_secret
    assert new and new != secrets["a"] and job.nodes["a"].secret_hash == hash_secret(new)


def test_a_join_replaces_an_incarnation_whose_master_connection_closed() -> None:
    job = make_job()
    secrets = running(job)
    job.connection_lost("a", 1.0, secrets["a"])  # e.g. SIGKILL: the kernel closed its long-poll
    new = job.join(join_req("a"), 1.2).node_secret  # its restarted agent, before any dead verdict
    assert new != secrets["a"]
    assert [e.message for e in job.events if e.kind == "node_replaced"] == [
        "node a: a new agent replaced the previous one (its connection to the master closed)"
    ]
    assert job.rdzv.phase is Phase.OPEN, "a member's new agent: a membership change, not a failure"
    assert job.restart_count == 0
    with pytest.raises(BadNodeSecretError):
        beat(job, "a", 1.3, secrets["a"])


def test_a_closed_connection_counts_only_with_the_nodes_secret() -> None:
    job = make_job()
    secrets = running(job)
    job.connection_lost("a", 1.0, None)  # somebody's long-poll for a, without a's secret
    job.connection_lost("a", 1.0, secrets["b"])
    assert not job.liveness.suspected("a") and "node_suspect" not in [e.kind for e in job.events]
    with pytest.raises(DuplicateNodeError):
        job.join(join_req("a"), 1.1)


# -- requests for a node ----------------------------------------------------------------------------------
def refused_requests(job: Job, node_id: str, secret: str | None) -> dict:
    failure = WorkerFailure(rank=0, local_rank=0, exit_code=1, message="forged failure")
    return {
        "failure report": lambda: beat(job, node_id, 1.0, secret, state=NodeState.FAILED, failure=failure),
        "success report": lambda: beat(job, node_id, 1.0, secret, state=NodeState.SUCCEEDED),
        "heartbeat": lambda: beat(job, node_id, 1.0, secret),
        "leave": lambda: job.leave(node_id, "forged", 1.0, secret),
        "round": lambda: job.next_round(node_id, 0, secret),
        "watch": lambda: job.watch(node_id, 1, secret),
    }


@pytest.mark.parametrize("sent", [None, "", "a-guess", "b"], ids=["none", "empty", "wrong", "another-nodes"])
def test_a_request_for_a_node_without_its_secret_is_refused_with_403_and_changes_nothing(
    sent: str | None,
) -> None:
    job = make_job()
    secrets = running(job)
    secret = secrets["b"] if sent == "b" else sent
    before = state(job)
    for what, request in refused_requests(job, "a", secret).items():
        with pytest.raises(BadNodeSecretError) as info:
            request()
        assert (http_status(info.value), info.value.code) == (403, "bad_node_secret"), what
        assert "node a" in str(info.value), what
        assert state(job) == before, f"a refused {what} changed the job"
    assert beat(job, "a", 1.0, secrets["a"]).command is Command.CONTINUE


def test_an_unknown_node_is_a_404_whatever_the_secret() -> None:
    job = make_job()
    running(job)
    for secret in (None, "whatever"):
        for what, request in refused_requests(job, "ghost", secret).items():
            with pytest.raises(UnknownNodeError):
                request()
            assert what


def test_a_finished_job_tells_its_outcome_to_anyone_but_hands_out_no_secret() -> None:
    job = make_job()
    secrets = running(job)
    for node_id in ("a", "b"):
        beat(job, node_id, 1.0, secrets[node_id], state=NodeState.SUCCEEDED)
    assert job.outcome is not None and job.outcome.succeeded
    assert job.join(join_req("a"), 2.0).node_secret == ""  # a late agent: no incarnation to start
    assert job.next_round("a", 0, None).status == "finished"
    assert job.watch("a", 1, None).command is Command.STOP
    with pytest.raises(BadNodeSecretError):
        beat(job, "a", 2.0, "a-guess")  # a report still needs the secret


# -- durable state ----------------------------------------------------------------------------------------
def test_credentials_survive_snapshot_and_restore_as_hashes() -> None:
    job = make_job()
    secrets = running(job)
    stored = json.loads(json.dumps(job.snapshot()))
    text = json.dumps(stored)
    for node_id, secret in secrets.items():
        assert secret not in text
        row = next(n for n in stored["nodes"] if n["node_id"] == node_id)
        assert row["secret_hash"] == hash_secret(secret) and re.fullmatch(r"[0-9a-f]{64}", row["secret_hash"])

    restored = Job.restore(job.settings, stored, now=100.0)  # a new master takes over, much later
    assert beat(restored, "a", 100.5, secrets["a"]).command is Command.CONTINUE
    with pytest.raises(BadNodeSecretError):
        beat(restored, "a", 100.5, secrets["b"])
    with pytest.raises(DuplicateNodeError):  # the live agents keep their ids through the takeover
        restored.join(join_req("b"), 100.5)
    assert restored.join(join_req("b"), 101.0, secrets["b"]).node_secret == secrets["b"]


def test_state_stored_without_hashes_accepts_no_secret() -> None:
    job = make_job()
    secrets = running(job)
    stored = json.loads(json.dumps(job.snapshot()))
    for row in stored["nodes"]:
        del row["secret_hash"]
    restored = Job.restore(job.settings, stored, now=10.0)
    with pytest.raises(BadNodeSecretError):
        beat(restored, "a", 10.5, secrets["a"])


# -- the agent's error table ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (403, "bad_node_secret", Disposition.FINAL),
        (409, "duplicate_node", Disposition.RETRY),
        (409, "wrong_job", Disposition.FINAL),
        (409, "settings_mismatch", Disposition.FINAL),
        (404, "unknown_node", Disposition.REJOIN),
        (401, "unauthorized", Disposition.FINAL),
        (413, "body_too_large", Disposition.FINAL),
        (422, "invalid_request", Disposition.FINAL),
        (503, "not_leader", Disposition.RETRY),
        (500, "anything", Disposition.RETRY),
        (429, "slow_down", Disposition.RETRY),
        (408, "timeout", Disposition.RETRY),
        (400, "anything", Disposition.FINAL),
    ],
)
def test_the_error_table_says_what_an_agent_does(status: int, code: str, expected: Disposition) -> None:
    assert disposition(status, code) is expected


def test_every_error_the_job_raises_is_in_the_error_table() -> None:
    from elastic.control.error_table import ERROR_TABLE
    from master.http.errors import HTTP_STATUS
    from master.job import errors as job_errors

    errors = [
        cls
        for cls in vars(job_errors).values()
        if isinstance(cls, type) and issubclass(cls, job_errors.JobError)
    ]
    assert len(errors) >= 5
    for cls in errors:
        assert cls in HTTP_STATUS, f"{cls.__name__} has no HTTP status (master/http/errors.py)"
        assert (HTTP_STATUS[cls], cls.code) in ERROR_TABLE, cls.__name__
