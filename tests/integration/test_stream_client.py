"""The agent's client (elastic.control.client.MasterClient) on the agent stream, against real masters: one
connection carries heartbeats while a watch long-poll waits; a standby's 503 and a leader that steps down send
the client to the next master; a killed master connection fails the pending call over at once; a master
without the stream is spoken to over plain HTTP; TLS; ``ELASTIC_MASTER_STREAM=0``.

Connections are counted on this process's side (psutil): the client's sockets whose far end is a master's
port. The fixture closes every client and stops every master, then checks that no thread is left."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import aetcd
import e2e
import httpx
import psutil
import pytest
from certs import LOCAL_NAMES, CertAuthority, write_cert, write_key
from e2e import wait_until
from embedded_masters import EmbeddedMasters, no_thread_left
from fake_nodes import RealMaster, start_master

import elastic.control.stream_transport
from elastic.control.client import MasterClient, MasterRejectedError, MasterUnreachableError
from elastic.control.protocol import JOB_HEADER, Command, HeartbeatRequest, JoinRequest, NodeState
from master.http.serving import EmbeddedMaster
from master.store.etcd_store import EtcdStore

launch = e2e.launch

TOKEN = "stream-client-token"
#: Long-polls that must still be pending when the test looks: far longer than the test's own steps.
LONG_POLL_S = 20.0


class Masters(EmbeddedMasters):
    """Starts masters and clients for one test; :meth:`close` undoes all of it."""

    token = TOKEN
    job: ClassVar[dict[str, Any]] = dict(
        min_nodes=1, max_nodes=1, last_call_s=0.1, heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0
    )

    def __init__(self) -> None:
        super().__init__()
        self.job_id = f"stream-{uuid.uuid4().hex[:8]}"

    def start(
        self, *, store_url: str | None = None, job_id: str | None = None, **server: Any
    ) -> EmbeddedMaster:
        job_id = job_id or self.job_id
        if store_url is not None:  # masters of one job on one etcd: one leads, the others stand by
            server.update(store=EtcdStore(store_url, job_id, lease_ttl_s=2), store_url=f"etcd://{store_url}")
        return super().start(job_id=job_id, **server)

    def client(self, *addresses: str, **options: Any) -> MasterClient:
        return self.keep(MasterClient(list(addresses), self.job_id, TOKEN, request_timeout=5.0, **options))


@pytest.fixture
def masters() -> Iterator[Masters]:
    with no_thread_left("the threads of the test to end"), Masters() as helper:
        yield helper


def connections_to(address: str) -> int:
    """This process's open TCP sockets whose far end is ``address`` (a client's side of a connection)."""
    port = int(address.rpartition(":")[2])
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)


def join_round(client: MasterClient, node_id: str = "a") -> int:
    """``node_id`` joins (a job of one node) and gets its assignment; its round."""
    client.join(
        JoinRequest(node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=1, max_nodes=1)
    )
    reply = client.next_round(node_id, 0, 10.0)
    assert reply.status == "assigned" and reply.assignment is not None, reply
    return reply.assignment.round


def beat(client: MasterClient, round_number: int, node_id: str = "a"):
    return client.heartbeat(HeartbeatRequest(node_id=node_id, round=round_number, state=NodeState.RUNNING))


def long_polls_open(master: EmbeddedMaster) -> int:
    return master.service.health.long_polls_open


def beats_beside_a_pending_watch(master: EmbeddedMaster, client: MasterClient, beats: int) -> None:
    """Node "a" joins through ``client`` and sends ``beats`` heartbeats, each answered while its watch waits
    at ``master``, all on one connection; closing the client fails the watch at once and leaves nothing
    open."""
    round_number = join_round(client)
    with ThreadPoolExecutor(1) as pool:
        watch = pool.submit(client.watch, "a", round_number, LONG_POLL_S)
        wait_until(lambda: long_polls_open(master) == 1, 10, "the watch to wait at the master")
        for _ in range(beats):
            assert beat(client, round_number).command is Command.CONTINUE
        assert not watch.done(), "the watch still waits: the heartbeats were answered beside it"
        assert long_polls_open(master) == 1
        assert connections_to(master.address) == 1, "info, join, round, heartbeats and the watch: one socket"
        client.close()  # its pending calls fail at once, nothing is left open
        with pytest.raises(MasterUnreachableError):
            watch.result(10)
    assert connections_to(master.address) == 0


@pytest.mark.timeout(60)
def test_heartbeats_are_answered_while_a_watch_waits_on_the_same_single_connection(masters):
    master = masters.start()
    beats_beside_a_pending_watch(master, masters.client(master.address), beats=3)


@pytest.mark.timeout(60)
def test_elastic_master_stream_0_speaks_plain_http_one_connection_per_thread(masters, monkeypatch):
    monkeypatch.setenv("ELASTIC_MASTER_STREAM", "0")
    master = masters.start()
    client = masters.client(master.address)
    round_number = join_round(client)
    with ThreadPoolExecutor(1) as pool:
        watch = pool.submit(client.watch, "a", round_number, 2.0)
        wait_until(lambda: long_polls_open(master) == 1, 10, "the watch to wait at the master")
        assert beat(client, round_number).command is Command.CONTINUE
        assert connections_to(master.address) == 2, "the watch's thread and this one, each its own"
        assert watch.result(10).command is Command.CONTINUE


@pytest.mark.timeout(60)
def test_a_master_without_the_stream_is_spoken_to_over_http(masters, monkeypatch):
    # An older master answers ``GET /v1/stream`` 404: it has no such path. The same real master answers
    # 404 to an upgrade on a path it does not serve, so the client is pointed at one (its only change).
    monkeypatch.setattr(elastic.control.stream_transport, "STREAM_PATH", "/v1/stream-of-a-later-release")
    master = masters.start()
    client = masters.client(master.address)
    assert client.info().job_id == masters.job_id
    round_number = join_round(client)
    assert beat(client, round_number).command is Command.CONTINUE
    assert client._streams is not None and not client._streams.offered(0), "the 404 is remembered"
    assert client._streams.open_count() == 0
    assert connections_to(master.address) == 1, "one keep-alive HTTP connection of this thread"


@pytest.mark.timeout(90)
def test_a_client_keeps_a_stream_to_the_standby_and_the_takeover_answers_on_it(masters, etcd_endpoint):
    first, second = masters.start(store_url=etcd_endpoint), masters.start(store_url=etcd_endpoint)

    def leader() -> EmbeddedMaster | None:
        leading = [m for m in (first, second) if _info_status(m.address, masters.job_id) == 200]
        return leading[0] if len(leading) == 1 else None

    old = wait_until(leader, 20, "one master to lead")
    standby = second if old is first else first
    # The standby is tried first: it accepts the stream, answers the call 503 not_leader, the leader answers.
    client = masters.client(standby.address, old.address)
    assert client.info().master_id == old.service.master_id
    streams = client._streams
    assert streams is not None
    wait_until(
        lambda: (connections_to(standby.address), connections_to(old.address)) == (1, 1),
        10,
        "one stream to each master, the standby's kept open",
    )
    to_standby = streams._streams[0]
    round_number = join_round(client)

    with ThreadPoolExecutor(1) as pool:
        watch = pool.submit(_answered, lambda: client.watch("a", round_number, LONG_POLL_S))
        wait_until(lambda: long_polls_open(old) == 1, 10, "the watch to wait at the leader")
        # The leader loses its lease: it stops leading but stays up, and answers the pending watch 503
        # not_leader on the stream. The client asks the other master, on the stream it already holds.
        revoke_leader_lease(etcd_endpoint, masters.job_id)
        wait_until(lambda: long_polls_open(old) == 0, 20, "the old leader to answer the watch")
        assert _info_status(old.address, masters.job_id) == 503, "it is up, and does not lead"
        reply = wait_until(lambda: _answered(lambda: beat(client, round_number)), 20, "a heartbeat answered")
        assert reply.master_id == standby.service.master_id
        assert streams._streams[0] is to_standby and not to_standby.closed, "no new connection"
        assert (connections_to(standby.address), connections_to(old.address)) == (1, 1)
        client.close()  # ends the watch, wherever it waits now
        watch.result(10)
    assert streams.open_count() == 0


def revoke_leader_lease(endpoint: str, job_id: str) -> None:
    """Revoke the lease of ``job_id``'s leader key in etcd (as if it had expired)."""

    async def revoke() -> None:
        host, _, port = endpoint.rpartition(":")
        etcd = aetcd.Client(host=host, port=int(port), timeout=5)
        try:
            kv = await etcd.get(EtcdStore(endpoint, job_id).leader_key)
            assert kv is not None and kv.lease, "the leader holds its key with a lease"
            await etcd.revoke_lease(kv.lease)
        finally:
            await etcd.close()

    asyncio.run(asyncio.wait_for(revoke(), 10))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_master_connection_fails_the_pending_call_over_to_the_next_master(masters, launch, tmp_path):
    doomed = start_master(launch, tmp_path, masters.job_id, "1")
    # The next master serves the same job with another token: a call that reaches it is refused 401.
    other = masters.start()
    client = MasterClient([doomed.address, other.address], doomed.job_id, doomed.token, request_timeout=5.0)
    masters.keep(client)
    round_number = join_round(client)
    with ThreadPoolExecutor(1) as pool:
        watch = pool.submit(client.watch, "a", round_number, LONG_POLL_S)
        waiting = "the watch to wait at the doomed master"
        wait_until(lambda: _metric(doomed, "elastic_master_long_polls_open") == 1, 10, waiting)
        assert connections_to(doomed.address) == 1
        (pid,) = [p.pid for p in psutil.Process().children() if doomed.job_id in " ".join(p.cmdline())]
        os.kill(pid, signal.SIGKILL)  # the kernel closes its end of the stream; no answer comes
        # Failed over at once, not after the watch's 20 s: the next master refuses the token.
        with pytest.raises(MasterRejectedError) as refused:
            watch.result(10)
    assert refused.value.status == 401
    assert connections_to(doomed.address) == 0


