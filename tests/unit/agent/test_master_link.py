"""The executor's one retry loop (agent.executor.master_link.MasterLink.poll) with a fake client and a fake
clock: which errors retry and which end a poll comes from the error table (elastic.control.error_table);
delays, deadlines and what a final error does come from the poll's policy. No sleep, no socket."""

from __future__ import annotations

import pytest
from master_link_fakes import INTERVAL, MASTER_TIMEOUT, FakeClient, FakeClock, link_for, thread_policy

from agent.executor.heartbeats import HeartbeatThread
from agent.executor.master_link import LEAVE_TAKEOVER_WAIT_S, CallFailed, MasterLink
from agent.executor.node_view import NodeView
from agent.machine import events as ev
from elastic.control.client import MasterError, MasterRejectedError, MasterUnreachableError, NoLeaderError
from elastic.control.protocol import Command, CommandReply, NodeState

pytestmark = pytest.mark.timeout(10)

REPLY = CommandReply(command=Command.CONTINUE, round=1)
NO_ANSWER = MasterUnreachableError("no job master answered at m:1")
DUPLICATE = MasterRejectedError(409, "duplicate_node", "node a is held by a live agent")
UNKNOWN = MasterRejectedError(404, "unknown_node", "unknown node a")
UNAUTHORIZED = MasterRejectedError(401, "unauthorized", "wrong token")


def first_answer(reply: CommandReply) -> CommandReply:
    return reply


# -- calls the main thread waits for (a deadline: --master-timeout) -------------------------------------
def test_a_call_retries_an_unanswered_master_with_backoff_until_it_answers() -> None:
    clock = FakeClock()
    link, posted = link_for(FakeClient(NO_ANSWER, NO_ANSWER, REPLY), clock)
    assert link.call(link.client.next, "join") == REPLY
    assert len(clock.waits) == 2
    assert 0.05 <= clock.waits[0] <= 0.1 and 0.1 <= clock.waits[1] <= 0.2, "doubling, jittered"
    assert link.last_contact == clock.now and posted == []


def test_a_call_gives_up_when_no_master_answered_for_the_master_timeout() -> None:
    clock = FakeClock()
    link, _ = link_for(FakeClient(NO_ANSWER), clock)
    with pytest.raises(CallFailed) as failed:
        link.call(link.client.next, "join")
    event = failed.value.event
    assert isinstance(event, ev.MasterUnreachable) and event.silent_s > MASTER_TIMEOUT
    assert max(clock.waits) <= 2.0, "the backoff's cap"


def test_a_refusal_the_table_retries_is_retried_until_the_master_timeout_then_rejected() -> None:
    clock = FakeClock()
    link, _ = link_for(FakeClient(DUPLICATE), clock)
    with pytest.raises(CallFailed) as failed:
        link.call(link.client.next, "join")
    event = failed.value.event
    assert isinstance(event, ev.Rejected) and event.exit_code == 2  # 409: a configuration problem
    assert event.message.startswith("master refused the join for ") and "node a is held" in event.message
    assert sum(clock.waits) > MASTER_TIMEOUT


@pytest.mark.parametrize(
    ("refusal", "expected"),
    [
        (UNKNOWN, ev.NodeUnknown("unknown node a")),
        (UNAUTHORIZED, ev.Rejected("master rejected the join: wrong token", 2)),
        (MasterRejectedError(400, "job_error", "no"), ev.Rejected("master rejected the join: no", 1)),
    ],
    ids=["rejoin", "final-config", "final"],
)
def test_a_refusal_the_table_does_not_retry_ends_a_call_at_once(
    refusal: MasterRejectedError, expected: ev.AgentEvent
) -> None:
    clock = FakeClock()
    link, _ = link_for(FakeClient(refusal), clock)
    with pytest.raises(CallFailed) as failed:
        link.call(link.client.next, "join")
    assert failed.value.event == expected and clock.waits == []


def test_a_final_refusal_a_thread_got_fails_the_next_call_without_calling() -> None:
    client = FakeClient(REPLY)
    link, _ = link_for(client, FakeClock())
    link.final_refusal = ev.Rejected("master rejected the heartbeat: node id taken", 2)
    with pytest.raises(CallFailed) as failed:
        link.call(client.next, "join")
    assert failed.value.event is link.final_refusal and client.calls == 0


def test_an_error_that_is_no_missing_answer_is_not_retried_by_a_call() -> None:
    link, _ = link_for(FakeClient(MasterError("unexpected reply from master at m:1")), FakeClock())
    with pytest.raises(MasterError, match="unexpected reply"):
        link.call(link.client.next, "join")


# -- threads (no deadline: the machine judges the silence) --------------------------------------------
def test_a_thread_posts_each_missing_answer_and_returns_what_it_makes_of_an_answer() -> None:
    clock = FakeClock()
    waiting, done = (
        CommandReply(command=Command.CONTINUE, round=1),
        CommandReply(command=Command.REJOIN, round=2),
    )
    link, posted = link_for(FakeClient(NO_ANSWER, NO_ANSWER, waiting, done), clock)

    def answered(reply: CommandReply) -> ev.AgentEvent | None:
        return None if reply.command is Command.CONTINUE else ev.CommandReceived(reply, generation=3)

    result = link.poll(link.client.next, thread_policy(), answered, generation=lambda: 3)
    assert result == ev.CommandReceived(done, generation=3)
    assert [type(e) for e in posted] == [ev.MasterUnreachable, ev.MasterUnreachable]
    assert all(e.generation == 3 for e in posted)
    assert posted[1].silent_s > posted[0].silent_s, "the silence since the last answer grows"


