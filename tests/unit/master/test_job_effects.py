"""Unit tests of the job's effects (``master.job.events.Effects``) and of round identity ``(term, number)``.

A mutation's effects tell the server what to do: which events to log, whether durable state changed (the
store must hold it before a reply reveals it: write-ahead) and whether pending long-polls must be woken.
The server no longer diffs counters, so these tests pin the effects against what they replace.
"""

from __future__ import annotations

import job_calls as calls
import pytest
from job_builders import beat, crash, join, make_job, running

from elastic.control.protocol import Command, HeartbeatRequest, NodeState, WorkerProgress
from master.job.events import Effects
from master.job.job import Job

pytestmark = pytest.mark.timeout(10)


class Recorder:
    """Drains a job's effects after every step and checks them against the job's counters, and a wake-up
    against the long-polls' answers (each node's pending ``/v1/round`` and ``/v1/watch``)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        job.take_effects()  # the job_started event of the constructor
        self.answers = answers(job)
        self.version = job.version
        self.event_count = job.event_count

    def step(self) -> Effects:
        job = self.job
        effects = job.take_effects()
        fresh = job.event_count - self.event_count
        assert [e.seq for e in effects.events] == list(range(self.event_count + 1, job.event_count + 1))
        assert len(effects.events) == fresh
        assert effects.persist == (job.version != self.version), "persist iff durable state changed"
        assert effects.version == job.version
        now = answers(job)
        woken = set() if not effects.wake else set(now) if effects.wake_only is None else effects.wake_only
        for node, answer in now.items():
            if node not in woken and node in self.answers:
                assert answer == self.answers[node], f"node {node}'s answer changed without a wake-up"
        self.answers, self.version, self.event_count = now, job.version, job.event_count
        return effects


def answers(job: Job) -> dict[str, list]:
    """What each known node's long-polls (a round after each round so far, a watch of each round) would
    answer now, as the kind of answer; an error's class name stands for the error."""
    out: dict[str, list] = {}
    for node_id in job.nodes:
        secret = calls.secrets_of(job).get(node_id)
        replies: list = []
        for r in range(job.round + 1):
            for call in (job.next_round, job.watch):
                try:
                    reply = call(node_id, r, secret)
                except Exception as exc:  # noqa: BLE001 - the error is the answer
                    replies.append(type(exc).__name__)
                    continue
                # What a poll waits for: a reply at all (a round), another command (a watch). The figures in
                # a reply (the committed step...) are read when it is sent, not a reason to wake a poll.
                replies.append(getattr(reply, "status", None) or getattr(reply, "command", None))
        out[node_id] = replies
    return out


def test_every_change_of_a_long_poll_answer_wakes_and_every_durable_change_persists():
    job = make_job(min_nodes=2, max_nodes=3, max_restarts=3)
    rec = Recorder(job)
    join(job, 0.0, "a")
    first = rec.step()
    assert first.persist and not first.wake, "a waiting join is stored but wakes nobody"
    join(job, 0.1, "b")
    rec.step()
    job.tick(LAST := 2.5)
    closed = rec.step()
    assert closed.wake and closed.persist and "round_closed" in [e.kind for e in closed.events]
    for node in "ab":
        beat(job, node, LAST)
    rec.step()
    beat(job, "a", 3.0, state=NodeState.FAILED, failure=crash())
    failed = rec.step()
    assert failed.wake and [e.kind for e in failed.events] == ["worker_failed", "round_opened"]
    join(job, 3.1, "a", "b")
    rec.step()
    job.tick(3.2)
    rec.step()
    join(job, 4.0, "c")
    rec.step()
    job.tick(20.0)  # growth admits c, then a and b die (no heartbeats): removals wake
    rec.step()
    job.tick(40.0)
    rec.step()


def test_steady_heartbeats_and_checkpoint_progress_change_no_durable_state():
    job = make_job()
    running(job, 0.0, "a", "b")
    rec = Recorder(job)
    for step in range(1, 20):
        now = step * 0.5
        for node in "ab":
            workers = [WorkerProgress(local_rank=r, step=step, step_time_s=0.1) for r in (0, 1)]
            req = HeartbeatRequest(
                node_id=node, round=job.rdzv.round, state=NodeState.RUNNING, workers=workers, ckpt_step=step
            )
            assert calls.heartbeat(job, req, now).command is Command.CONTINUE
        job.tick(now)
        effects = rec.step()
        assert not effects.persist and not effects.wake and not effects.events, effects
    assert job.committed_step == 19, "the committed step still advances (soft state)"


