"""etcd in trouble while a job trains: real etcd, two real ``elastic-master`` daemons on
it, real ``elastic-run`` agents as fake nodes (``--nproc-per-node 1``) and real gloo workers.

* etcd frozen (SIGSTOP) for 5 s after a third node's join request reached the leader and before its
  reply, and again while the round that admits that node closes: no reply reveals a state etcd does not
  hold, so after recovery every round ``(term, number)`` an agent was assigned exists on the leader with
  the same member list, no ``(term, number)`` has two member lists, and the job succeeds;
* etcd frozen for longer than the leader's lease (3 s): the leader steps down, no master answers as the
  leader meanwhile, the workers train on; once etcd is back a leader is elected and the job finishes with
  the same worker processes, no restart and no new round.

A frozen etcd is the hard case of "etcd unreachable": connections stay open and requests are never
answered (tests/e2e/test_master_failover_e2e.py covers a killed etcd, whose connections are refused). The
helpers and short heartbeat settings are those of that module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import e2e
import pytest
from e2e import Proc, free_port, train_args, wait_until
from etcd_server import EtcdServer
from failover_cluster import (
    HEARTBEAT_TIMEOUT_S,
    START_S,
    Job,
    assert_no_false_verdicts,
    assert_uninterrupted_training,
    rank0_agent,
    starts,
    steps_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
launch = e2e.launch

#: How long etcd stays frozen in the first test (the issue's stall).
STALL_S = 5.0
#: The etcd lease of the leader key (master.store.etcd_store.EtcdStore's default TTL; no CLI option sets it).
LEASE_TTL_S = 3.0
#: The second test's outage: well past the lease, so that it has expired in etcd when etcd resumes.
OUTAGE_S = 4 * LEASE_TTL_S
#: A leader that cannot renew its lease steps down after 2/3 of the TTL; slack for a loaded machine.
STEP_DOWN_LIMIT_S = LEASE_TTL_S + 7.0

#: ``round N: node rank R of K, ..., term T`` (agent/executor/loop.py, one line per assignment).
ASSIGNED = re.compile(r"round (\d+): node rank (\d+) of (\d+), .*, term (\d+)$", re.M)
#: The leader's ``round_closed`` event (master/job/job.py).
CLOSED = re.compile(r"^round (\d+) closed: \d+ nodes, world size \d+, members (.*?) \(term (\d+)\)")

Round = tuple[int, int]  # (term, number)


# -- helpers ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def frozen(etcd: EtcdServer) -> Iterator[None]:
    """etcd SIGSTOPped (by the PID the fixture started) for the block; SIGCONT afterwards, always."""
    assert etcd.proc is not None and etcd.running
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)


class JoinGate:
    """A TCP relay placed first in one agent's master list: it passes every request through to the
    master ``target()`` names, except the first join (a ``POST /v1/join``, or a ``join`` frame on the agent
    stream), which it holds until :meth:`release`. So the test can act (freeze etcd) after the join was
    sent and before the master receives it, then let it through to a leader that still leads but can no
    longer store anything. :attr:`reply_status`: the status the master answered the held join with."""

    def __init__(self, target: Callable[[], str]) -> None:
        self.target = target
        self.seen = threading.Event()  # the join request arrived and is held
        self.reply = threading.Event()  # the master answered the held join: its status line in reply_line
        self.reply_line = b""
        self.reply_status = 0
        self._released = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._sockets.append(client)
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        held_here = threading.Event()  # the held join went over this connection: its reply comes next

        def hold(request: bytes) -> None:  # each chunk the agent sends (requests share a connection)
            joining = request.startswith(b"POST /v1/join") or b'"op":"join"' in request
            if joining and not self.seen.is_set():
                held_here.set()
                self.seen.set()
                self._released.wait()

        def note_reply(answer: bytes) -> None:
            if held_here.is_set() and not self.reply.is_set():
                self.reply_line = answer.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
                self.reply_status = _status_of(self.reply_line)
                self.reply.set()

        with contextlib.suppress(OSError):
            host, port = self.target().rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            self._sockets.append(upstream)
            threading.Thread(target=_pipe, args=(upstream, client, note_reply), daemon=True).start()
            _pipe(client, upstream, hold)


def _status_of(line: bytes) -> int:
    """The status of an HTTP status line, or of an agent-stream reply frame (``{"id":..,"status":..}``)."""
    if line.startswith(b"HTTP/"):
        return int(line.split()[1])
    return int(json.loads(line)["status"])


def _pipe(src: socket.socket, dst: socket.socket, hook: Callable[[bytes], None] | None = None) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            if hook is not None:
                hook(data)
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def two_masters(job: Job, *extra: str) -> tuple[list[Proc], list[str]]:
    ports = [free_port(), free_port()]
    masters = [job.master(p, f"master-{i}", *extra) for i, p in enumerate(ports)]
    return masters, [f"127.0.0.1:{p}" for p in ports]


def leader_of(job: Job, addresses: list[str], timeout: float = START_S) -> str:
    """The address of the one master that leads (the other answers 503)."""
    wait_until(lambda: sorted(job.info(a) for a in addresses) == [200, 503], timeout, "exactly one leader")
    return next(a for a in addresses if job.info(a) == 200)


def assigned_rounds(agents: dict[str, Proc]) -> dict[Round, dict[str, tuple[int, int]]]:
    """``(term, number) -> {node id: (node rank, nnodes)}`` from every assignment the agents logged."""
    rounds: dict[Round, dict[str, tuple[int, int]]] = {}
    for node_id, agent in agents.items():
        for number, rank, nnodes, term in ASSIGNED.findall(agent.output()):
            seen = rounds.setdefault((int(term), int(number)), {})
            assert seen.get(node_id, (int(rank), int(nnodes))) == (int(rank), int(nnodes)), (
                f"{node_id} was given two places in round {number} of term {term}"
            )
            seen[node_id] = (int(rank), int(nnodes))
    return rounds


def members_of(assigned: dict[str, tuple[int, int]]) -> list[str]:
    """The member list (node ids in rank order) that one round's assignments describe; fails when they
    describe two (a rank given to two nodes, or two node counts)."""
    counts = {nnodes for _, nnodes in assigned.values()}
    assert len(counts) == 1, f"two node counts in one round: {assigned}"
    by_rank: dict[int, str] = {}
    for node_id, (rank, _) in assigned.items():
        assert rank not in by_rank, f"node rank {rank} given to {by_rank[rank]} and {node_id}: {assigned}"
        by_rank[rank] = node_id
    return [by_rank[r] for r in sorted(by_rank)]


def leader_rounds(events: list[dict]) -> dict[Round, list[str]]:
    """``(term, number) -> members`` of every ``round_closed`` event among ``events`` (records of the event
    log, or ``/v1/status`` events); fails when one ``(term, number)`` closed with two member lists."""
    rounds: dict[Round, list[str]] = {}
    for event in events:
        if event["kind"] != "round_closed":
            continue
        match = CLOSED.match(event["message"])
        assert match, event["message"]
        key = (int(match.group(3)), int(match.group(1)))
        members = match.group(2).split(", ")
        assert rounds.get(key, members) == members, f"{key} closed twice: {rounds[key]}, {members}"
        rounds[key] = members
    return rounds


def event_log(path: Path) -> list[dict]:
    """The records of the masters' shared ``--event-log`` (written by each leader, only once stored)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_one_world_per_round(agents: dict[str, Proc], status: dict, stored: list[dict]) -> None:
    """Every ``(term, number)`` an agent was assigned exists on the leader with the same member list, and no
    ``(term, number)`` maps to two member lists. The leader's rounds: its ``/v1/status`` (the current round
    and the newest events) and, for the older ones, the event log the leaders wrote from stored state."""
    ours = leader_rounds(stored)
    assert leader_rounds(status["events"]).items() <= ours.items(), (status["events"], ours)
    for key, assigned in assigned_rounds(agents).items():
        members = members_of(assigned)
        assert key in ours, f"agents hold round {key} ({members}), which the leader does not have: {ours}"
        for node_id, (rank, nnodes) in assigned.items():
            assert (ours[key][rank], len(ours[key])) == (node_id, nnodes), (key, assigned, ours[key])
    assert any(n == status["round"] for _, n in ours), (status["round"], ours)


