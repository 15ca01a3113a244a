"""The etcd client's plumbing shared by the store's parts: endpoints, errors, waiting for a vacancy.

Only the ``master/etcd_*.py`` modules import the etcd client (``aetcd``).
"""

from __future__ import annotations

import asyncio

import aetcd
from aetcd.rtypes import EventKind

from master.store.base import StoreError

#: Deadline of one etcd request.
RPC_TIMEOUT_S = 5.0

#: Errors that mean "etcd did not answer" (as opposed to "etcd answered no").
TRANSIENT = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, asyncio.TimeoutError, TimeoutError)
#: gRPC backs off reconnecting for up to two minutes by default; etcd coming back must be noticed within
#: a lease TTL.
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # A page of the state's records (master/store/etcd_state.py) may exceed gRPC's default 4 MiB.
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
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


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


#: Longest wait for the leader key to go away before the campaign simply tries again.
CAMPAIGN_RECHECK_S = 5.0


async def wait_for_vacancy(client: aetcd.Client, leader_key: bytes, revision: int) -> bool:
    """Return True when the leader key seen at ``revision`` is deleted, or False after a while (then
    re-check)."""
    start = revision + 1 if revision else None
    try:
        event = await client.watch_once(
            leader_key, timeout=CAMPAIGN_RECHECK_S, start_revision=start, kind=EventKind.DELETE
        )
    except aetcd.WatchTimeoutError:
        return False  # nothing happened for a while: the caller re-checks (covers a lost watch event)
    if isinstance(event, Exception):  # the watch stream broke (aetcd delivers the error as the event)
        if isinstance(event, aetcd.ClientError):
            raise event
        raise aetcd.ConnectionFailedError(one_line(event))
    return True
