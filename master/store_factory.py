"""Opening the state store a ``--store`` URL names; the etcd client is imported only when used."""

from __future__ import annotations

from master.store import MemoryStore, StateStore, StoreError


def open_store(url: str, job_id: str) -> StateStore:
    """``memory://`` or ``etcd://HOST:PORT[,HOST:PORT...]`` → a store for ``job_id``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(f"--store must look like memory:// or etcd://HOST:PORT, got {url!r}")
    if scheme == "memory":
        return MemoryStore()
    if scheme == "etcd":
        from master.etcd_store import EtcdStore  # the etcd client is imported only when used

        return EtcdStore(rest, job_id)
    raise StoreError(f"unknown store scheme {scheme!r} in --store {url!r}; use memory:// or etcd://HOST:PORT")


def check_store(url: str, job_id: str) -> None:
    """Fail fast, with one line, when the store at ``url`` cannot be reached (before serving)."""
    import asyncio

    async def probe() -> None:
        store = open_store(url, job_id)
        try:
            await store.start()
        finally:
            await store.close()

    asyncio.run(probe())
