"""``EtcdStore``: the job's durable state in etcd, and one leader per job elected with an etcd lease.

Keys, under ``/elastic/<job_id>/``:

``leader``
    The leading master's candidate string, written by a create-if-absent transaction and bound to a lease
    of ``lease_ttl_s`` that the leader keeps alive every TTL/3 from its own thread
    (``master/store/etcd_lease.py``). The key vanishes when the lease is revoked (clean shutdown: a standby
    takes over at once) or expires (a crashed or cut-off leader: a standby takes over after at most one
    TTL).
``state``, ``node/...``, ``nstate/...``, ``event/...``, ``chunk/...``
    The snapshot of :meth:`master.job.job.Job.snapshot` as records (``master/store/etcd_layout.py``); a save
    writes only the records that changed (``master/store/etcd_state.py``), in transactions that each check
    that the leader key still is *this* master's key (same value and same create revision, which names one
    lease term), so a deposed master can never overwrite the state of the master that replaced it.
    ``state`` written by the previous release (the whole snapshot as one JSON value) is still read.

Behind TLS: the etcd client (``aetcd``) speaks plain gRPC only; an etcd that requires TLS is reached through
``etcd grpc-proxy`` on the master's host, with etcd's user and password from ``--store`` (docs/operations.md,
"etcd behind TLS"). Pointed straight at a TLS port, :meth:`EtcdStore.start` says so in one line.

A leader that cannot renew its lease before two thirds of its TTL have passed (etcd unreachable), or that
finds its lease or leader key gone, steps down: ``on_lost`` is called once and the master answers 503
until it wins a new campaign. The campaign retries while etcd is unreachable, reconnecting (to the next
endpoint when several are given), so a master recovers by itself once etcd is back.

Only the ``master/store/etcd_*.py`` modules import the etcd client; :func:`master.store.base.open_store`
imports them lazily.

The election, the load and the saves run on a :class:`SideLoop`, a second asyncio loop on its own thread, so
that they never queue behind the agents. The master serves every agent on its main loop. A standby that
takes over a job of 10,000 nodes meets all of them reconnecting at once, while its election (a few etcd
calls) and its reading of the job's state (thousands of records) are what decides when it can answer them;
on the main loop those calls waited behind the refusals it was still sending. Coroutines run there share
only the GIL with the main loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aetcd

from elastic.control.tls import speaks_tls
from master.store import etcd_client as ec
from master.store.base import Snapshot, StateFormatError, StateStore, StoreError, StoreUnreachableError
from master.store.etcd_lease import LeaseKeeper
from master.store.etcd_state import StateRecords
from master.store.etcd_term import EtcdTerm

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds the first read of :meth:`EtcdStore.start` may take before etcd counts as unreachable.
START_TIMEOUT_S = 3.0
#: Retry delays of a campaign while etcd is unreachable.
RETRY_MIN_S, RETRY_MAX_S = 0.2, 2.0


class EtcdStore(EtcdTerm, StateStore):
    """Job state under ``/elastic/<job_id>/`` in etcd, with lease-based leader election."""

    durable = True

    def __init__(
        self,
        endpoints: str,
        job_id: str,
        *,
        lease_ttl_s: float = 3.0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        """``username``/``password``: an etcd user (etcd's authentication on); both or neither."""
        if not job_id:
            raise StoreError("the etcd store needs a job id")
        if (username is None) != (password is None):
            raise StoreError("the etcd store needs both a user name and a password, or neither")
        self.endpoints = ec.parse_endpoints(endpoints)
        self._username, self._password = username, password
        self.job_id = job_id
        # etcd grants whole seconds (and at least 2 s on a default server); the granted TTL is used.
        self.lease_ttl = max(1, math.ceil(lease_ttl_s))
        prefix = f"/elastic/{job_id}/"
        self.leader_key = (prefix + "leader").encode()
        self.state_key = (prefix + "state").encode()
        self._records = StateRecords(prefix.encode(), frozenset({"leader"}))
        self._endpoint_index = 0
        #: One etcd client per event loop: the main loop's, and the side loop's that elects and loads.
        self._clients: dict[asyncio.AbstractEventLoop, aetcd.Client] = {}
        self._side = SideLoop(f"etcd-campaign-{job_id}")
        # The current term, while leading: lease id, its granted TTL, the leader key's create revision.
        self._candidate: str | None = None
        self._lease_id: int | None = None
        self._leader_revision: int | None = None
        self._keeper: LeaseKeeper | None = None
        self._losing: asyncio.Future | None = None  # a step-down the keeper asked for, kept referenced
        #: Monotonic time when this term must be treated as over unless the lease was renewed (see leading).
        self._valid_until = 0.0
        self._on_lost: Callable[[], Awaitable[None] | None] | None = None
        self._lost_fired, self._closed = True, False
        #: Leases of former terms that could not be revoked yet (etcd was unreachable).
        self._stale_leases: set[int] = set()

    # -- connection ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._endpoint_index]
        return f"{host}:{port}"

    def _describe_endpoints(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _connect(self) -> aetcd.Client:
        """This event loop's etcd client (gRPC's asyncio channels belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            host, port = self.endpoints[self._endpoint_index]
            client = self._clients[loop] = aetcd.Client(
                host=host,
                port=port,
                username=self._username,
                password=self._password,
                timeout=ec.RPC_TIMEOUT_S,
                options=ec.CHANNEL_OPTIONS,
            )
        return client

    async def _reconnect(self) -> None:
        """Drop this loop's channel (gRPC backs off reconnecting for up to minutes) and move to the next
        endpoint."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        self._endpoint_index = (self._endpoint_index + 1) % len(self.endpoints)
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 2.0)

    async def start(self) -> None:
        """Connect and read the leader key; raise :class:`StoreError` (one line) when no endpoint answers,
        or when one answers no (wrong user or password, no permission on the job's keys), or speaks TLS."""
        errors, refusals, tls = [], [], []
        for _ in self.endpoints:
            endpoint = self.endpoint
            try:
                await asyncio.wait_for(self._connect().get(self.leader_key), START_TIMEOUT_S)
                return
            except (aetcd.ClientError, *ec.TRANSIENT) as exc:
                timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
                reason = f"no answer within {START_TIMEOUT_S:g}s" if timed_out else ec.one_line(exc)
                if not isinstance(exc, ec.TRANSIENT):
                    refusals.append(f"{endpoint}: {reason}" if len(self.endpoints) > 1 else reason)
                elif await asyncio.to_thread(speaks_tls, *self.endpoints[self._endpoint_index], 1.0):
                    tls.append(endpoint)  # plain gRPC to a TLS port: the handshake fails, "Socket closed"
                else:
                    errors.append(f"{endpoint}: {reason}" if len(self.endpoints) > 1 else reason)
                await self._reconnect()
        if refusals:
            who = f"the etcd user {self._username!r}" if self._username else "a client without an etcd user"
            raise StoreError(
                f"etcd at {self._describe_endpoints()} refused {who}: {'; '.join(refusals)} (the user needs "
                f"read/write on the prefix {self.leader_key.decode().rpartition('/')[0]}/; "
                "check --store's user and --store-password-file)"
            )
        if tls:
            raise StoreError(f"etcd at {', '.join(tls)} speaks TLS: {ec.TLS_HINT}")
        raise StoreUnreachableError(
            f"etcd at {self._describe_endpoints()} is unreachable: {'; '.join(errors)}; "
            "start etcd or fix --store"
        )

    # -- leader election ----------------------------------------------------------------------------
    async def campaign(self, candidate: str, on_lost: Callable[[], Awaitable[None] | None]) -> None:
        """Block until this master holds the leader key; retries while etcd is unreachable.

        The election runs on the side loop (:class:`SideLoop`): a standby meeting a reconnect
        storm must not queue its etcd calls behind it."""
        await self._resign()
        lease_id, ttl, revision, granted_at = await self._side.run(self._win(candidate))
        self._start_term(candidate, lease_id, ttl, revision, granted_at, on_lost)
        log.info(
            "won the leadership of job %s in etcd at %s (lease %x, ttl %ds)",
            self.job_id,
            self.endpoint,
            lease_id,
            ttl,
        )

    async def _win(self, candidate: str) -> tuple[int, int, int, float]:
        """Campaign until the leader key is ours: (lease id, granted TTL, the key's create revision, the
        monotonic time the lease was granted)."""
        delay = RETRY_MIN_S
        last_warning = 0.0
        while True:
            if self._closed:
                raise StoreError(f"the etcd store of job {self.job_id} is closed")
            try:
                await self._revoke_stale()
                client = self._connect()
                tx = client.transactions
                lease = await client.lease(self.lease_ttl)
                granted_at = time.monotonic()
                try:
                    won, responses = await client.transaction(
                        compare=[tx.create(self.leader_key) == 0],
                        success=[tx.put(self.leader_key, candidate.encode(), lease=lease.id)],
                        failure=[tx.get(self.leader_key)],
                    )
                except BaseException:
                    self._stale_leases.add(lease.id)
                    raise
                if won and self._closed:  # closed while the transaction was in flight
                    self._stale_leases.add(lease.id)
                    await self._revoke_stale()
                    raise StoreError(f"the etcd store of job {self.job_id} is closed")
                if won:
                    revision = responses[0].response_put.header.revision  # = the key's create revision
                    return lease.id, lease.ttl, revision, granted_at
                with contextlib.suppress(aetcd.ClientError, *ec.TRANSIENT):
                    await client.revoke_lease(lease.id)  # a lease per attempt: the next one gets a fresh one
                holder = responses[0][0][1] if responses and responses[0] else None
                if holder is not None and holder.value == candidate.encode():
                    # Our own key from a term we lost (its lease is not revoked yet): drop it and retry.
                    await client.transaction(
                        compare=[tx.create(self.leader_key) == holder.create_revision],
                        success=[tx.delete(self.leader_key)],
                        failure=[],
                    )
                    continue
                revision = holder.mod_revision if holder is not None else 0
                if await ec.wait_for_vacancy(client, self.leader_key, revision):
                    log.info("the leader key of job %s was released; campaigning", self.job_id)
                delay = RETRY_MIN_S
            except asyncio.CancelledError:
                raise
            except (aetcd.ClientError, *ec.TRANSIENT) as exc:
                now = time.monotonic()
                if now - last_warning > 30.0:
                    last_warning = now
                    log.warning(
                        "etcd at %s does not answer (%s); job %s has no leader here until it does",
                        self.endpoint,
                        ec.one_line(exc),
                        self.job_id,
                    )
                await self._reconnect()
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    # -- state ----------------------------------------------------------------------------------------
    async def load(self) -> Snapshot | None:
        """The stored snapshot (``master/store/etcd_state.py``), or None for a new job."""
        try:
            snapshot, problem = await self._side.run(self._load_records())
        except (aetcd.ClientError, *ec.TRANSIENT) as exc:
            raise StoreError(
                f"cannot read the state of job {self.job_id} from etcd at {self.endpoint}: {ec.one_line(exc)}"
            ) from None
        except ValueError as exc:
            problem = f"is not JSON: {exc}"
        if problem is None:
            return snapshot
        where = f"cannot continue job {self.job_id}: its stored state ({self.state_location})"
        raise StateFormatError(f"{where} {problem}; fix or delete that key")

    async def _load_records(self) -> tuple[Snapshot | None, str | None]:
        # On the side loop, like the election: thousands of records must not wait behind the agents.
        return await self._records.load(self._connect())

    async def save(self, snapshot: Snapshot) -> None:
        """Write what changed since the last save, in transactions that each check that the leader key
        is still this term's; raise :class:`StoreError` when it is not, or etcd fails."""
        revision, candidate = self._leader_revision, self._candidate or ""
        if not self.leading or revision is None:  # a term sets its leader key's revision as it begins
            raise StoreError(f"not saving the state of job {self.job_id}: this master does not lead it")
        try:
            ok = await self._side.run(self._save_records(snapshot, revision, candidate))
        except (aetcd.ClientError, *ec.TRANSIENT) as exc:
            raise StoreError(
                f"cannot save the state of job {self.job_id} to etcd at {self.endpoint}: {ec.one_line(exc)}"
            ) from None
        if not ok:
            await self._lose("another master holds the leader key now")
            raise StoreError(
                f"refused to save the state of job {self.job_id}: this master no longer leads it"
            )

    async def _save_records(self, snapshot: Snapshot, revision: int, candidate: str) -> bool:
        # On the side loop: the first save of a term gates every reply, and the main loop is then busy with
        # 10,000 agents coming back (a transaction of 5 records took 0.5 s there, 40 ms here); encoding
        # the records no longer blocks the main loop in one piece either.
        client = self._connect()
        tx = client.transactions
        fence = [tx.create(self.leader_key) == revision, tx.value(self.leader_key) == candidate.encode()]
        return await self._records.save(client, snapshot, fence)

    @property
    def state_location(self) -> str:
        return f"etcd key {self.state_key.decode()} at {self.endpoint}"

    async def resign(self) -> None:
        """End this term quietly and revoke its lease (a standby takes over at once); stay connected."""
        await self._resign()

    async def close(self) -> None:
        """Revoke the lease (a standby takes over at once), stop renewing it, disconnect. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._resign()
        side_client = self._clients.pop(self._side.loop, None) if self._side.loop else None
        await self._side.aclose(side_client.close if side_client is not None else None)
        for client in list(self._clients.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 2.0)
        self._clients.clear()


class SideLoop:
    """An event loop on a daemon thread, started on first use; :meth:`aclose` stops and joins it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The side loop, once started."""
        return self._loop

    def _started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
            self._loop = loop
        return self._loop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the side loop and await its result here; cancelling this cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._started()))

    async def aclose(
        self, last: Callable[[], Awaitable[object]] | None = None, timeout_s: float = 5.0
    ) -> None:
        """Cancel what still runs on the side loop and wait for it to finish, then run ``last()`` there
        (closing what those tasks used), stop the loop and join the thread."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if last is not None:
                await last()

        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.wrap_future(asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop)), timeout_s
            )
        loop.call_soon_threadsafe(loop.stop)
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:  # no executor thread just to join one
            await asyncio.sleep(0.005)
        if not thread.is_alive():
            loop.close()
