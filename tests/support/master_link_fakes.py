"""Fakes for the executor's retry loop (agent.executor.master_link.MasterLink) in unit tests: a client that
answers from a script, a clock that moves only when the poll waits, and the link and policy built on them."""

from __future__ import annotations

import threading
from typing import Any

from agent.executor.master_link import MasterLink, PollPolicy
from agent.executor.tls_trouble import TLSTrouble
from agent.machine import events as ev
from agent.observe.events import EventLog
from agent.settings import AgentSettings
from elastic.control.job_settings import JobSettings

MASTER_TIMEOUT = 30.0
INTERVAL = 4.0  # the heartbeat interval


class FakeClock:
    """Time moves only when the poll waits; ``close_after`` waits, the agent closes."""

    def __init__(self, close_after: int | None = None) -> None:
        self.now = 100.0
        self.waits: list[float] = []
        self.close_after = close_after

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return self.close_after is not None and len(self.waits) >= self.close_after


class FakeClient:
    """Answers each call with the next scripted outcome (an exception is raised); the last one repeats."""

    addresses = ["m:1"]

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0
        self.joined = True

    def next(self) -> Any:
        self.calls += 1
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def has_joined(self, node_id: str) -> bool:
        return self.joined

    def heartbeat(self, req: object, timeout: float | None = None) -> Any:
        return self.next()


def link_for(client: FakeClient, clock: FakeClock) -> tuple[MasterLink, list[ev.AgentEvent]]:
    posted: list[ev.AgentEvent] = []
    settings = AgentSettings(
        argv=("train.py",),
        nproc=1,
        job=JobSettings(job_id="j", heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=3 * INTERVAL),
        token="t",
        node_id="a",
        master_timeout_s=MASTER_TIMEOUT,
    )
    link = MasterLink(
        settings, client, TLSTrouble(EventLog()), posted.append, lambda: 7, threading.Event(), clock
    )  # type: ignore[arg-type] - a fake client
    return link, posted


def thread_policy(**overrides: Any) -> PollPolicy:
    """A long-poll thread's policy: no deadline (failures are posted), ends on a final error."""
    values: dict[str, Any] = dict(what="rendezvous", backoff=(0.1, 1.0))
    values.update(overrides)
    return PollPolicy(**values)