def test_a_thread_posts_a_final_refusal_remembers_it_and_ends() -> None:
    link, posted = link_for(FakeClient(UNAUTHORIZED), FakeClock())
    assert link.poll(link.client.next, thread_policy(), first_answer) is None
    assert posted == [ev.Rejected("master rejected the rendezvous: wrong token", 2)]
    assert link.final_refusal == posted[0]


def test_a_threads_rejoin_refusal_is_posted_with_its_generation() -> None:
    link, posted = link_for(FakeClient(UNKNOWN), FakeClock())
    assert link.poll(link.client.next, thread_policy(), first_answer, generation=lambda: 5) is None
    assert posted == [ev.NodeUnknown("unknown node a", generation=5)] and link.final_refusal is None


@pytest.mark.parametrize(("report", "wait"), [(True, None), (False, INTERVAL)], ids=["reported", "quiet"])
def test_a_retried_refusal_waits_and_is_reported_as_the_policy_says(report: bool, wait: float | None) -> None:
    clock = FakeClock()
    link, posted = link_for(FakeClient(DUPLICATE, REPLY), clock)
    policy = thread_policy(report_refusals=report, refused_wait_s=wait)
    assert link.poll(link.client.next, policy, first_answer) == REPLY
    assert [type(e) for e in posted] == ([ev.MasterUnreachable] if report else [])
    assert clock.waits == [INTERVAL] if wait else 0.05 <= clock.waits[0] <= 0.1


def test_a_poll_ends_when_it_is_no_longer_wanted_or_the_agent_closes() -> None:
    client = FakeClient(NO_ANSWER)
    link, _ = link_for(client, FakeClock())
    assert link.poll(client.next, thread_policy(), first_answer, wanted=lambda: client.calls < 2) is None
    assert client.calls == 2
    clock = FakeClock(close_after=1)
    link, _ = link_for(FakeClient(NO_ANSWER), clock)
    assert link.poll(link.client.next, thread_policy(), first_answer) is None
    assert link.client.calls == 1 and len(clock.waits) == 1


# -- the heartbeat (a period, and it beats on after a refusal) -----------------------------------------
def heartbeat(link: MasterLink, posted: list[ev.AgentEvent], state: NodeState) -> HeartbeatThread:
    return HeartbeatThread(
        link,
        lambda: object(),  # type: ignore[arg-type, return-value] - the fake client ignores it
        lambda: NodeView(state=state),
        None,
        posted.append,
        lambda: 9,
        call_timeout=1.0,
    )


def test_the_heartbeat_beats_every_interval_and_beats_on_after_refusals() -> None:
    clock = FakeClock(close_after=6)
    stop = CommandReply(command=Command.STOP, round=1)
    client = FakeClient(REPLY, UNKNOWN, NO_ANSWER, UNAUTHORIZED, stop)
    link, posted = link_for(client, clock)
    heartbeat(link, posted, NodeState.RUNNING).run()
    assert client.calls == 5, "one beat per wait until the agent closes"
    assert clock.waits[:2] == [INTERVAL, INTERVAL] and INTERVAL / 2 <= clock.waits[3] <= INTERVAL
    assert posted[0] == ev.NodeUnknown("unknown node a", generation=9)
    assert isinstance(posted[1], ev.MasterUnreachable) and posted[1].generation == 9
    assert posted[2] == ev.Rejected("master rejected the heartbeat: wrong token", 2) == link.final_refusal
    assert posted[3] == ev.CommandReceived(stop, generation=9)


def test_a_waiting_node_is_not_told_to_rejoin_by_its_heartbeat_and_sends_none_before_joining() -> None:
    clock = FakeClock(close_after=3)
    client = FakeClient(UNKNOWN)
    link, posted = link_for(client, clock)
    heartbeat(link, posted, NodeState.WAITING).run()
    assert client.calls == 2 and posted == []
    last_contact = link.last_contact
    client.joined = False
    heartbeat(link, posted, NodeState.WAITING).run()
    assert client.calls == 2 and link.last_contact == last_contact, "no call, so no answer counted"


# -- a leaving node (SIGTERM, pre-emption) ---------------------------------------------------------------
STANDBYS = NoLeaderError({"m:1": "503 not_leader", "m:2": "503 not_leader"})
ABSENT = NoLeaderError({"m:1": "no answer (ConnectError)", "m:2": "503 not_leader"})


def test_a_leave_waits_out_a_takeover_so_the_new_leader_learns_it_at_once() -> None:
    # Every master stands by (etcd paused, a takeover under way): the leave reaches the next leader, which
    # changes the membership at once instead of declaring the node dead a heartbeat timeout later.
    client, clock = FakeClient(STANDBYS, STANDBYS, REPLY), FakeClock()
    link, _ = link_for(client, clock)
    link.leave(client.next)
    assert client.calls == 3 and len(clock.waits) == 2


def test_a_leave_is_not_retried_when_a_master_is_absent_or_the_takeover_lasts_too_long() -> None:
    client, clock = FakeClient(ABSENT, REPLY), FakeClock()
    link, _ = link_for(client, clock)
    with pytest.raises(NoLeaderError):
        link.leave(client.next)
    assert client.calls == 1 and clock.waits == [], "no master at an address: the node exits now"

    client, clock = FakeClient(STANDBYS), FakeClock()
    link, _ = link_for(client, clock)
    with pytest.raises(NoLeaderError):
        link.leave(client.next)
    assert sum(clock.waits) == pytest.approx(LEAVE_TAKEOVER_WAIT_S), (
        "bounded: the node's exit waits no longer"
    )