def _info_status(address: str, job_id: str) -> int:
    try:
        response = httpx.get(
            f"http://{address}/v1/info",
            headers={"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job_id},
            timeout=5.0,
            trust_env=False,
        )
    except httpx.TransportError:
        return 0
    return response.status_code


def _metric(master: RealMaster, name: str) -> float:
    response = httpx.get(
        master.url("/metrics"),
        headers={"Authorization": f"Bearer {master.token}"},
        timeout=5,
        trust_env=False,
    )
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", response.text, re.M))


def _answered(call):
    try:
        return call()
    except (MasterUnreachableError, MasterRejectedError):
        return None


# -- TLS ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    folder = tmp_path_factory.mktemp("stream-pki")
    authority = CertAuthority.create("stream test CA")
    key, cert = authority.issue("elastic-master", LOCAL_NAMES)
    return (
        authority.write(folder / "ca.pem"),
        write_cert(folder / "m.pem", cert),
        write_key(folder / "m.key", key),
    )


@pytest.mark.timeout(60)
def test_the_stream_runs_over_tls_heartbeats_beside_a_pending_watch(masters, tls_files):
    ca, cert, key = tls_files
    master = masters.start(tls_cert=str(cert), tls_key=str(key))
    beats_beside_a_pending_watch(master, masters.client(master.address, tls_ca=str(ca)), beats=20)
