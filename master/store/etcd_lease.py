"""``LeaseKeeper``: renews the leading master's etcd lease from its own thread and its own gRPC channel.

Why a thread: the master serves every agent on one asyncio loop. At 10,000 nodes that loop runs near
saturation, and after a failover it meets a reconnect storm; a renewal queued behind thousands of
requests came back too late, the leader stepped down, and the job flapped between terms for tens of
seconds. Here the renewal is a blocking gRPC call on a separate channel: it releases the GIL while it
waits, so it needs only a few interpreter time slices, however busy the loop is.

The rule is the one of the asyncio version it replaces: renew every TTL/3; after each renewal check
that the leader key is still this term's (same create revision); treat the term as over once two
thirds of the TTL have passed since the last confirmed renewal was *sent* (etcd counts the TTL from when
it receives the renewal, so a third of the TTL is left during which nobody else can have been elected).
The keeper reports through two callbacks, called from its thread: ``renewed(valid_until)`` and, once,
``lost(reason)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from aetcd import rpc

log = logging.getLogger(__name__)

#: gRPC status codes that mean "etcd did not answer" (try again, maybe at another endpoint).
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


class LeaseKeeper:
    """Keeps one lease of one term alive until :meth:`stop` or until the term is lost."""

    def __init__(
        self,
        *,
        endpoints: list[tuple[str, int]],
        endpoint_index: int,
        lease_id: int,
        ttl_s: int,
        renewed_at: float,
        leader_key: bytes,
        leader_revision: int,
        credentials: tuple[str, str] | None,
        channel_options: dict,
        renewed: Callable[[float], None],
        lost: Callable[[str], None],
    ) -> None:
        self._endpoints, self._index = endpoints, endpoint_index
        self.lease_id = lease_id
        self._period = max(1, ttl_s) / 3.0
        self._renewed_at = renewed_at
        self._leader_key, self._leader_revision = leader_key, leader_revision
        self._credentials = credentials
        self._options = list(channel_options.items())
        self._renewed_cb, self._lost_cb = renewed, lost
        self._stop = threading.Event()
        self._call_lock = threading.Lock()
        self._call: grpc.Future | grpc.Call | None = None  # the call in flight, cancelled by stop()
        self._channel: grpc.Channel | None = None
        self._token: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{lease_id:x}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_timeout_s: float = 2.0) -> None:
        """Stop renewing (the caller revokes the lease if it wants a standby to take over at once)."""
        self._stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            reason = self._renew_until_stopped()
            if reason is not None and not self._stop.is_set():
                self._lost_cb(reason)
        except Exception as exc:  # a bug here must end the term, never leave a leader without renewals
            log.exception("the lease keeper of lease %x failed", self.lease_id)
            if not self._stop.is_set():
                self._lost_cb(f"its lease keeper failed ({type(exc).__name__})")
        finally:
            self._close_channel()

    def _renew_until_stopped(self) -> str | None:
        """Returns why the term is lost, or None when stopped."""
        period = self._period
        while not self._stop.wait(max(0.0, self._renewed_at + period - time.monotonic())):
            sent = time.monotonic()
            give_up = self._renewed_at + 2.0 * period
            try:
                ttl = self._renew(max(0.05, give_up - sent))
                if ttl <= 0:
                    return f"its etcd lease {self.lease_id:x} expired"
                if self._holder_revision(max(0.05, give_up - time.monotonic())) != self._leader_revision:
                    return "its leader key in etcd was deleted or replaced"
                self._renewed_at = sent
                self._renewed_cb(sent + 2.0 * period)
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                if self._stop.is_set():
                    return None
                code, details = _code(exc), _details(exc)
                if code is grpc.StatusCode.UNAUTHENTICATED or "auth token" in details:
                    self._token = None  # the simple token expired: authenticate again on the next try
                elif time.monotonic() >= give_up:
                    return f"etcd at {self._endpoint()} did not renew its lease in time ({details or code})"
                elif code not in _TRANSIENT:
                    return f"etcd refused to renew its lease ({details or code})"
                elif len(self._endpoints) > 1:  # the lease is cluster-wide: try it at another endpoint
                    self._close_channel()
                    self._index = (self._index + 1) % len(self._endpoints)
                if time.monotonic() >= give_up:
                    return f"etcd at {self._endpoint()} did not renew its lease in time ({details or code})"
                self._stop.wait(min(period / 3.0, max(0.0, give_up - time.monotonic())))
        return None

    def _renew(self, timeout_s: float) -> int:
        """One renewal; the lease's remaining TTL (0 or less: the lease is gone)."""
        answered = threading.Event()

        def requests() -> Iterator[rpc.LeaseKeepAliveRequest]:
            yield rpc.LeaseKeepAliveRequest(ID=self.lease_id)
            # Keep our side open until the reply: etcd's grpc-proxy cancels a keep-alive whose client
            # closed its side first.
            answered.wait(timeout_s)

        stub = rpc.LeaseStub(self._open())
        call = stub.LeaseKeepAlive(requests(), timeout=timeout_s, metadata=self._metadata())
        self._track(call)
        try:
            for reply in call:
                return reply.TTL
            return 0
        finally:
            answered.set()
            call.cancel()
            self._track(None)

    def _holder_revision(self, timeout_s: float) -> int | None:
        """The leader key's create revision, or None when it is gone."""
        future = rpc.KVStub(self._open()).Range.future(
            rpc.RangeRequest(key=self._leader_key), timeout=timeout_s, metadata=self._metadata()
        )
        self._track(future)
        try:
            reply = future.result()
        finally:
            self._track(None)
        return reply.kvs[0].create_revision if reply.kvs else None

    # -- plumbing -----------------------------------------------------------------------------------
    def _track(self, call: grpc.Future | grpc.Call | None) -> None:
        with self._call_lock:
            self._call = call
        if call is not None and self._stop.is_set():
            call.cancel()

    def _endpoint(self) -> str:
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    def _open(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self._endpoint(), options=self._options)
        return self._channel

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        self._token = None
        if channel is not None:
            channel.close()

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self._credentials is None:
            return None
        if self._token is None:
            name, password = self._credentials
            future = rpc.AuthStub(self._open()).Authenticate.future(
                rpc.AuthenticateRequest(name=name, password=password), timeout=self._period
            )
            self._track(future)
            try:
                self._token = future.result().token
            finally:
                self._track(None)
        return (("token", self._token),)


def _code(exc: Exception) -> grpc.StatusCode | None:
    if isinstance(exc, grpc.FutureCancelledError):
        return grpc.StatusCode.CANCELLED
    code = getattr(exc, "code", None)
    return code() if callable(code) else None


def _details(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return " ".join((text or "").split())
