"""A stall of the master's own loop (CPU starved, a long collection, the process stopped) is no reason to
declare nodes dead: heartbeats waited unread in its sockets meanwhile. The tick sees the gap, extends
every heartbeat age by it, and records a ``master_stalled`` event; a node that stays silent after the
stall is still declared dead one timeout later."""

from __future__ import annotations

from job_builders import HB_TIMEOUT, beat, make_job, running

from master.service.service import STALL_S, MasterService
from master.service.settings import ServerSettings


def leading_service(clock: list[float]) -> MasterService:
    job = make_job(min_nodes=2, max_nodes=2)
    service = MasterService(ServerSettings(job=job.settings, token="t"), clock=lambda: clock[0])
    service.job = job
    assert service.store.leading, "a memory store leads at once"
    return service


def test_a_stall_of_the_master_is_not_held_against_the_nodes() -> None:
    clock = [100.0]
    service = leading_service(clock)
    job = service.job
    running(job, clock[0], "a", "b")
    service.tick()
    clock[0] += HB_TIMEOUT * 3  # the loop stalled: no tick, no heartbeat read
    service.tick()
    assert set(job.nodes) == {"a", "b"}, "no verdict for heartbeats that waited unread"
    assert [e.kind for e in job.events].count("master_stalled") == 1
    resumed = clock[0]
    while clock[0] < resumed + HB_TIMEOUT + 0.5:  # ticks at their pace again; b stays silent
        clock[0] += STALL_S / 2
        beat(job, "a", clock[0])
        service.tick()
    assert "b" not in job.nodes and "a" in job.nodes, "silence after the stall still counts"
    assert [e.kind for e in job.events].count("master_stalled") == 1
    dead = next(e for e in job.events if e.kind == "node_dead")
    assert dead.durations["detect"] > HB_TIMEOUT * 4, "its true silence, the stall included"


def test_ticks_at_their_pace_excuse_nothing() -> None:
    clock = [100.0]
    service = leading_service(clock)
    job = service.job
    running(job, clock[0], "a", "b")
    while clock[0] < 100.0 + HB_TIMEOUT + 0.5:
        clock[0] += STALL_S / 2
        beat(job, "a", clock[0])
        service.tick()
    assert "b" not in job.nodes and "a" in job.nodes
    assert "master_stalled" not in [e.kind for e in job.events]