# -- 1 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(540)
def test_etcd_stalls_during_a_join_and_a_round_close_no_agent_holds_a_round_the_leader_lacks(
    launch, tmp_path, etcd_server
):
    job = Job(launch, tmp_path, "2:3", f"etcd://{etcd_server.endpoint}")
    events = tmp_path / "events.jsonl"  # one file for both masters: each leader continues it
    masters, addresses = two_masters(job, "--event-log", str(events))
    leader = leader_of(job, addresses)

    steps = 400  # outlasts both stalls; rank 0 of the last round trains to the end
    script = train_args(steps=steps, step_time=0.1)
    agents = {f"node-{i}": job.agent(f"node-{i}", addresses, script) for i in range(2)}
    rank0 = rank0_agent(list(agents.values()))
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)

    # Stall 1: the third node's join reaches the leader while etcd is frozen; its reply waits for a
    # store that never answers, and the leader steps down instead of acknowledging it.
    gate = JoinGate(lambda: leader)
    try:
        agents["node-2"] = job.agent("node-2", [gate.address, *addresses], script)
        assert gate.seen.wait(START_S), "the third agent sent no join"
        seen_at = [len(m.output()) for m in masters]
        with frozen(etcd_server):
            gate.release()
            wait_until(
                lambda: any(
                    "node_joined: node node-2" in m.output()[at:]
                    for m, at in zip(masters, seen_at, strict=True)
                ),
                10,
                "the leader to take the join while etcd is frozen",
            )
            wait_until(lambda: all(job.info(a) == 503 for a in addresses), STEP_DOWN_LIMIT_S, "no leader")
            # The join was never acknowledged: the leader answered 503 once it could no longer store it.
            assert gate.reply.wait(10), "the held join got no reply from the leader that stepped down"
            assert gate.reply_status == 503, gate.reply_line
            time.sleep(STALL_S)  # the stall itself: a duration to hold etcd frozen, not a wait for an event
            assert all(job.info(a) == 503 for a in addresses)
        thawed_at = [len(m.output()) for m in masters]
    finally:
        gate.close()

    # Stall 2: etcd freezes once a leader has the round that admits node-2 open (it opened it, or took over
    # with it open: the join's save may reach etcd as it resumes); its members rejoin, the round closes
    # and its assignments are answered around the stall.
    admitting = re.compile(r"round_opened: round 2 |master_takeover: .* in round 2 ")
    wait_until(
        lambda: any(admitting.search(m.output(), at) for m, at in zip(masters, thawed_at, strict=True)),
        START_S,
        "a leader with the round admitting node-2 open",
    )
    with frozen(etcd_server):
        wait_until(lambda: all(job.info(a) == 503 for a in addresses), STEP_DOWN_LIMIT_S, "no leader")
        time.sleep(STALL_S)  # the stall itself
    leader_of(job, addresses)  # a leader is elected once etcd is back

    for node_id, agent in agents.items():
        code = agent.wait(START_S + steps * 0.1 * 3)
        assert code == 0, f"{node_id} exited {code}:\n{agent.output()[-4000:]}"
        assert "job succeeded" in agent.output()
    assert re.search(rf"^\[rank0\]:done step={steps}$", "".join(a.output() for a in agents.values()), re.M)
    leader = leader_of(job, addresses)
    status = job.status(leader)
    assert status["phase"] == "succeeded", status
    rounds = assigned_rounds(agents)
    stored = event_log(events)
    print(
        f"\nrounds assigned (term, number): {sorted(rounds)}; the leader's: {sorted(leader_rounds(stored))}"
    )
    assert_one_world_per_round(agents, status, stored)
    assert any(n == 3 for a in rounds.values() for _, n in a.values()), "node-2 never trained"
    job.shut_down()


