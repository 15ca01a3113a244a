"""Keyed wake-ups of pending long-polls (``master.service.waiting`` and the job's ``Effects.wake_only``).

A change that concerns one node (a waiting node removed, left, declared dead, excluded for flapping or
re-admitted) wakes that node's long-polls only; a change of the round (opened, closed) or the job's end
wakes every one. Every node whose ``/v1/round`` or ``/v1/watch`` answer changed must be woken, and the
number of tickets a single node's change sets does not grow with the node count (O(changes)).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import job_calls as calls
import pytest
from job_builders import HB_TIMEOUT, beat, join, join_req, make_job, running

from master.job.errors import NodeExcludedError
from master.job.events import Effects
from master.job.job import Job
from master.service.service import MasterService
from master.service.settings import ServerSettings
from master.service.waiting import Notifier

pytestmark = pytest.mark.timeout(30)

NODES = "abcde"


# -- the notifier -----------------------------------------------------------------------------------------
def test_a_keyed_ticket_is_set_by_its_key_or_by_everyone_a_keyless_one_by_any_notify():
    notifier = Notifier()
    a, b, anyone = notifier.ticket("a"), notifier.ticket("b"), notifier.ticket()
    assert notifier.ticket("a") is a, "the polls of one node share its ticket"
    notifier.notify(["a"])
    assert a.is_set() and not b.is_set() and anyone.is_set()
    fresh_a, anyone = notifier.ticket("a"), notifier.ticket()
    assert not fresh_a.is_set() and not anyone.is_set(), "a notify sets the tickets taken before it only"
    notifier.notify(["nobody"])
    assert not b.is_set() and not fresh_a.is_set() and anyone.is_set()
    notifier.notify()
    assert b.is_set() and fresh_a.is_set()


def test_a_poll_waiting_on_its_ticket_wakes_only_for_its_own_node():
    async def scenario() -> list[str]:
        notifier, woken = Notifier(), []

        async def poll(key: str) -> None:
            await notifier.ticket(key).wait()
            woken.append(key)

        polls = [asyncio.ensure_future(poll(key)) for key in ("a", "b", "c")]
        await asyncio.sleep(0)
        notifier.notify(["b"])
        await asyncio.sleep(0)
        first = list(woken)
        notifier.notify()
        await asyncio.gather(*polls)
        return first + woken

    assert asyncio.run(scenario()) == ["b", "b", "a", "c"]


# -- which long-polls a job's change wakes --------------------------------------------------------------
def answers(job: Job, node_id: str) -> list:
    """What the node's pending /v1/round (after each round) and /v1/watch (of each round) would answer."""
    out = []
    asks: list[Callable[[], object]] = [lambda r=r: calls.next_round(job, node_id, r) for r in range(6)]
    asks += [lambda r=r: calls.watch(job, node_id, r) for r in range(6)]
    for ask in asks:
        try:
            out.append(ask())
        except Exception as exc:  # noqa: BLE001 - the error is the answer
            out.append(type(exc).__name__)
    return out


def woken(effects: Effects, node_id: str) -> bool:
    return effects.wake and (effects.wake_only is None or node_id in effects.wake_only)


class Watcher:
    """Checks after each step that every node whose long-poll answers changed was woken."""

    def __init__(self, job: Job) -> None:
        self.job = job
        job.take_effects()

    def step(self, action: Callable[[], object], requester: str = "") -> Effects:
        before = {n: answers(self.job, n) for n in NODES if n != requester}
        action()
        effects = self.job.take_effects()
        for node_id, was in before.items():
            if answers(self.job, node_id) != was:
                assert woken(effects, node_id), (
                    f"{node_id}'s answers changed, but it was not woken: {effects}"
                )
        return effects


def flap_job() -> Job:
    return make_job(min_nodes=2, max_nodes=2, flap_limit=2, flap_window_s=60.0, flap_cooldown_s=20.0)


def restart_agent(job: Job, node_id: str, now: float) -> None:
    """A new agent for ``node_id`` after the previous one closed its connection (a REPLACE join)."""
    calls.connection_lost(job, node_id, now)
    calls.secrets_of(job)[node_id] = job.join(join_req(job, node_id), now, None).node_secret


def test_a_waiting_nodes_change_wakes_its_own_long_polls_and_a_round_change_wakes_all():
    job = flap_job()
    running(job, 0.0, "a", "b")
    watch = Watcher(job)
    assert not watch.step(lambda: join(job, 0.5, "c"), "c").wake, "a node that waits changes no answer"
    for at in (1.0, 2.0):
        assert watch.step(lambda at=at: restart_agent(job, "c", at), "c").wake_only == {"c"}

    def excluded() -> None:
        with pytest.raises(NodeExcludedError):
            restart_agent(job, "c", 3.0)

    assert watch.step(excluded, "c").wake_only == {"c"}, "its agent's polls answer 'exclude' now"
    assert watch.step(lambda: job.readmit("c", 3.5), "c").wake_only == {"c"}
    watch.step(lambda: join(job, 4.0, "d"), "d")
    assert watch.step(lambda: calls.leave(job, "d", "preempted", 4.5), "d").wake_only == {"d"}
    watch.step(lambda: join(job, 5.0, "e"), "e")
    for node_id in "ab":
        watch.step(lambda node_id=node_id: beat(job, node_id, 5.0 + HB_TIMEOUT))
    effects = watch.step(lambda: job.tick(5.0 + HB_TIMEOUT + 0.1))  # e went silent: declared dead
    assert effects.wake_only == {"e"} and "e" not in job.nodes
    # a and b went silent too, at once: the master suspects itself and holds (master.job.liveness)
    held = watch.step(lambda: job.tick(5.0 + 2 * HB_TIMEOUT + 0.2))
    assert [e.kind for e in held.events] == ["master_suspected"]
    effects = watch.step(lambda: job.tick(5.0 + 3 * HB_TIMEOUT + 0.3))  # then declares them dead
    assert effects.wake and effects.wake_only is None, "members lost: the round reopens for everyone"


# -- the service wakes that many tickets ------------------------------------------------------------------
def service_of(job: Job) -> MasterService:
    service = MasterService(ServerSettings(job=job.settings, token="t"))
    service.job = job
    return service


@pytest.mark.parametrize("nodes", [100, 2000])
def test_removing_a_waiting_node_sets_its_ticket_alone_at_any_size(nodes: int):
    job = make_job(min_nodes=2, max_nodes=nodes)
    members = [f"n{i:05d}" for i in range(nodes)]
    running(job, 0.0, *members)
    join(job, 0.0, "waiting")
    service = service_of(job)
    service.changed()  # what the joins did
    tickets = {n: service.notifier.ticket(n) for n in [*members, "waiting"]}

    calls.leave(job, "waiting", "preempted", 1.0)
    service.changed()
    assert [n for n, t in tickets.items() if t.is_set()] == ["waiting"]

    tickets = {n: service.notifier.ticket(n) for n in members}
    calls.leave(job, members[-1], "preempted", 2.0)  # a member: the round reopens
    service.changed()
    assert all(t.is_set() for t in tickets.values())


def test_a_notifier_entry_goes_with_its_last_ticket():
    """Polls of node ids that come and go (a churning job, or ids nobody joined) leave nothing behind."""
    notifier = Notifier()
    held = notifier.ticket("kept")
    for i in range(1000):
        notifier.ticket(f"gone-{i}")  # each poll drops its ticket when it ends
    assert set(notifier._keyed) == {"kept"}  # the bookkeeping under test
    assert held is notifier.ticket("kept")
