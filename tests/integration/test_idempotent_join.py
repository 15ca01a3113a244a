"""A join whose reply is lost, then retried, is the same incarnation's rejoin (a finding of bench/chaos.py).

A node cut off from its master for longer than the heartbeat timeout is declared dead. When the cut heals,
its agent's join can reach the master while the reply does not reach the agent (the attempt timed out, the
connection broke): the master starts a new incarnation of the node, and the agent retries the join. Before
the fix the master gave each new incarnation a secret of its own choosing, so the retry (carrying the
agent's old secret) was refused as ``409 duplicate_node`` and the agent's heartbeats (old secret too) as
``403 bad_node_secret``: the agent exited 2, the "fix the command" code, after a transient fault. Now the
agent names its secret in its join (elastic.control.client) and a new incarnation takes it
(master.job.liveness.incarnation_secret): the retry rejoins. Another agent still gets 409 and 403.

Real master (EmbeddedMaster on 127.0.0.1), real MasterClient, and a TCP relay between them that loses the
reply of one chosen request: the request reaches the master, its reply never reaches the client.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from e2e import wait_until
from embedded_masters import EmbeddedMasters, no_thread_left

from elastic.control.client import MasterClient, MasterError, MasterRejectedError
from elastic.control.protocol import NODE_SECRET_HEADER, Command, HeartbeatRequest, JoinRequest, NodeState
from master.http.serving import EmbeddedMaster

pytestmark = pytest.mark.timeout(60)

HB_INTERVAL_S = 0.2
HB_TIMEOUT_S = 1.0  # short: the partition test waits for the master to declare the node dead


class Masters(EmbeddedMasters):
    token = "idempotent-join-token"
    job_id = "job-idempotent-join"
    job = dict(EmbeddedMasters.job, min_nodes=1, max_nodes=2)

    def client(self, address: str) -> MasterClient:
        # Plain HTTP (no agent stream): one request, one reply, which the relay can lose.
        return self.keep(MasterClient([address], self.job_id, self.token, request_timeout=10.0, stream=False))


class LossyRelay:
    """Relays TCP connections to ``target``; after :meth:`lose_next_reply`, the next reply bytes the target
    sends are dropped and that connection is closed: its request was served, its answer lost."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lose = threading.Event()
        self.lost = threading.Event()  # a reply was lost
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def lose_next_reply(self) -> None:
        self.lost.clear()
        self._lose.set()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="lossy-relay")
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return  # closed
            far = socket.create_connection(self._target)
            self._sockets += [near, far]
            self._spawn(self._pump, near, far, False)
            self._spawn(self._pump, far, near, True)

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if replies and self._lose.is_set():
                    self._lose.clear()
                    self.lost.set()
                    break  # drop the reply and the connection
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (a close alone does not)
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for thread in self._threads:
            thread.join(timeout=5.0)


@pytest.fixture
def masters() -> Iterator[Masters]:
    with no_thread_left(), Masters() as helper:
        yield helper


def join_req(node_id: str) -> JoinRequest:
    return JoinRequest(node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=1, max_nodes=2)


def beat(client: MasterClient, node_id: str) -> Command:
    return client.heartbeat(HeartbeatRequest(node_id=node_id, round=0, state=NodeState.WAITING)).command


def join_losing_the_reply(client: MasterClient, relay: LossyRelay, node_id: str) -> None:
    """A join that reaches the master, whose reply the client never gets."""
    relay.lose_next_reply()
    with pytest.raises(MasterError):  # no answer: the agent's join poll retries it
        client.join(join_req(node_id))
    assert relay.lost.is_set()


def node_ids(client: MasterClient) -> set[str]:
    return {n.node_id for n in client.status().nodes}


def others_are_still_refused(masters: Masters, master: EmbeddedMaster, secret_hint: str) -> None:
    """The security property: a different agent is refused the live node's id (409 on its join, 403 with a
    wrong secret on its other requests)."""
    other = masters.client(master.address)
    with pytest.raises(MasterRejectedError) as duplicate:
        other.join(join_req("n1"))
    assert (duplicate.value.status, duplicate.value.code) == (409, "duplicate_node")
    forged = masters.http(master).post(
        "/v1/heartbeat",
        json={"node_id": "n1", "round": 0, "state": "waiting"},
        headers={NODE_SECRET_HEADER: secret_hint},
    )
    assert forged.status_code == 403 and forged.json()["error"] == "bad_node_secret"


def test_a_first_join_whose_reply_was_lost_is_retried_as_the_same_incarnation(masters: Masters) -> None:
    master = masters.start()
    relay = masters.keep(LossyRelay(master.address))
    agent = masters.client(relay.address)
    join_losing_the_reply(agent, relay, "n1")
    assert node_ids(masters.client(master.address)) == {"n1"}, "the lost attempt started an incarnation"
    reply = agent.join(join_req("n1"))  # the retry: before the fix, 409 duplicate_node
    assert reply.node_secret and agent.has_joined("n1")
    assert beat(agent, "n1") is Command.CONTINUE
    others_are_still_refused(masters, master, "x" * 43)


def test_after_a_healed_partition_the_agent_rejoins_and_its_heartbeats_are_accepted(masters: Masters) -> None:
    master = masters.start(heartbeat_interval_s=HB_INTERVAL_S, heartbeat_timeout_s=HB_TIMEOUT_S)
    relay = masters.keep(LossyRelay(master.address))
    agent = masters.client(relay.address)
    observer = masters.client(master.address)
    first = agent.join(join_req("n1")).node_secret
    assert beat(agent, "n1") is Command.CONTINUE
    # The partition: no heartbeat until the master declares the node dead (its heartbeat timeout).
    wait_until(lambda: "n1" not in node_ids(observer), 20 * HB_TIMEOUT_S, "the master to declare n1 dead")
    with pytest.raises(MasterRejectedError) as unknown:  # what the agent hears first when the cut heals
        beat(agent, "n1")
    assert unknown.value.code == "unknown_node"
    # It heals mid-join: the rejoin reaches the master, its reply is lost; the agent retries.
    join_losing_the_reply(agent, relay, "n1")
    assert beat(agent, "n1") is Command.CONTINUE, "a heartbeat in flight meanwhile: before the fix, 403"
    again = agent.join(join_req("n1"))  # before the fix: 409 duplicate_node
    assert again.node_secret == first, "the agent named its secret: the new incarnation has it"
    assert beat(agent, "n1") is Command.CONTINUE
    others_are_still_refused(masters, master, "y" * 43)


def test_a_join_that_names_a_short_secret_gets_one_of_the_masters(masters: Masters) -> None:
    """A secret too short to be unguessable is not taken: the master hands out one of its own."""
    master = masters.start()
    reply = masters.http(master).post(
        "/v1/join",
        json=join_req("n1").model_dump(mode="json"),
        headers={NODE_SECRET_HEADER: "short"},
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["node_secret"]) >= 43
