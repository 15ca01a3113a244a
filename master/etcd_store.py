"""``EtcdStore``: the job's durable state in etcd, and one leader per job elected with an etcd lease.

Keys, under ``/elastic/<job_id>/``:

``leader``
    The leading master's candidate string, written by a create-if-absent transaction and bound to a lease
    of ``lease_ttl_s`` that the leader keeps alive every TTL/3. The key vanishes when the lease is
    revoked (clean shutdown: a standby takes over at once) or expires (a crashed or cut-off leader: a
    standby takes over after at most one TTL).
``state``
    The JSON snapshot of :meth:`master.job.Job.snapshot`. It is written only by a transaction that checks
    that the leader key still is *this* master's key (same value and same create revision, which names one
    lease term), so a deposed master can never overwrite the state of the master that replaced it.

Behind TLS: the etcd client (``aetcd``) speaks plain gRPC only. An etcd that requires TLS is reached through
``etcd grpc-proxy`` on the master's host (listening on 127.0.0.1, speaking TLS with a client certificate to
etcd); with etcd's authentication on, the master logs in as the user named in ``--store`` with its password,
which the proxy passes on. Pointed straight at a TLS port, :meth:`EtcdStore.start` says so in one line.
See docs/operations.md ("etcd behind TLS").

A leader that cannot renew its lease before two thirds of its TTL have passed (etcd unreachable), or that
finds its lease or leader key gone, steps down: ``on_lost`` is called once and the master answers 503
until it wins a new campaign. The campaign retries while etcd is unreachable, reconnecting (to the next
endpoint when several are given), so a master recovers by itself once etcd is back.

Only this module imports the etcd client (``aetcd``); ``master.store`` imports it lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable

import aetcd
from aetcd import rpc
from aetcd.rtypes import EventKind

from elastic.tls import speaks_tls
from master.store import Snapshot, StateFormatError, StateStore, StoreError

log = logging.getLogger("elastic.master.etcd")

#: Seconds the first read of :meth:`EtcdStore.start` may take before etcd counts as unreachable.
START_TIMEOUT_S = 3.0
#: Deadline of one etcd request.
RPC_TIMEOUT_S = 5.0
#: Longest wait for the leader key to go away before the campaign simply tries again.
CAMPAIGN_RECHECK_S = 5.0
#: Retry delays of a campaign while etcd is unreachable.
RETRY_MIN_S, RETRY_MAX_S = 0.2, 2.0

#: Errors that mean "etcd did not answer" (as opposed to "etcd answered no").
_TRANSIENT = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, asyncio.TimeoutError, TimeoutError)
#: gRPC backs off reconnecting for up to two minutes by default; etcd coming back must be noticed within
#: a lease TTL.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}


#: How to reach an etcd that requires TLS, for the one-line errors that meet one.
TLS_HINT = (
    "the master's etcd client speaks plain gRPC only: run `etcd grpc-proxy start` with a client certificate "
    "on this host, listening on 127.0.0.1, and give --store etcd://127.0.0.1:PROXY_PORT (docs/operations.md, "
    '"etcd behind TLS")'
)


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` (an ``http://`` prefix is tolerated) → ``[(host, port), ...]``."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://").rstrip("/")
        if not part:
            continue
        if part.startswith("https://"):
            raise StoreError(f"--store etcd://{text}: {part} is an https endpoint; {TLS_HINT}")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreError(f"--store etcd://{text}: each etcd endpoint must be HOST:PORT, got {part!r}")
        out.append((host, int(port)))
    if not out:
        raise StoreError(f"--store etcd://{text}: no etcd endpoint given; use etcd://HOST:PORT")
    return out


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


async def _refresh_lease(client: aetcd.Client, lease_id: int) -> rpc.LeaseKeepAliveResponse | None:
    """Renew a lease once. Unlike ``aetcd.Client.refresh_lease``, the request stream stays open until the
    reply came: etcd's grpc-proxy cancels a keep-alive whose client closed its side first ("context
    canceled"), which would make every renewal through the proxy fail."""
    await client.connect()
    answered = asyncio.Event()

    async def requests():
        yield rpc.LeaseKeepAliveRequest(ID=lease_id)
        await answered.wait()

    call = client.leasestub.LeaseKeepAlive(requests(), timeout=RPC_TIMEOUT_S, metadata=client.metadata)
    try:
        async for reply in call:
            return reply
        return None
    except rpc.AioRpcError as exc:
        if exc.code() is rpc.StatusCode.UNAVAILABLE:
            raise aetcd.ConnectionFailedError(exc.details()) from None
        if exc.code() is rpc.StatusCode.DEADLINE_EXCEEDED:
            raise aetcd.ConnectionTimeoutError(exc.details()) from None
        raise aetcd.ClientError(exc.details()) from None
    finally:
        answered.set()
        call.cancel()


