"""Fakes and builders shared by the agent machine's tests (tests/unit/agent/test_agent_machine*.py)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest

from agent.machine import events as ev
from agent.machine.decisions import AgentMachine, AgentState, MachineConfig
from elastic.control.protocol import Assignment, Command, CommandReply, Outcome

MASTER_TIMEOUT = 30.0
STOP_GRACE = 5.0
#: The executor's answer for live workers that cannot leave their step: they are stopped.
NOT_KEPT = ev.WorkersProbed((0, 1), can_leave=False)
FAILED = Outcome(succeeded=False, exit_code=1, summary="rank 3 failed: boom")


@dataclass(frozen=True)
class FakeHang:
    """What a hang verdict (agent.observe.hang.Hang) carries, as the machine reads it."""

    reason: str = "no progress for 30.0s"
    stalled_s: float = 30.0
    local_rank: int = 0


def assignment(round_: int = 1, check: bool = False) -> Assignment:
    return Assignment(
        round=round_,
        node_rank=0,
        nnodes=2,
        rank_offset=0,
        world_size=4,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=round_ - 1,
        max_restarts=3,
        members=["a", "b"],
        check=check,
    )


def reply(command: Command, round_: int = 2, outcome: Outcome | None = None) -> CommandReply:
    return CommandReply(command=command, round=round_, outcome=outcome)


def kinds(actions: list[ev.Action]) -> list[type]:
    return [type(a) for a in actions]


def machine(**overrides: object) -> AgentMachine:
    values: dict = dict(
        nproc=2,
        master_timeout_s=MASTER_TIMEOUT,
        stop_grace_s=STOP_GRACE,
        hosts_master=False,
        ckpt_reset=False,
    )
    values.update(overrides)
    return AgentMachine(MachineConfig(**values))


def feed(m: AgentMachine, *events: ev.AgentEvent, now: float = 0.0) -> list[ev.Action]:
    """Feed ``events`` in order; the actions of the last one."""
    actions: list[ev.Action] = []
    for event in events:
        actions = m.handle(event, now)
    return actions


def training(m: AgentMachine, round_: int = 1) -> AgentMachine:
    feed(m, ev.Started(0.0), ev.Joined(round_, "m1"), ev.RoundAssigned(assignment(round_)))
    assert m.state is AgentState.TRAINING
    return m


def paused(m: AgentMachine, now: float = 1.0) -> AgentMachine:
    """A machine whose two training workers paused (at ``now``) when round 2 opened; it joined round 2."""
    training(m)
    feed(m, ev.CommandReceived(reply(Command.REJOIN, 2)), now=now)
    feed(m, ev.WorkersProbed((0, 1), can_leave=True), ev.Joined(2, "m1"), now=now)
    assert m.state is AgentState.WAITING_ROUND and m.pause is not None
    return m


def checking(m: AgentMachine) -> AgentMachine:
    feed(m, ev.Started(0.0), ev.Joined(1, "m1"), ev.RoundAssigned(assignment(1, check=True)))
    assert m.state is AgentState.CHECKING
    return m


@pytest.fixture
def no_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any thread, process, socket or sleep started by the machine fails the test."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the agent machine must not do I/O")

    monkeypatch.setattr(threading.Thread, "start", forbidden)
    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    monkeypatch.setattr(socket.socket, "__init__", forbidden)
    monkeypatch.setattr(time, "sleep", forbidden)