def test_restored_job_reports_only_the_takeover_as_new():
    job = make_job()
    running(job, 0.0, "a", "b")
    again = Job.restore(job.settings, job.snapshot(), 1.0, "m2", term=7)
    effects = again.take_effects()
    assert [e.kind for e in effects.events] == ["master_takeover"]
    assert effects.events[0].data["term"] == 7 and "term 7" in effects.events[0].message
    assert effects.persist, "the takeover event is stored"


# -- round identity (term, number) ----------------------------------------------------------------
def test_a_round_carries_the_term_it_was_closed_in_and_keeps_it_across_a_takeover():
    job = make_job()
    job.term = 3
    running(job, 0.0, "a", "b")
    assert job.round_term == 3
    assignment = calls.next_round(job, "a", 0).assignment
    assert (assignment.term, assignment.round) == (3, 1)

    again = calls.restored(job, Job.restore(job.settings, job.snapshot(), 1.0, "m2", term=9))
    assert again.round_term == 3, "a taken-over round keeps its identity: nothing restarts"
    reply = calls.heartbeat(
        again, HeartbeatRequest(node_id="a", round=1, term=3, state=NodeState.RUNNING), 1.0
    )
    assert reply.command is Command.CONTINUE and reply.term == 3


def test_the_same_round_number_under_another_term_is_another_world():
    """A leader that never stored round 2 (write-ahead failed) and its successor's own round 2 differ."""
    job = make_job()
    job.term = 5
    running(job, 0.0, "a", "b")
    req = HeartbeatRequest(node_id="a", round=1, term=4, state=NodeState.RUNNING)
    assert calls.heartbeat(job, req, 0.5).command is Command.REJOIN
    assert calls.heartbeat(job, req.model_copy(update={"term": 5}), 0.5).command is Command.CONTINUE
    assert job.watch("a", 1, calls.secrets_of(job)["a"], 4).command is Command.REJOIN
    assert job.watch("a", 1, calls.secrets_of(job)["a"], 5).command is Command.CONTINUE


def test_a_failure_report_from_another_terms_round_is_not_charged():
    job = make_job()
    job.term = 2
    running(job, 0.0, "a", "b")
    req = HeartbeatRequest(node_id="a", round=1, term=1, state=NodeState.FAILED, failure=crash())
    assert calls.heartbeat(job, req, 0.5).command is Command.REJOIN
    assert job.restart_count == 0 and "worker_failed" not in [e.kind for e in job.events]


def test_agents_without_terms_compare_round_numbers_only():
    job = make_job()
    job.term = 8
    running(job, 0.0, "a", "b")
    req = HeartbeatRequest(node_id="a", round=1, state=NodeState.RUNNING)
    assert req.term is None
    assert calls.heartbeat(job, req, 0.5).command is Command.CONTINUE
    assert calls.watch(job, "a", 1).command is Command.CONTINUE


def test_a_round_closed_by_a_new_leader_gets_the_new_term():
    job = make_job(max_restarts=3)
    job.term = 1
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=crash())
    again = calls.restored(job, Job.restore(job.settings, job.snapshot(), 1.5, "m2", term=4))
    join(again, 1.6, "a", "b")
    again.tick(1.7)
    assignment = calls.next_round(again, "a", 1).assignment
    assert (assignment.term, assignment.round) == (4, 2)


def test_a_round_forming_at_a_takeover_still_waits_for_the_previous_members_still_known():
    """The expected members of a forming round are not stored (they would rewrite every member's id at every
    change): a master taking over derives them from the previous round's members it still knows."""
    job = make_job(min_nodes=1, max_nodes=3, max_restarts=3)
    running(job, 0.0, "a", "b", "c")
    beat(job, "a", 1.0)
    beat(job, "b", 1.0)
    beat(job, "c", 1.0, state=NodeState.FAILED, failure=crash())  # round 2 opens, expecting a, b and c
    calls.leave(job, "c", "preempted", 1.1)  # c is gone for good
    assert "expected" not in job.snapshot()["rendezvous"]
    again = calls.restored(job, Job.restore(job.settings, job.snapshot(), 1.2, "m2", term=2))
    join(again, 1.3, "a")
    reason = again.rdzv.decide(1.4).reason
    assert "waiting for member b to rejoin" in reason, reason
    join(again, 1.5, "b")
    again.tick(1.6)
    assignment = calls.next_round(again, "a", 1).assignment
    assert assignment is not None and assignment.members == ["a", "b"], "every member still known came back"