class EtcdStore(StateStore):
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
        self.endpoints = parse_endpoints(endpoints)
        self._username, self._password = username, password
        self.job_id = job_id
        # etcd grants whole seconds (and at least 2 s on a default server); the granted TTL is used.
        self.lease_ttl = max(1, math.ceil(lease_ttl_s))
        prefix = f"/elastic/{job_id}/"
        self.leader_key = (prefix + "leader").encode()
        self.state_key = (prefix + "state").encode()
        self._endpoint_index = 0
        self._client: aetcd.Client | None = None
        # The current term, while leading: lease id, its granted TTL, the leader key's create revision.
        self._candidate: str | None = None
        self._lease_id: int | None = None
        self._leader_revision: int | None = None
        self._keepalive: asyncio.Task | None = None
        #: Monotonic time when this term must be treated as over unless the lease was renewed (see leading).
        self._valid_until = 0.0
        self._on_lost: Callable[[], Awaitable[None] | None] | None = None
        self._lost_fired = True
        #: Leases of former terms that could not be revoked yet (etcd was unreachable).
        self._stale_leases: set[int] = set()
        self._closed = False

    # -- connection ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._endpoint_index]
        return f"{host}:{port}"

    def _describe_endpoints(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _connect(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._endpoint_index]
            self._client = aetcd.Client(
                host=host,
                port=port,
                username=self._username,
                password=self._password,
                timeout=RPC_TIMEOUT_S,
                options=_CHANNEL_OPTIONS,
            )
        return self._client

    async def _reconnect(self) -> None:
        """Drop the channel (gRPC backs off reconnecting for up to minutes) and move to the next endpoint."""
        client, self._client = self._client, None
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
            except (aetcd.ClientError, *_TRANSIENT) as exc:
                timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
                reason = f"no answer within {START_TIMEOUT_S:g}s" if timed_out else _one_line(exc)
                if not isinstance(exc, _TRANSIENT):
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
            raise StoreError(f"etcd at {', '.join(tls)} speaks TLS: {TLS_HINT}")
        raise StoreError(
            f"etcd at {self._describe_endpoints()} is unreachable: {'; '.join(errors)}; "
            "start etcd or fix --store"
        )

    # -- leader election ----------------------------------------------------------------------------
    async def campaign(self, candidate: str, on_lost: Callable[[], Awaitable[None] | None]) -> None:
        """Block until this master holds the leader key; retries while etcd is unreachable."""
        await self._resign()
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
                    self._start_term(candidate, lease.id, lease.ttl, revision, granted_at, on_lost)
                    log.info(
                        "won the leadership of job %s in etcd at %s (lease %x, ttl %ds)",
                        self.job_id,
                        self.endpoint,
                        lease.id,
                        lease.ttl,
                    )
                    return
                with contextlib.suppress(aetcd.ClientError, *_TRANSIENT):
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
                await self._wait_for_vacancy(client, revision)
                delay = RETRY_MIN_S
            except asyncio.CancelledError:
                raise
            except (aetcd.ClientError, *_TRANSIENT) as exc:
                now = time.monotonic()
                if now - last_warning > 30.0:
                    last_warning = now
                    log.warning(
                        "etcd at %s does not answer (%s); job %s has no leader here until it does",
                        self.endpoint,
                        _one_line(exc),
                        self.job_id,
                    )
                await self._reconnect()
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def _wait_for_vacancy(self, client: aetcd.Client, revision: int) -> None:
        """Return when the leader key seen at ``revision`` is deleted, or after a while (then re-check)."""
        start = revision + 1 if revision else None
        try:
            event = await client.watch_once(
                self.leader_key, timeout=CAMPAIGN_RECHECK_S, start_revision=start, kind=EventKind.DELETE
            )
        except aetcd.WatchTimeoutError:
            return  # nothing happened for a while: the caller re-checks (covers a lost watch event)
        if isinstance(event, Exception):  # the watch stream broke (aetcd delivers the error as the event)
            if isinstance(event, aetcd.ClientError):
                raise event
            raise aetcd.ConnectionFailedError(_one_line(event))

    def _start_term(
        self,
        candidate: str,
        lease_id: int,
        ttl: int,
        revision: int,
        granted_at: float,
        on_lost: Callable[[], Awaitable[None] | None],
    ) -> None:
        self._candidate, self._lease_id, self._leader_revision = candidate, lease_id, revision
        self._on_lost, self._lost_fired = on_lost, False
        self._valid_until = granted_at + 2.0 * max(1, ttl) / 3.0  # the keep-alive's step-down deadline
        self._keepalive = asyncio.create_task(
            self._keep_alive(lease_id, max(1, ttl), granted_at), name=f"etcd-lease-{self.job_id}"
        )

    async def _keep_alive(self, lease_id: int, ttl: int, renewed_at: float) -> None:
        """Renew the lease every TTL/3 and check that the leader key is still ours; step down otherwise.

        etcd counts the TTL from when it receives a renewal, which is after we sent it: stepping down
        once two thirds of the TTL have passed since the last confirmed renewal was *sent* leaves a third
        of the TTL during which no other master can have been elected yet.
        """
        period = ttl / 3.0
        while True:
            await asyncio.sleep(max(0.0, renewed_at + period - time.monotonic()))
            sent = time.monotonic()
            give_up = renewed_at + 2.0 * period
            try:
                client = self._connect()
                reply = await asyncio.wait_for(_refresh_lease(client, lease_id), max(0.05, give_up - sent))
                if reply is None or reply.TTL <= 0:
                    return await self._lose(f"its etcd lease {lease_id:x} expired")
                left = max(0.05, give_up - time.monotonic())
                holder = await asyncio.wait_for(client.get(self.leader_key), left)
                if holder is None or holder.create_revision != self._leader_revision:
                    return await self._lose("its leader key in etcd was deleted or replaced")
                renewed_at = sent
                self._valid_until = renewed_at + 2.0 * period
            except asyncio.CancelledError:
                raise
            except (aetcd.ClientError, *_TRANSIENT) as exc:
                if time.monotonic() >= give_up:
                    return await self._lose(
                        f"etcd at {self.endpoint} did not renew its lease in time ({_one_line(exc)})"
                    )
                if not isinstance(exc, _TRANSIENT):
                    return await self._lose(f"etcd refused to renew its lease ({_one_line(exc)})")
                if len(self.endpoints) > 1:
                    await self._reconnect()  # the lease is cluster-wide: try it at another endpoint
                await asyncio.sleep(min(period / 3.0, max(0.0, give_up - time.monotonic())))

    async def _lose(self, reason: str) -> None:
        """End the term (once): forget the lease, tell the master."""
        if self._lost_fired:
            return
        self._lost_fired = True
        log.warning("master %s lost the leadership of job %s: %s", self._candidate, self.job_id, reason)
        task, self._keepalive = self._keepalive, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if self._lease_id is not None:
            self._stale_leases.add(self._lease_id)
        self._lease_id = self._leader_revision = None
        callback, self._on_lost = self._on_lost, None
        if callback is not None:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("on_lost callback of job %s failed", self.job_id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._revoke_stale(), 1.0)

    async def _resign(self) -> None:
        """End the current term quietly (no ``on_lost``) and revoke its lease if etcd answers."""
        self._lost_fired = True
        self._on_lost = None
        task, self._keepalive = self._keepalive, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._lease_id is not None:
            self._stale_leases.add(self._lease_id)
        self._lease_id = self._leader_revision = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._revoke_stale(), 2.0)

    async def _revoke_stale(self) -> None:
        """Revoke leases of former terms; raises only when etcd does not answer."""
        for lease_id in list(self._stale_leases):
            try:
                await self._connect().revoke_lease(lease_id)
            except _TRANSIENT:
                raise
            except aetcd.ClientError:
                pass  # "requested lease not found": it expired already
            self._stale_leases.discard(lease_id)

    @property
    def term(self) -> int:
        """The leader key's create revision: unique per term and growing from one term to the next."""
        return self._leader_revision or 0

    @property
    def leading(self) -> bool:
        """True while this master holds a term whose lease was renewed recently enough that no other
        master can have been elected yet. The time check matters when this process was frozen (SIGSTOP,
        a VM pause, a long GC) past its lease: on thawing it must not serve a single request from its stale
        state before the keep-alive task gets to run and notices the lost term."""
        return self._lease_id is not None and not self._lost_fired and time.monotonic() < self._valid_until

    # -- state ----------------------------------------------------------------------------------------
    async def load(self) -> Snapshot | None:
        try:
            kv = await self._connect().get(self.state_key)
        except (aetcd.ClientError, *_TRANSIENT) as exc:
            raise StoreError(
                f"cannot read the state of job {self.job_id} from etcd at {self.endpoint}: {_one_line(exc)}"
            ) from None
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except ValueError as exc:
            raise StateFormatError(
                f"cannot continue job {self.job_id}: its stored state ({self.state_location}) is not JSON: "
                f"{exc}; fix or delete that key"
            ) from None

    async def save(self, snapshot: Snapshot) -> None:
        """Write the snapshot only if the leader key is still this term's (a transaction), else raise."""
        if not self.leading:
            raise StoreError(f"not saving the state of job {self.job_id}: this master does not lead it")
        revision, candidate = self._leader_revision, self._candidate or ""
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        try:
            client = self._connect()
            tx = client.transactions
            ok, _ = await client.transaction(
                compare=[
                    tx.create(self.leader_key) == revision,
                    tx.value(self.leader_key) == candidate.encode(),
                ],
                success=[tx.put(self.state_key, data)],
                failure=[],
            )
        except (aetcd.ClientError, *_TRANSIENT) as exc:
            raise StoreError(
                f"cannot save the state of job {self.job_id} to etcd at {self.endpoint}: {_one_line(exc)}"
            ) from None
        if not ok:
            await self._lose("another master holds the leader key now")
            raise StoreError(
                f"refused to save the state of job {self.job_id}: this master no longer leads it"
            )

    @property
    def state_location(self) -> str:
        return f"etcd key {self.state_key.decode()} at {self.endpoint}"

    async def leader_hint(self) -> str | None:
        try:
            kv = await self._connect().get(self.leader_key)
        except (aetcd.ClientError, *_TRANSIENT):
            return None
        return None if kv is None else kv.value.decode(errors="replace")

    async def close(self) -> None:
        """Revoke the lease (a standby takes over at once), stop renewing it, disconnect. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._resign()
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 2.0)
