"""Step down before draining, supervised tasks and the stored state's schema version, in
process: a real :class:`master.service.service.MasterService` on its own event loop with an in-memory store
and a
fake clock. The same behaviours through real daemons and etcd: tests/e2e/test_master_stepdown_e2e.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from elastic.control.job_settings import JobSettings
from master.http.errors import http_status
from master.job.job import Job
from master.job.snapshot import (
    SCHEMA_KEY,
    SCHEMA_VERSION,
    UnreadableStateError,
    check_version,
    describe,
)
from master.service.fault_hook import InjectedFault, tick_fault_from_env
from master.service.service import MasterService, NotLeaderError
from master.service.settings import ServerSettings
from master.service.supervision import MasterFailure, Supervisor
from master.store.base import MemoryStore, StateFormatError

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings() -> ServerSettings:
    return ServerSettings(job=JobSettings(job_id="j", min_nodes=1, max_nodes=2), token="t")


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` on the loop, with a deadline."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


# -- the schema version ----------------------------------------------------------------------------------
def test_a_snapshot_carries_the_schema_version_and_restores():
    job = Job(JobSettings(job_id="j"), now=0.0)
    snapshot = job.snapshot()
    assert snapshot[SCHEMA_KEY] == SCHEMA_VERSION
    assert Job.restore(JobSettings(job_id="j"), snapshot, now=5.0).restart_count == 0
    del snapshot[SCHEMA_KEY]  # written before versioning: the layout of version 1
    Job.restore(JobSettings(job_id="j"), snapshot, now=5.0)


@pytest.mark.parametrize(
    "data, message",
    [
        ({SCHEMA_KEY: 2}, "its schema version 2 is not one this master reads (1 and older): run a newer"),
        ({SCHEMA_KEY: 0}, "its schema version 0 is not one this master reads (1 and older): it is too old"),
        ({SCHEMA_KEY: "1"}, "its schema version '1' is not an integer"),
        ({SCHEMA_KEY: True}, "its schema version True is not an integer"),
        ([1, 2], "it is a JSON list, not an object"),
    ],
)
def test_an_unknown_schema_version_is_refused_in_one_line(data, message):
    with pytest.raises(UnreadableStateError) as err:
        check_version(data)
    assert str(err.value).startswith(message)
    with pytest.raises(UnreadableStateError):
        Job.restore(JobSettings(job_id="j"), data, now=0.0)  # type: ignore[arg-type]


def test_restore_errors_are_described_in_one_line():
    assert describe(KeyError("rendezvous")) == "the field 'rendezvous' is missing"
    assert describe(TypeError("a\nb")) == "TypeError: a b"
    assert describe(UnreadableStateError("its schema version 9 ...")) == "its schema version 9 ..."


# -- the test hook ---------------------------------------------------------------------------------------
def test_tick_fault_hook_is_parsed_once_with_a_one_line_error():
    assert tick_fault_from_env({}) is None
    assert tick_fault_from_env({"ELASTIC_MASTER_TICK_FAULT_S": " 2.5 "}) == 2.5
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match="ELASTIC_MASTER_TICK_FAULT_S=.*expected a number of seconds"):
            tick_fault_from_env({"ELASTIC_MASTER_TICK_FAULT_S": bad})


# -- supervision -----------------------------------------------------------------------------------------
def test_the_first_failure_of_a_supervised_task_is_reported_once_with_its_traceback(caplog):
    failures: list[MasterFailure] = []

    async def main() -> None:
        supervisor = Supervisor(failures.append)

        async def boom() -> None:
            raise RuntimeError("tick broke")

        async def forever() -> None:
            await asyncio.Event().wait()

        quiet = supervisor.spawn(forever(), "persist")
        supervisor.spawn(boom(), "tick")
        supervisor.spawn(boom(), "tick")
        await until(lambda: failures, "a failure")
        quiet.cancel()  # a cancellation is no failure
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.ERROR, logger="master"):
        asyncio.run(main())
    assert [str(f) for f in failures] == [
        "the master's tick task crashed (RuntimeError: tick broke); see the traceback above"
    ]
    crashed = [r for r in caplog.records if "tick task crashed" in r.getMessage()]
    assert crashed and all(r.exc_info for r in crashed)


def test_an_unreadable_state_is_one_line_without_a_traceback(caplog):
    failures: list[MasterFailure] = []

    async def main() -> None:
        supervisor = Supervisor(failures.append)

        async def load() -> None:
            raise StateFormatError("cannot continue job j: its stored state (etcd key /k) is not JSON")

        supervisor.spawn(load(), "run")
        await until(lambda: failures, "a failure")

    with caplog.at_level(logging.ERROR, logger="master"):
        asyncio.run(main())
    assert [str(f) for f in failures] == ["cannot continue job j: its stored state (etcd key /k) is not JSON"]
    assert [r.exc_info for r in caplog.records if "not JSON" in r.getMessage()] == [None]


# -- the service -----------------------------------------------------------------------------------------
def test_step_down_answers_pending_long_polls_not_leader_stops_the_tick_and_closes_the_store():
    clock = FakeClock()
    closed: list[bool] = []

    class Store(MemoryStore):
        async def close(self) -> None:
            closed.append(True)

    async def main() -> None:
        service = MasterService(settings(), clock=clock, store=Store())
        service.start()
        await until(lambda: service.job is not None, "the service to lead")
        job = service.job
        # A long-poll that waits while this master leads (the probe raises 503 once it does not).
        poll = asyncio.ensure_future(service.long_poll(lambda: service.leading_job() and None, 30.0))
        await asyncio.sleep(0.05)
        assert not poll.done()
        await service.step_down()
        with pytest.raises(NotLeaderError) as err:
            await asyncio.wait_for(poll, 1.0)  # answered at once, not after its 30 s
        assert (http_status(err.value), err.value.code) == (503, "not_leader")
        assert service.job is None and closed == [True]
        # No tick after stepping down: a node that stops beating is never declared dead by this master.
        clock.now += 3600
        service.tick()
        assert "node_dead" not in [e.kind for e in job.events] and service.failure is None
        await service.step_down()  # idempotent
        assert closed == [True]

    asyncio.run(main())


def test_a_state_the_master_cannot_read_fails_the_master_with_one_line_naming_where_it_is():
    exited: list[bool] = []

    class Store(MemoryStore):
        async def load(self):
            return {SCHEMA_KEY: 1, "job_id": "j"}  # no rendezvous

    async def main() -> MasterService:
        service = MasterService(settings(), clock=FakeClock(), store=Store())
        service.on_failure = lambda: exited.append(True)
        service.start()
        await until(lambda: exited, "the service to exit")
        return service

    service = asyncio.run(main())
    assert str(service.failure) == (
        "cannot continue job j: its stored state (memory) cannot be read: the field 'rendezvous' is missing; "
        "fix or delete that key"
    )
    assert service.job is None


def test_a_failing_tick_fails_the_master_after_it_led_for_the_hook_s_seconds():
    clock = FakeClock()
    exited: list[bool] = []

    async def main() -> MasterService:
        service = MasterService(settings(), clock=clock, store=MemoryStore(), tick_fault_s=5.0)
        service.on_failure = lambda: exited.append(True)
        service.start()
        await until(lambda: service.job is not None, "the service to lead")
        await asyncio.sleep(0.3)  # ticks while the fake clock stands still: no failure
        assert not exited
        clock.now += 5.0
        await until(lambda: exited, "the service to exit")
        return service

    service = asyncio.run(main())
    assert str(service.failure).startswith("the master's tick task crashed (InjectedFault: ")
    with pytest.raises(InjectedFault):
        raise InjectedFault("the type is exported for tests and logs")
