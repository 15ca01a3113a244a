"""``EtcdTerm``: the current leadership term of an :class:`~master.store.etcd_store.EtcdStore`.

A term starts when a campaign wins the leader key. Its lease is renewed from the keeper's own thread
(``master/store/etcd_lease.py``); the term ends once (``on_lost``) when the keeper finds the lease or
the key gone or cannot renew in time, when a save finds the fence broken, or quietly when the master
resigns. Leases of terms that could not be revoked (etcd unreachable) are revoked later.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

import aetcd

from master.store import etcd_client as ec
from master.store.etcd_lease import LeaseKeeper
from master.store.etcd_state import StateRecords

log = logging.getLogger(__name__)


class EtcdTerm:
    """Mixin of :class:`~master.store.etcd_store.EtcdStore`: the term's state, its keeper and its end."""

    job_id: str
    endpoints: list[tuple[str, int]]
    leader_key: bytes
    _endpoint_index: int
    _username: str | None
    _password: str | None
    _records: StateRecords
    _candidate: str | None
    _lease_id: int | None
    _leader_revision: int | None
    _keeper: LeaseKeeper | None
    _losing: asyncio.Future | None
    _valid_until: float
    _on_lost: Callable[[], Awaitable[None] | None] | None
    _lost_fired: bool
    _stale_leases: set[int]

    def _connect(self) -> aetcd.Client:
        raise NotImplementedError

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
        self._records.written = None  # a deposed master may have written part of a save: read it first
        self._on_lost, self._lost_fired = on_lost, False
        self._valid_until = granted_at + 2.0 * max(1, ttl) / 3.0  # the keeper's step-down deadline
        loop = asyncio.get_running_loop()

        def renewed(valid_until: float) -> None:
            if self._lease_id == lease_id:  # a keeper of a term already over changes nothing
                self._valid_until = valid_until

        def lost(reason: str) -> None:
            loop.call_soon_threadsafe(self._lost_by_keeper, lease_id, reason)

        self._keeper = LeaseKeeper(
            endpoints=self.endpoints,
            endpoint_index=self._endpoint_index,
            lease_id=lease_id,
            ttl_s=max(1, ttl),
            renewed_at=granted_at,
            leader_key=self.leader_key,
            leader_revision=revision,
            credentials=None if self._username is None else (self._username, self._password or ""),
            channel_options=ec.CHANNEL_OPTIONS,
            renewed=renewed,
            lost=lost,
        )
        self._keeper.start()

    def _lost_by_keeper(self, lease_id: int, reason: str) -> None:
        if self._lease_id == lease_id and not self._lost_fired:
            self._losing = asyncio.ensure_future(self._lose(reason))

    async def _lose(self, reason: str) -> None:
        """End the term (once): forget the lease, tell the master."""
        if self._lost_fired:
            return
        log.warning("master %s lost the leadership of job %s: %s", self._candidate, self.job_id, reason)
        callback = self._end_term()
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
        self._end_term()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._revoke_stale(), 2.0)

    def _end_term(self) -> Callable[[], Awaitable[None] | None] | None:
        """Stop renewing, mark the term's lease for revocation, forget the term; its ``on_lost``."""
        self._lost_fired = True
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()  # cancels its call in flight: returns at once
        if self._lease_id is not None:
            self._stale_leases.add(self._lease_id)
        self._lease_id = self._leader_revision = None
        callback, self._on_lost = self._on_lost, None
        return callback

    async def _revoke_stale(self) -> None:
        """Revoke leases of former terms; raises only when etcd does not answer."""
        for lease_id in list(self._stale_leases):
            try:
                await self._connect().revoke_lease(lease_id)
            except ec.TRANSIENT:
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
        state before the lease keeper's report of the lost term gets to run on its loop."""
        return self._lease_id is not None and not self._lost_fired and time.monotonic() < self._valid_until