# -- 2 ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_etcd_frozen_longer_than_the_lease_no_master_leads_training_goes_on_and_nothing_restarts(
    launch, tmp_path, etcd_server
):
    job = Job(launch, tmp_path, "2:2", f"etcd://{etcd_server.endpoint}")
    masters, addresses = two_masters(job)
    leader = leader_of(job, addresses)

    steps = 200
    agents = [job.agent(f"node-{i}", addresses, train_args(steps=steps, step_time=0.1)) for i in range(2)]
    rank0 = rank0_agent(agents)
    rank0.wait_for(r"^\[rank0\]:step=10 loss", START_S)
    workers = sorted(p for a in agents for p in a.worker_pids())
    assert len(workers) == 2
    before = job.status(leader)
    assert (before["round"], before["restart_count"]) == (1, 0)

    at = len(rank0.output())
    at_masters = [len(m.output()) for m in masters]
    with frozen(etcd_server):
        frozen_at = time.monotonic()
        wait_until(lambda: all(job.info(a) == 503 for a in addresses), STEP_DOWN_LIMIT_S, "no leader")
        stepped_down_s = time.monotonic() - frozen_at
        # For the rest of the outage, no master answers as the leader while rank 0 keeps stepping.
        steps_then = len(steps_of(rank0, at))
        while time.monotonic() - frozen_at < OUTAGE_S:
            assert [job.info(a) for a in addresses] == [503, 503]
            time.sleep(0.2)  # the outage's length is the point: a duration, not a wait for an event
        during = len(steps_of(rank0, at))
        assert during > steps_then, "rank 0 stopped training while etcd was down"
    back_at = time.monotonic()
    leader = leader_of(job, addresses, STEP_DOWN_LIMIT_S + START_S)
    print(
        f"\nleader stepped down {stepped_down_s:.2f}s after etcd froze; {during} steps ran during the "
        f"{OUTAGE_S:g}s outage; a leader was elected {time.monotonic() - back_at:.2f}s after etcd was back"
    )
    assert any(
        "lost the leadership of job" in m.output()[a:] for m, a in zip(masters, at_masters, strict=True)
    )

    # Past the new leader's grace period the nodes are still alive in round 1.
    wait_until(
        lambda: len(steps_of(rank0, at)) >= during + 2 * HEARTBEAT_TIMEOUT_S / 0.1,
        60,
        "training to go on past the grace period",
    )
    status = job.status(leader)
    assert (status["round"], status["restart_count"], status["phase"]) == (1, 0, "training")
    assert sorted(p for a in agents for p in a.worker_pids()) == workers

    job.finish(*agents)
    assert_uninterrupted_training(agents, steps)  # one start each, restart=0, every step exactly once
    assert sorted(s[2] for a in agents for s in starts(a)) == [0, 0]
    for master, at_master in zip(masters, at_masters, strict=True):
        assert "round_opened" not in master.output()[at_master:], master.output()[-3000:]
        assert_no_false_verdicts(master)
    job.shut_down()
